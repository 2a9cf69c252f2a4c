"""A job's results from Python: in input order (:func:`results`), or as its items finish while a
run works it (:func:`as_finished`); each form also ``async``.

A :class:`Result` has the fields of a line of the ``results`` export format — it is built by
the same function (:func:`batchrun.export.results_line`) — with ``output`` an instance of the
job's Pydantic model when it has one (:mod:`batchrun.schemas`).

:func:`as_finished` runs the job (:func:`batchrun.resume`) beside the caller — in a helper
thread with its own event loop for the synchronous form, as a task on the caller's loop for
the ``async`` one; neither installs signal handlers — and reads the ledger for items that
reached a finished state since its last look. A result counts once it is committed, so what
it yields is what a crash would keep. Leaving the loop early (``break`` out of a ``for``
loop, ``close()``, the ``with`` block's end) stops the run cleanly: items in flight finish, the rest stay pending for
the next :func:`batchrun.resume`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchrun.errors import SpecError
from batchrun.export import results_line
from batchrun.ledger import ItemRow, Ledger, LedgerQueries
from batchrun.states import ItemState, StopReason

if TYPE_CHECKING:
    from batchrun.scheduler import JobRunner
    from batchrun.spec import JobSpec
    from batchrun.submission import OnStart, SubmitResult

POLL_SECONDS = 0.25  # between two looks at the ledger while a run works the job
_POLL_SHARE = 0.1  # ... or longer, so that the looks take at most this share of the time
_ASYNC_READ = 500  # results read per trip to the ledger's thread by results_async
_LOOK_ROWS = 1000  # results read from the ledger per look


@dataclass(frozen=True)
class Result:
    """One item's result: the fields of a ``results`` line (README, "Output").

    ``output`` is the answer: text, the parsed JSON for a job with a schema, or an instance of
    the job's Pydantic model; None unless ``status`` is ``succeeded``. ``usage`` has
    ``input_tokens``, ``output_tokens`` and ``cost_usd``; ``error`` has ``class`` and ``message``
    (and ``status_code``, ``line``, ``errors`` where they apply).
    """

    custom_id: str
    status: str
    output: Any
    usage: dict[str, Any] | None
    attempts: int
    latency_ms: float | None
    error: dict[str, Any] | None
    cached: bool = False  # the answer was reused from an earlier request (the response cache)

    @property
    def ok(self) -> bool:
        return self.status == ItemState.SUCCEEDED

    def to_json(self) -> dict[str, Any]:
        """The ``results`` line: a model instance as its JSON, ``cached`` only when true."""
        from batchrun.schemas import as_json

        line = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        line["output"] = as_json(self.output)
        if not self.cached:
            del line["cached"]
        return line


class _Maker:
    """Turns the job's item rows into Results: the export's line, the model's instances."""

    def __init__(self, spec: JobSpec, job_id: int, model: Any) -> None:
        self.structured = spec.output.schema is not None
        self.model = _model_for(spec, job_id, model) if self.structured else None

    def __call__(self, row: ItemRow) -> Result:
        line = results_line(row, structured=self.structured)
        if self.model is not None and line["output"] is not None:
            from batchrun.schemas import ModelError, instance

            try:
                line["output"] = instance(self.model, line["output"])
            except ModelError as exc:  # the schema passed it, the model's own validators did not
                line["error"] = {"class": "model_invalid", "message": f"{self.model.__name__}: {exc}"}
        return Result(**line)


def _model_for(spec: JobSpec, job_id: int, model: Any) -> type | None:
    """The model answers are made into: ``model``, else the job's own (its stored reference), else none."""
    from batchrun.schemas import ModelError, check_model, import_model

    try:
        if model is dict:
            return None
        if model is not None:
            return check_model(model)
        ref = spec.output.schema_model
        return import_model(ref) if ref else None
    except ModelError as exc:
        ref = spec.output.schema_model
        where = f"job {job_id}'s model {ref!r}" if model is None else "model"
        raise SpecError(f"{where}: {exc}; pass model= a Pydantic model class, or model=dict for the JSON") from None


def results(ledger: Ledger, job_id: int, *, model: Any = None) -> Iterator[Result]:
    """Every result of the job in input order (one per input record, as the ``results`` export has them),
    read from the ledger in bounded chunks.

    ``model``: the Pydantic model class answers are made into; by default the job's own (the one its
    ``[output] schema`` names or ``schema=`` gave), ``dict`` for the parsed JSON as it is.
    JobNotFoundError, or SpecError for a model that cannot be had, when called.
    """
    make = _Maker(ledger.get_job(job_id).spec, job_id, model)
    queries = LedgerQueries(ledger.engine)
    shadowed = queries.shadowed_rejections(job_id)
    # a line whose custom_id another line has is in the errors file only, as in the export
    return (make(row) for row in queries.iter_items(job_id) if row.item_id not in shadowed)


