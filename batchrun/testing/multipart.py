"""``multipart/form-data`` read as it arrives (RFC 7578), for ``POST /v1/files``: the file part
goes straight to disk, so an upload of hundreds of MB never sits in memory.

Written here rather than taken from a library for the reason ``wire`` is: the fake server reads
its requests itself, from the socket, and the package adds no dependency for its test server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import IO

_MAX_FIELD_BYTES = 64 * 1024  # a form field that is not a file (purpose, ...)
_MAX_PART_HEAD_BYTES = 16 * 1024


class FormError(Exception):
    """The body is not the multipart form it claims to be (answered 400)."""


@dataclass
class Form:
    """The fields of a form, and the one file part (its name, size; its bytes went to disk)."""

    fields: dict[str, str] = field(default_factory=dict)
    file_field: str | None = None
    filename: str | None = None
    file_bytes: int = 0


def boundary_of(content_type: bytes | None) -> bytes | None:
    """The boundary of a ``multipart/form-data`` content type, else None."""
    if content_type is None:
        return None
    kind, _, params = content_type.partition(b";")
    if kind.strip().lower() != b"multipart/form-data":
        return None
    for param in params.split(b";"):
        name, _, value = param.strip().partition(b"=")
        if name.strip().lower() == b"boundary":
            value = value.strip()
            if len(value) >= 2 and value[:1] == value[-1:] == b'"':
                value = value[1:-1]
            return value or None
    return None


def _disposition(head: bytes) -> tuple[str, str | None]:
    """(name, filename or None) from a part's ``Content-Disposition`` header."""
    for line in head.split(b"\r\n"):
        key, sep, value = line.partition(b":")
        if not sep or key.strip().lower() != b"content-disposition":
            continue
        name: str | None = None
        filename: str | None = None
        for param in value.split(b";")[1:]:
            pkey, _, pvalue = param.strip().partition(b"=")
            text = pvalue.strip().strip(b'"').decode("utf-8", "replace")
            if pkey.strip().lower() == b"name":
                name = text
            elif pkey.strip().lower() == b"filename":
                filename = text
        if name is None:
            break
        return name, filename
    raise FormError("a form part has no Content-Disposition name")


async def read_form(pieces: AsyncIterator[bytes], boundary: bytes, sink: IO[bytes]) -> Form:
    """Read a whole form from ``pieces``; the one part with a filename is written to ``sink``."""
    delim = b"\r\n--" + boundary
    keep = len(delim) + 1  # bytes held back: a delimiter may straddle two pieces
    form = Form()
    buf = bytearray(b"\r\n")  # so the first boundary line reads as a delimiter
    state = "preamble"
    part_name = ""
    part_value = bytearray()
    to_file = False
    async for piece in pieces:
        buf += piece
        while True:
            if state in ("preamble", "data"):
                at = buf.find(delim)
                if at < 0:
                    cut = max(len(buf) - keep, 0)
                    if state == "data" and cut:
                        _take(form, sink, to_file, part_value, buf[:cut])
                    del buf[:cut]
                    break
                if state == "data":
                    _take(form, sink, to_file, part_value, buf[:at])
                    if not to_file:
                        form.fields[part_name] = part_value.decode("utf-8", "replace")
                del buf[:at + len(delim)]
                state = "after"
            if state == "after":
                if len(buf) < 2:
                    break
                if buf[:2] == b"--":
                    state = "epilogue"
                elif buf[:2] == b"\r\n":
                    del buf[:2]
                    state = "head"
                else:
                    raise FormError("malformed boundary line")
            if state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > _MAX_PART_HEAD_BYTES:
                        raise FormError("form part head too large")
                    break
                part_name, filename = _disposition(bytes(buf[:end]))
                del buf[:end + 4]
                to_file = filename is not None
                if to_file:
                    if form.file_field is not None:
                        raise FormError("only one file may be uploaded")
                    form.file_field, form.filename = part_name, filename
                part_value = bytearray()
                state = "data"
                continue
            if state == "epilogue":
                buf.clear()
                break
    if state != "epilogue":
        raise FormError("the form ends before its closing boundary")
    return form


def _take(form: Form, sink: IO[bytes], to_file: bool, value: bytearray, data: bytearray) -> None:
    if to_file:
        sink.write(data)
        form.file_bytes += len(data)
        return
    value += data
    if len(value) > _MAX_FIELD_BYTES:
        raise FormError("a form field is too large")
