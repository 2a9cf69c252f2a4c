"""The fake server's batch APIs driven by the providers' own SDKs, each object checked against the
SDK's model (no field the SDK does not know; every required one there). Skipped unless the
``openai`` and ``anthropic`` packages are installed (they are no dependency of batchrun)."""

from __future__ import annotations

import io
import time
from typing import Any

import httpx
import orjson
import pytest

from batchrun.testing import BatchFaults
from tests.unit.batch_helpers import ANTHROPIC_HEADERS, chat_line, jsonl, messages_request, serving

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.timeout(120)


def _strict(model: Any, obj: dict[str, Any]) -> None:
    assert set(obj) <= set(model.model_fields), (model.__name__, set(obj) - set(model.model_fields))
    model.model_validate(obj)


def test_openai_sdk_files_and_batches() -> None:
    from openai.types import Batch, FileDeleted, FileObject
    from openai.types.chat import ChatCompletion

    with serving(BatchFaults(turnaround_s=0.6, p_line_500=0.2, seed=3)) as (_, raw, _):
        client = openai.OpenAI(base_url=str(raw.base_url), api_key="k", max_retries=0)
        file = client.files.create(file=("shard.jsonl", io.BytesIO(jsonl([chat_line(f"r{i}") for i in range(20)]))),
                                   purpose="batch")
        _strict(FileObject, raw.get(f"/files/{file.id}").json())
        ids = [client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"n": str(i)}).id for i in range(3)]
        assert [b.id for b in client.batches.list(limit=1)] == ids[::-1]  # auto-paginates by `after`
        client.batches.cancel(ids[2])
        for batch_id in ids:
            while client.batches.retrieve(batch_id).status not in ("completed", "cancelled"):
                _strict(Batch, raw.get(f"/batches/{batch_id}").json())
                time.sleep(0.05)
            _strict(Batch, raw.get(f"/batches/{batch_id}").json())
        batch = client.batches.retrieve(ids[0])
        for file_id in (batch.output_file_id, batch.error_file_id):
            assert file_id
            for line in client.files.content(file_id).text.splitlines():
                out = orjson.loads(line)
                if out["response"]["status_code"] == 200:
                    ChatCompletion.model_validate(out["response"]["body"])
        for listed in raw.get("/files").json()["data"]:
            _strict(FileObject, listed)
        assert len(list(client.files.list(purpose="batch_output", limit=1))) == 4
        _strict(FileDeleted, raw.delete(f"/files/{file.id}").json())
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file.id)


def test_anthropic_sdk_message_batches() -> None:
    from anthropic.types.messages import (
        DeletedMessageBatch,
        MessageBatch,
        MessageBatchIndividualResponse,
    )

    with serving(BatchFaults(turnaround_s=0.6, p_line_500=0.2, seed=3)) as (server, _, _):
        raw = httpx.Client(base_url=server.anthropic_base_url, headers=ANTHROPIC_HEADERS, timeout=10)
        client = anthropic.Anthropic(base_url=server.anthropic_base_url, api_key="k", max_retries=0)
        requests = [messages_request(f"a-{i}") for i in range(20)]
        ids = [client.messages.batches.create(requests=requests).id for _ in range(3)]  # type: ignore[arg-type]
        assert [b.id for b in client.messages.batches.list(limit=1)] == ids[::-1]  # by `after_id`
        client.messages.batches.cancel(ids[2])
        for batch_id in ids:
            while client.messages.batches.retrieve(batch_id).processing_status != "ended":
                _strict(MessageBatch, raw.get(f"/v1/messages/batches/{batch_id}").json())
                time.sleep(0.05)
            batch = raw.get(f"/v1/messages/batches/{batch_id}").json()
            _strict(MessageBatch, batch)
            results = list(client.messages.batches.results(batch_id))  # through results_url
            assert len(results) == 20
            assert all(isinstance(r, MessageBatchIndividualResponse) for r in results)
            for line in raw.get(batch["results_url"]).content.splitlines():
                _strict(MessageBatchIndividualResponse, orjson.loads(line))
        deleted = raw.delete(f"/v1/messages/batches/{ids[0]}").json()
        _strict(DeletedMessageBatch, deleted)
        raw.close()