async def results_async(ledger: Ledger, job_id: int, *, model: Any = None) -> AsyncIterator[Result]:
    """:func:`results` from async code: the ledger is read in a thread, a chunk at a time."""
    rows = await asyncio.to_thread(results, ledger, job_id, model=model)
    while True:
        chunk = await asyncio.to_thread(_take, rows, _ASYNC_READ)
        for result in chunk:
            yield result
        if len(chunk) < _ASYNC_READ:
            return


def _take(rows: Iterator[Result], n: int) -> list[Result]:
    chunk: list[Result] = []
    for result in rows:
        chunk.append(result)
        if len(chunk) >= n:
            break
    return chunk


class _Watch:
    """What the ledger holds finished that this watch has not handed out yet.

    Below ``frontier`` every item is finished and was found; above it, ``seen`` are the ids
    found. A scan reads the ids of finished items from the frontier on (an index-only read:
    the window the run is working) into ``backlog``; each look hands out up to
    :data:`_LOOK_ROWS` of them, read from the ledger.
    """

    def __init__(self, ledger: Ledger, job_id: int, make: _Maker) -> None:
        self.queries = LedgerQueries(ledger.engine)
        self.job_id = job_id
        self.make = make
        self.frontier = 0
        self.seen: set[int] = set()
        self.backlog: collections.deque[int] = collections.deque()
        self._ended = False

    def step(self, ended: bool) -> tuple[list[Result], bool]:
        """One look, ``ended`` if the run has ended: the results found, and whether they are the last."""
        found = self._look(scan=ended and not self._ended)  # one scan after the end, whatever the backlog
        self._ended = self._ended or ended
        return found, self._ended and not self.backlog

    def _look(self, *, scan: bool) -> list[Result]:
        if scan or not self.backlog:
            frontier = self.queries.finished_frontier(self.job_id)  # first: what is below it is finished now
            new = [i for i in self.queries.finished_ids(self.job_id, self.frontier) if i not in self.seen]
            self.seen.update(new)
            self.backlog.extend(new)
            self.frontier = max(self.frontier, frontier)
            self.seen = {i for i in self.seen if i >= self.frontier}
        taken = [self.backlog.popleft() for _ in range(min(_LOOK_ROWS, len(self.backlog)))]
        rows = self.queries.items_by_id(self.job_id, taken)
        if any(r.state == ItemState.REJECTED for r in rows):
            shadowed = self.queries.shadowed_rejections(self.job_id)
            rows = [r for r in rows if r.item_id not in shadowed]
        return [self.make(r) for r in rows]


class _Stopper:
    """The run's runner, once it starts, so that the caller can stop it from any thread."""

    def __init__(self, chained: OnStart | None) -> None:
        self._chained = chained
        self._lock = threading.Lock()
        self._runner: JobRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asked = False

    def on_start(self, runner: JobRunner, todo: int) -> Any:
        with self._lock:
            self._runner, self._loop = runner, asyncio.get_running_loop()
            if self._asked:
                runner.request_stop(StopReason.STOP, "the caller stopped reading the results")
        return self._chained(runner, todo) if self._chained is not None else None

    def stop(self) -> None:
        with self._lock:
            self._asked = True
            if self._runner is not None and self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the run has ended
                    self._loop.call_soon_threadsafe(
                        self._runner.request_stop, StopReason.STOP, "the caller stopped reading the results"
                    )


