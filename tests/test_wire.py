"""The scoring client's HTTP/1.1 transport (``scoring/backends/wire.py``) against real sockets:
a scripted asyncio server on 127.0.0.1 answers each request with the bytes a test gives it,
so framing (Content-Length, chunked, until close), keep-alive and reuse, and malformed or
cut-off answers are seen exactly as a server would send them."""

from __future__ import annotations

import asyncio
import base64
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from _waiting import HANG_GUARD_S

from hcapo_store.errors import InferenceError
from hcapo_store.scoring.backends.http import HttpClient
from hcapo_store.scoring.backends.wire import StreamTransport, transport_for

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # (request head, writer) -> keep open?


def _ok(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return head + b"".join(h + b"\r\n" for h in extra) + b"\r\n" + body


class Scripted:
    """Answers the n-th request (over all connections) with ``answers[n]``; records each
    request's head and which connection it came on."""

    def __init__(self, answers: list[bytes | Answer]) -> None:
        self.answers = answers
        self.requests: list[tuple[int, bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        me = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                n = len(self.requests)
                self.requests.append((me, head))
                answer = self.answers[n]
                if isinstance(answer, bytes):
                    writer.write(answer)
                    await writer.drain()
                elif not await answer(head, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _run(answers: list[bytes | Answer], body: Callable[[Scripted, HttpClient], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        async with Scripted(answers) as server:
            client = HttpClient(kw.pop("url", None) or server.url, **kw)
            try:
                return await body(server, client)
            finally:
                await client.close()

    return asyncio.run(main())


def test_content_length_answers_reuse_one_connection() -> None:
    async def body(server: Scripted, client: HttpClient) -> None:
        for n in range(3):
            assert await client.post_json("/generate", {"n": n}) == {"n": n}
        assert server.connections == client.connections_opened == 1
        assert [c for c, _ in server.requests] == [1, 1, 1]
        head = server.requests[0][1]
        assert head.startswith(b"POST /generate HTTP/1.1\r\n") and b"Content-Type: application/json" in head

    _run([_ok(b'{"n": %d}' % n) for n in range(3)], body)


def test_chunked_answers_with_extensions_and_trailers() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'4;ext=1\r\n{"a"\r\n3\r\n: [\r\n'
        b"A\r\n1, 2, 3]} \r\n0\r\nX-Trailer: yes\r\n\r\n"
    )

    async def body(server: Scripted, client: HttpClient) -> None:
        assert await client.post_json("/generate", {}) == {"a": [1, 2, 3]}
        assert await client.post_json("/generate", {}) == {"a": [1, 2, 3]}
        assert server.connections == 1  # read to its end: the connection is kept

    _run([chunked, chunked], body)


def test_an_answer_without_length_ends_when_the_server_closes() -> None:
    async def close_after(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"x": ')
        await writer.drain()
        writer.write(b"1}")
        return False  # close: that ends the body

    async def body(server: Scripted, client: HttpClient) -> None:
        assert await client.post_json("/generate", {}) == {"x": 1}
        assert await client.post_json("/generate", {}) == {"x": 1}
        assert server.connections == client.connections_opened == 2

    _run([close_after, close_after], body)


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 200 OK\r\nConnection: close\r\n", b"HTTP/1.0 200 OK\r\n"],
    ids=["connection-close", "http-1.0"],
)
def test_connections_the_server_will_close_are_not_reused(head: bytes) -> None:
    answer = head + b"Content-Length: 2\r\n\r\n{}"

    async def body(server: Scripted, client: HttpClient) -> None:
        assert await client.post_json("/generate", {}) == {}
        assert await client.post_json("/generate", {}) == {}
        assert server.connections == 2

    _run([answer, answer], body)


def test_a_kept_connection_the_server_closed_meanwhile_is_not_used() -> None:
    closed = asyncio.Event()

    async def answer_then_close(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(_ok(b"{}"))
        await writer.drain()
        closed.set()
        return False  # the server closes the idle connection (a keep-alive timeout)

    async def body(server: Scripted, client: HttpClient) -> None:
        assert await client.post_json("/generate", {}) == {}
        await closed.wait()
        transport = client._transport
        assert isinstance(transport, StreamTransport)
        kept = [c for conns in transport._idle.values() for c in conns]
        deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
        while kept[0].usable():  # until the client's loop has seen the server close it
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        assert await client.post_json("/generate", {}) == {}
        assert server.connections == 2 and client.connections_opened == 2

    _run([answer_then_close, _ok(b"{}")], body)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SPDY/3 200 OK\r\n\r\n{}", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed response header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk-size line"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (70 << 10) + b"\r\n\r\n", "response head longer than"),
    ],
    ids=["status-line", "status-code", "header-line", "two-lengths", "negative-length", "chunk-size", "huge-head"],
)
def test_malformed_answers_are_connection_failures(answer: bytes, message: str) -> None:
    async def body(server: Scripted, client: HttpClient) -> None:
        with pytest.raises(InferenceError) as info:
            await client.post_json("/generate", {})
        assert info.value.kind == "connect" and info.value.retryable and message in str(info.value)

    _run([answer], body)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", "after 2 of 10 body bytes"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc", "in the middle of the response body"),
        (b"HTTP/1.1 200 OK\r\nContent-", "in the middle of the response head"),
        (b"", "without sending a response"),
    ],
    ids=["short-body", "short-chunk", "short-head", "nothing"],
)
def test_answers_cut_off_by_the_server_are_connection_failures(answer: bytes, message: str) -> None:
    async def cut(head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer)
        await writer.drain()
        return False

    async def body(server: Scripted, client: HttpClient) -> None:
        with pytest.raises(InferenceError) as info:
            await client.post_json("/generate", {})
        assert info.value.kind == "connect" and message in str(info.value)
        assert len(server.requests) == 1  # a failed request is not sent again by the transport

    _run([cut], body)


