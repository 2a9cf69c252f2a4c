"""batchrun.ledger.reconnect: riding out a lost database connection, and only that."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from batchrun.ledger.reconnect import is_transient, ride_out


def test_ride_out_retries_disconnects_only_and_gives_up_in_time() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise OperationalError("SELECT 1", {}, psycopg.OperationalError("server closed the connection unexpectedly"))
        return "ok"

    async def broken() -> str:
        raise IntegrityError("INSERT", {}, Exception("duplicate key"))

    async def down() -> str:
        raise OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused"))

    async def disk() -> str:  # an error of the database itself, not of the connection: at once
        raise OperationalError("INSERT", {}, Exception("disk I/O error"))

    assert asyncio.run(ride_out(flaky, for_seconds=10, what="test")) == "ok" and calls == 3
    with pytest.raises(IntegrityError):
        asyncio.run(ride_out(broken, for_seconds=10, what="test"))
    with pytest.raises(OperationalError):
        asyncio.run(ride_out(down, for_seconds=0.3, what="test"))
    started = time.monotonic()
    with pytest.raises(OperationalError):
        asyncio.run(ride_out(disk, for_seconds=10, what="test"))
    assert time.monotonic() - started < 1
    assert is_transient(OperationalError("x", {}, psycopg.OperationalError("y")))
    assert not is_transient(OperationalError("x", {}, Exception("y")))
    assert not is_transient(ValueError())