class Finishing:
    """The results of a job as its items finish, while a run works it (:func:`as_finished`).

    Iterate it (once); ``result`` is the run's :class:`~batchrun.SubmitResult` once the
    iteration has ended. Leaving the ``for`` loop early, ``close()`` or the end of a ``with``
    block stops the run cleanly.
    """

    def __init__(self, ledger: Ledger, job_id: int, *, model: Any, poll_seconds: float, run: dict[str, Any]) -> None:
        self.job_id = job_id
        self.result: SubmitResult | None = None
        self._ledger = ledger
        self._watch = _Watch(ledger, job_id, _Maker(ledger.get_job(job_id).spec, job_id, model))
        self._poll = poll_seconds
        self._stopper = _Stopper(run.pop("on_start", None))
        self._run_kwargs = run
        self._ready: collections.deque[Result] = collections.deque()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._over = False

    def _run(self) -> None:
        from batchrun.submission import resume

        try:
            self.result = resume(self._ledger, self.job_id, on_start=self._stopper.on_start, **self._run_kwargs)
        except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread by __next__)
            self._failure = exc

    def __iter__(self) -> Iterator[Result]:
        """The results; leaving a ``for`` loop over them early (``break``, an exception) stops the run."""
        try:
            while True:
                try:
                    result = next(self)
                except StopIteration:
                    return
                yield result
        finally:
            self.close()

    def __next__(self) -> Result:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="batchrun-run", daemon=True)
            self._thread.start()
        while not self._ready:
            if self._over:
                raise StopIteration
            ended = not self._thread.is_alive()  # asked first: a look after the end sees every result
            if ended and self._failure is not None:
                self._over = True
                raise self._failure
            started = time.monotonic()
            found, self._over = self._watch.step(ended)
            self._ready.extend(found)
            if not ended and not found:
                self._thread.join(max(self._poll, (time.monotonic() - started) / _POLL_SHARE))
        return self._ready.popleft()

    def close(self) -> None:
        """Stop the run (if it is still working) and wait for it to wind down."""
        if self._thread is not None and self._thread.is_alive():
            self._stopper.stop()
            self._thread.join()
        self._over = True

    def __enter__(self) -> Finishing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FinishingAsync:
    """:class:`Finishing` for ``async for``: the run is a task on the caller's loop. ``aclose()`` stops it."""

    def __init__(self, ledger: Ledger, job_id: int, *, model: Any, poll_seconds: float, run: dict[str, Any]) -> None:
        self.job_id = job_id
        self.result: SubmitResult | None = None
        self._ledger = ledger
        self._model = model
        self._poll = poll_seconds
        self._stopper = _Stopper(run.pop("on_start", None))
        self._run_kwargs = run
        self._ready: collections.deque[Result] = collections.deque()
        self._watch: _Watch | None = None
        self._task: asyncio.Task[SubmitResult] | None = None
        self._over = False

    def __aiter__(self) -> FinishingAsync:
        return self

    async def __anext__(self) -> Result:
        from batchrun.submission import resume_async

        if self._watch is None:
            spec = (await asyncio.to_thread(self._ledger.get_job, self.job_id)).spec
            self._watch = _Watch(self._ledger, self.job_id, _Maker(spec, self.job_id, self._model))
            self._task = asyncio.ensure_future(
                resume_async(self._ledger, self.job_id, on_start=self._stopper.on_start, **self._run_kwargs)
            )
        assert self._task is not None
        while not self._ready:
            if self._over:
                raise StopAsyncIteration
            ended = self._task.done()
            if ended and self._task.exception() is not None:
                self._over = True
                raise self._task.exception()  # type: ignore[misc]
            if ended:
                self.result = self._task.result()
            started = time.monotonic()
            found, self._over = await asyncio.to_thread(self._watch.step, ended)
            self._ready.extend(found)
            if not ended and not found:
                await asyncio.wait([self._task], timeout=max(self._poll, (time.monotonic() - started) / _POLL_SHARE))
        return self._ready.popleft()

    async def aclose(self) -> None:
        """Stop the run (if it is still working) and wait for it to wind down."""
        if self._task is not None and not self._task.done():
            self._stopper.stop()
            self.result = await self._task
        self._over = True

    async def __aenter__(self) -> FinishingAsync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def as_finished(
    ledger: Ledger, job_id: int, *, model: Any = None, poll_seconds: float = POLL_SECONDS, **run: Any
) -> Finishing:
    """Run job ``job_id`` (as :func:`batchrun.resume` does) and yield each item's :class:`Result` as it finishes.

    Items finished before the run (earlier runs, rejected lines) come first. ``run`` takes the
    keyword arguments of :func:`batchrun.resume` (``output``, ``overrides``, ``options``, ``on_start``, ...);
    ``model`` is as for :func:`results`. Safe inside a running event loop (a notebook): the run has a
    loop of its own in a helper thread, and no signal handler is installed.
    """
    return Finishing(ledger, job_id, model=model, poll_seconds=poll_seconds, run=run)


def as_finished_async(
    ledger: Ledger, job_id: int, *, model: Any = None, poll_seconds: float = POLL_SECONDS, **run: Any
) -> FinishingAsync:
    """:func:`as_finished` for ``async for``, the run on the caller's loop (:func:`batchrun.resume_async`)."""
    return FinishingAsync(ledger, job_id, model=model, poll_seconds=poll_seconds, run=run)
