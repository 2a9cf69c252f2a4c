"""The HTTP side of providers without a network: the Sender over an injected transport."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import ssl
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest

from batchrun.errors import RateLimitedError, RetryableError
from batchrun.providers import Provider, Reply, provider_for
from batchrun.providers.base import PreparedRequest
from batchrun.providers.http import Sender, _http_request, tls_context
from batchrun.spec import JobSpec, parse_spec

ANSWER = {"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


def chat_spec(base_url: str = "http://127.0.0.1:9/v1") -> JobSpec:
    return parse_spec({"provider": {"kind": "openai", "base_url": base_url, "model": "m"},
                       "request": {"template": "{text}"}}, where="test.toml")


def chat_provider(base_url: str = "http://127.0.0.1:9/v1") -> Provider:
    return provider_for(chat_spec(base_url), api_key="sk-test-0123456789abcdef")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8765/v1/chat/completions", "https://api.openai.com/v1/responses", "http://h:80/v1/messages"]
)
def test_the_request_handed_to_the_transport_is_the_one_httpx_builds(url: str) -> None:
    headers = httpx.Headers({"content-type": "application/json", "authorization": "Bearer k", "user-agent": "batchrun"})
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "héllo"}]})
    ours = _http_request(PreparedRequest(url, headers, body), {"read": 5.0})
    theirs = httpx.Request("POST", url, headers=headers, content=body)
    assert (ours.method, ours.url, ours.headers.raw, ours.content) == (
        theirs.method, theirs.url, theirs.headers.raw, theirs.content
    )
    assert ours.extensions == {"timeout": {"read": 5.0}}


def test_a_sender_sends_on_the_transport_it_is_given_and_closes_it() -> None:
    seen: list[httpx.Request] = []
    closed: list[bool] = []

    class Recording(httpx.MockTransport):
        async def aclose(self) -> None:
            closed.append(True)

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=ANSWER, headers={"x-request-id": "req-1"})

    provider = chat_provider()
    request = provider.prepare(None, orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}).decode())

    async def go() -> Reply:
        async with Sender(Recording(answer), httpx.Timeout(5.0)) as sender:
            return await sender.send(provider, request, total_timeout=5.0)

    reply = asyncio.run(go())
    assert (reply.output, reply.input_tokens, reply.request_id) == ("hi", 3, "req-1")
    assert [str(r.url) for r in seen] == ["http://127.0.0.1:9/v1/chat/completions"]
    assert seen[0].headers["authorization"] == "Bearer sk-test-0123456789abcdef"
    assert seen[0].extensions["timeout"] == httpx.Timeout(5.0).as_dict()
    assert closed == [True]


def test_a_sender_classifies_statuses_and_transport_failures() -> None:
    provider = chat_provider()
    request = provider.prepare(None, orjson.dumps({"messages": []}).decode())

    def send(handler: Callable[[httpx.Request], httpx.Response]) -> BaseException:
        async def go() -> None:
            async with Sender(httpx.MockTransport(handler), httpx.Timeout(5.0)) as sender:
                await sender.send(provider, request, total_timeout=5.0)

        with pytest.raises(Exception) as info:
            asyncio.run(go())
        return info.value

    def limited(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "slow down"}}, headers={"retry-after": "7"})

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    error = send(limited)
    assert isinstance(error, RateLimitedError) and error.retry_after == 7.0 and "slow down" in str(error)
    error = send(refused)
    assert isinstance(error, RetryableError) and error.error_class == "connection"


def test_an_unknown_transport_is_refused() -> None:
    spec = parse_spec({"provider": {"base_url": "http://h"}}, where="test.toml")
    with pytest.raises(ValueError, match="expected aiohttp or httpx"):
        Sender.for_spec(spec, transport="carrier-pigeon")


def test_only_a_plain_http_endpoint_skips_the_ca_bundle() -> None:
    assert tls_context("https://api.openai.com/v1") is True and tls_context(None) is True
    context = tls_context("http://127.0.0.1:8000/v1")
    assert isinstance(context, ssl.SSLContext)
    # It still checks names and certificates, against no CA at all.
    assert (context.verify_mode, context.check_hostname) == (ssl.CERT_REQUIRED, True)
    assert context.cert_store_stats()["x509"] == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a self-signed certificate")
@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_a_sender_for_a_plain_http_endpoint_refuses_any_tls_server(tmp_path: Path, transport: str) -> None:
    """The context a plain-http job gets fails closed: a TLS request through it is never made unverified."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        capture_output=True,
    )
    if made.returncode != 0:  # an openssl before 1.1.1 (no -addext)
        pytest.skip(f"openssl could not make a certificate: {made.stderr.decode(errors='replace').strip()}")
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    handshakes: list[str] = []

    async def go() -> BaseException:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            handshakes.append("done")  # never reached: the client gives up in the handshake
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_context)
        port = server.sockets[0].getsockname()[1]
        spec = chat_spec()
        request = PreparedRequest(f"https://127.0.0.1:{port}/v1/chat/completions",
                                  httpx.Headers({"content-type": "application/json"}), b"{}")
        try:
            async with Sender.for_spec(spec, transport=transport) as sender:
                if transport == "aiohttp":  # the job's context reached the transport: no CA loaded at all
                    assert sender._transport.ssl_context.cert_store_stats()["x509"] == 0
                with pytest.raises(RetryableError) as info:
                    await sender.send(chat_provider(), request, total_timeout=5.0)
                return info.value
        finally:
            server.close()
            await server.wait_closed()

    error = asyncio.run(go())
    assert error.error_class == "tls", error
    assert handshakes == []


