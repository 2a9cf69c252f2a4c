"""The ledger schema: jobs, items, attempts, runs, exports and rate buckets.

Times are UNIX seconds as floats: portable between SQLite and PostgreSQL and
cheap to compare on the hot path.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class ItemState:
    """The states of an item (see DESIGN.md)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INVALID_OUTPUT = "invalid_output"
    REJECTED = "rejected"
    CANCELLED = "cancelled"

    ALL = (PENDING, RUNNING, SUCCEEDED, FAILED, INVALID_OUTPUT, REJECTED, CANCELLED)
    FINAL = (SUCCEEDED, FAILED, INVALID_OUTPUT, REJECTED, CANCELLED)
    RETRYABLE = (FAILED, INVALID_OUTPUT)


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
    spec_source: Mapped[str] = mapped_column(Text)
    spec_json: Mapped[str] = mapped_column(Text)
    spec_hash: Mapped[str] = mapped_column(String(64))
    input_path: Mapped[str] = mapped_column(Text)
    input_hash: Mapped[str] = mapped_column(String(64))
    ingest_done: Mapped[bool] = mapped_column(Boolean, default=False)
    total: Mapped[int] = mapped_column(Integer, default=0)
    lock_run_id: Mapped[str | None] = mapped_column(String(32))
    lock_pid: Mapped[int | None] = mapped_column(Integer)
    lock_host: Mapped[str | None] = mapped_column(String(255))
    lock_since: Mapped[float | None] = mapped_column(Float)
    lock_heartbeat: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (Index("ix_jobs_identity", "spec_hash", "input_hash"),)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    command: Mapped[str] = mapped_column(String(32))
    pid: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    exit_code: Mapped[int | None] = mapped_column(Integer)


class Item(Base):
    __tablename__ = "items"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(Text)
    url: Mapped[str | None] = mapped_column(Text)
    body: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    lease_owner: Mapped[str | None] = mapped_column(String(32))
    lease_expires: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    status_code: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[str | None] = mapped_column(Text)
    output: Mapped[str | None] = mapped_column(Text)
    parsed: Mapped[str | None] = mapped_column(Text)
    validation_errors: Mapped[str | None] = mapped_column(Text)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(String(200))
    error_class: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    input_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    cost_usd: Mapped[float | None] = mapped_column(Float)
    # The response cache: the key of the item's first request (batchrun.cache), and the
    # item whose answer was reused for this one (null: this item's answer was paid for).
    request_hash: Mapped[str | None] = mapped_column(String(64))
    cached_from: Mapped[int | None] = mapped_column(BigId)

    __table_args__ = (
        Index("ix_items_claim", "job_id", "state", "id"),
        Index(
            "ix_items_answered_by_request",
            "request_hash",
            "id",
            sqlite_where=text("state = 'succeeded'"),
            postgresql_where=text("state = 'succeeded'"),
        ),
        Index(
            "ix_items_reused",
            "job_id",
            sqlite_where=text("cached_from IS NOT NULL"),
            postgresql_where=text("cached_from IS NOT NULL"),
        ),
        Index("ix_items_job_line", "job_id", "line"),
        # Only rejected lines may repeat a custom_id (a duplicate is itself rejected).
        Index(
            "uq_items_job_custom_id",
            "job_id",
            "custom_id",
            unique=True,
            sqlite_where=text("state != 'rejected'"),
            postgresql_where=text("state != 'rejected'"),
        ),
    )


class Attempt(Base):
    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[str] = mapped_column(String(32))
    number: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    queue_wait_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error_class: Mapped[str | None] = mapped_column(String(64))
    input_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    cost_usd: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)  # streamed attempts: time to first token
    tpot_ms: Mapped[float | None] = mapped_column(Float)  # streamed attempts: ms per output token after the first


class Export(Base):
    __tablename__ = "exports"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(32))
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    lines: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)


class RateBucket(Base):
    """A job's requests- or tokens-per-minute budget, shared by all its runs (PostgreSQL workers).

    A token bucket that may go into debt: a take subtracts what it asks for and
    the taker waits ``-level / rate`` seconds when the level is negative. Times
    are the database's clock, so hosts with skewed clocks share it fairly.
    """

    __tablename__ = "rate_buckets"

    job_id: Mapped[int] = mapped_column(BigId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # "requests" or "tokens"
    level: Mapped[float] = mapped_column(Float)
    rate: Mapped[float] = mapped_column(Float)  # per second
    capacity: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
