"""batchrun.testing.multipart: a multipart/form-data body read piece by piece, its file to disk."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

import pytest

from batchrun.testing.multipart import Form, FormError, boundary_of, read_form

BODY = (b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
        b"Content-Type: application/octet-stream\r\n\r\n"
        b"line one --XyZ is not a boundary\r\n-XyZ nor\r\n--XyW this\r\nend\r\n"
        b"\r\n--XyZ--\r\nepilogue")
FILE = b"line one --XyZ is not a boundary\r\n-XyZ nor\r\n--XyW this\r\nend\r\n"


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def _read(data: bytes, size: int, boundary: bytes = b"XyZ") -> tuple[Form, bytes]:
    sink = io.BytesIO()
    form = asyncio.run(read_form(_pieces(data, size), boundary, sink))
    return form, sink.getvalue()


@pytest.mark.parametrize("size", list(range(1, 24)) + [len(BODY)])
def test_every_split_of_the_body_reads_the_same(size: int) -> None:
    form, data = _read(BODY, size)
    assert form.fields == {"purpose": "batch"}
    assert (form.file_field, form.filename, form.file_bytes) == ("file", "in.jsonl", len(FILE))
    assert data == FILE


@pytest.mark.parametrize("body,message", [
    (BODY[: BODY.index(b"\r\n--XyZ--")], "closing boundary"),
    (BODY.replace(b'name="purpose"', b'filename="second.bin"; name="other"'), "only one file"),
    (b"--XyZ\r\nContent-Type: text/plain\r\n\r\nx\r\n--XyZ--\r\n", "no Content-Disposition name"),
    (b"--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n" + b"v" * 70_000 + b"\r\n--XyZ--",
     "too large"),
    (b"--XyZ!!\r\n", "malformed boundary line"),
])
def test_malformed_forms(body: bytes, message: str) -> None:
    with pytest.raises(FormError, match=message):
        _read(body, 5)


@pytest.mark.parametrize("value,boundary", [
    (b"multipart/form-data; boundary=abc", b"abc"),
    (b'Multipart/Form-Data; charset=utf-8; boundary="a b c"', b"a b c"),
    (b"application/json", None), (None, None), (b"multipart/form-data", None),
])
def test_boundary_of(value: bytes | None, boundary: bytes | None) -> None:
    assert boundary_of(value) == boundary