def _serve_once_per_request(respond: Callable[[], bytes]) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]:
    """A raw HTTP/1.1 handler: reads each request (headers and Content-Length body), writes ``respond()``."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(respond())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


def _http_answer(body: bytes, *headers: str, length: int | None = None) -> bytes:
    lines = ["HTTP/1.1 200 OK", "Content-Type: application/json", f"Content-Length: {len(body) if length is None else length}",
             *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize("encoding", [None, "gzip", "deflate"])
def test_the_aiohttp_transport_reads_plain_and_compressed_answers(encoding: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain body is read from aiohttp in one call; a compressed one is decoded by httpx."""
    one_call_reads: list[int] = []
    read = aiohttp.ClientResponse.read

    async def counted_read(self: aiohttp.ClientResponse) -> bytes:
        one_call_reads.append(1)
        return await read(self)

    monkeypatch.setattr(aiohttp.ClientResponse, "read", counted_read)  # a spy: aiohttp still reads
    body = orjson.dumps(ANSWER)
    if encoding == "gzip":
        sent, headers = gzip.compress(body), ["Content-Encoding: gzip"]
    elif encoding == "deflate":
        sent, headers = zlib.compress(body), ["Content-Encoding: deflate"]
    else:
        sent, headers = body, []

    async def go() -> tuple[Reply, bool]:
        server = await asyncio.start_server(_serve_once_per_request(lambda: _http_answer(sent, *headers)), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1"
        spec, provider = chat_spec(url), chat_provider(url)
        request = provider.prepare(None, orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}).decode())
        try:
            async with Sender.for_spec(spec) as sender:
                replies = [await sender.send(provider, request, total_timeout=5.0) for _ in range(3)]  # one connection
                # What the one-call read relies on (httpx_aiohttp's stream keeps aiohttp's response there):
                transport = sender._transport
                response = await transport.handle_async_request(_http_request(request, {}))
                direct = getattr(response.stream, "_aiohttp_response", None) is not None
                await response.aclose()
            return replies[-1], direct
        finally:
            server.close()
            await server.wait_closed()

    reply, direct = asyncio.run(go())
    assert (reply.output, reply.input_tokens) == ("hi", 3)
    assert direct
    assert len(one_call_reads) == (3 if encoding is None else 0)


def test_an_answer_cut_short_through_the_aiohttp_transport_is_retryable() -> None:
    body = orjson.dumps(ANSWER)

    async def go() -> BaseException:
        async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(_http_answer(body[:10], length=len(body)))  # promises more than it sends
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(cut, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1"
        spec, provider = chat_spec(url), chat_provider(url)
        request = provider.prepare(None, orjson.dumps({"messages": []}).decode())
        try:
            async with Sender.for_spec(spec) as sender:
                with pytest.raises(RetryableError) as info:
                    await sender.send(provider, request, total_timeout=5.0)
                return info.value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(go()).error_class == "truncated_body"