def test_a_body_refused_past_its_cap_closes_its_connection() -> None:
    big = _ok(b"[" + b"1," * 200_000 + b"1]")

    async def body(server: Scripted, client: HttpClient) -> None:
        with pytest.raises(InferenceError) as info:
            await client.get_json("/model_info")  # a GET may have 16 MiB: this one is under
        assert info.value.kind == "too_large"  # … but the cap is checked on the declared length

    async def small_cap(server: Scripted, client: HttpClient) -> None:
        await body(server, client)
        assert await client.get_json("/health") == {}
        assert server.connections == 2  # the refused answer's connection was not reused

    import hcapo_store.scoring.backends.http as http

    saved = http.GET_CAP_BYTES
    http.GET_CAP_BYTES = 1000
    try:
        _run([big, _ok(b"{}")], small_cap)
    finally:
        http.GET_CAP_BYTES = saved


def test_credentials_in_the_url_are_sent_as_basic_auth_else_the_key_as_bearer() -> None:
    async def body(server: Scripted, client: HttpClient) -> None:
        await client.get_json("/model_info")

    async def main() -> list[bytes]:
        heads = []
        for url_auth, key in ((True, None), (True, "k3y"), (False, "k3y")):
            async with Scripted([_ok(b"{}")]) as server:
                url = server.url.replace("://", "://us%40er:p%3Ass@") if url_auth else server.url
                client = HttpClient(url, api_key=key)
                await body(server, client)
                await client.close()
                heads.append(server.requests[0][1])
        return heads

    basic = b"Authorization: Basic " + base64.b64encode(b"us@er:p:ss")
    with_url, both, key_only = asyncio.run(main())
    assert basic in with_url and basic in both  # as httpx's client: the URL's credentials win
    assert b"Authorization: Bearer k3y" in key_only and b"us" not in key_only.split(b"\r\n")[0]


def test_at_most_max_connections_requests_at_once() -> None:
    started: list[int] = []
    release = asyncio.Event()

    async def slow(head: bytes, writer: asyncio.StreamWriter) -> bool:
        started.append(1)
        await release.wait()
        writer.write(_ok(b"{}"))
        await writer.drain()
        return True

    async def body(server: Scripted, client: HttpClient) -> None:
        calls = [asyncio.ensure_future(client.post_json("/generate", {})) for _ in range(5)]
        while len(started) < 2:
            await asyncio.sleep(0.01)
        transport = client._transport
        assert isinstance(transport, StreamTransport)
        assert transport._slots.locked()  # both slots taken: the other three wait for one
        assert len(started) == 2
        release.set()
        assert await asyncio.gather(*calls) == [{}] * 5
        assert server.connections == 2

    _run([slow] * 5, body, max_connections=2)


def test_a_proxy_from_the_environment_goes_through_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
    ):
        monkeypatch.delenv(name, raising=False)
    assert isinstance(transport_for("http://10.0.0.1:30000", max_connections=4, connect_timeout=1), StreamTransport)
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    proxied = transport_for("http://10.0.0.1:30000", max_connections=4, connect_timeout=1)
    assert isinstance(proxied, httpx.AsyncHTTPTransport)
    monkeypatch.setenv("no_proxy", "10.0.0.1")
    assert isinstance(transport_for("http://10.0.0.1:30000", max_connections=4, connect_timeout=1), StreamTransport)


def test_a_refused_connection_is_a_connect_failure() -> None:
    async def main() -> None:
        async with Scripted([]) as server:
            url = server.url
        client = HttpClient(url)  # the server is gone: nothing listens there now
        with pytest.raises(InferenceError) as info:
            await client.get_json("/health")
        assert info.value.kind == "connect" and info.value.retryable
        await client.close()

    asyncio.run(main())


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.parametrize("trusted", [True, False])
def test_https_with_the_certificate_checked(trusted: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = _self_signed(tmp_path)
    if trusted:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # as httpx: the environment's CA file
    else:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)

    async def main() -> None:
        scripted = Scripted([_ok(b'{"tls": true}')] * 2)
        scripted.server = await asyncio.start_server(scripted._serve, "127.0.0.1", 0, ssl=server_context)
        client = HttpClient(scripted.url.replace("http://", "https://"))
        try:
            if trusted:
                assert await client.post_json("/generate", {}) == {"tls": True}
                assert await client.post_json("/generate", {}) == {"tls": True}
                assert scripted.connections == client.connections_opened == 1
            else:
                with pytest.raises(InferenceError) as info:
                    await client.post_json("/generate", {})
                assert info.value.kind == "connect" and "CERTIFICATE_VERIFY_FAILED" in str(info.value)
        finally:
            await client.close()
            await scripted.__aexit__()

    asyncio.run(main())
