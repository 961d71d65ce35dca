"""The scoring client's HTTP (``scoring/backends/http.py`` over httpx's own transport) against
real sockets: a scripted asyncio server on 127.0.0.1 answers each request with the bytes a
test gives it, so framing (Content-Length, chunked, until close), keep-alive and reuse,
malformed, cut-off and hostile answers (stray bytes, bare LF line ends, Transfer-Encoding
other than chunked, endless trailers, lenient chunk sizes, an early response, an encoding
never asked for) are seen exactly as a server would send them. Every request runs under a
deadline far above the test's life (``HANG_GUARD_S``): a hostile answer must end the request
by itself, as a failure of its own kind, never as a timeout. A server that stops reading a
request's body ends it by the write-stall bound, a slow reader does not (raw sockets with a
small receive buffer)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import os
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from _waiting import HANG_GUARD_S

from hcapo_store.errors import InferenceError
from hcapo_store.scoring.backends.http import BAD_ENCODING, WRITE_PIECE, HttpClient, transport_for

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # (request head, writer) -> keep open?
KIND = "auto"  # the transport every client here uses: each test runs over each kind


@pytest.fixture(autouse=True, params=["auto", "anyio", "httpx"])
def transport_kind(request: pytest.FixtureRequest) -> str:
    """auto: the origin pool on the event loop's sockets (http; TLS on anyio's streams); anyio:
    the origin pool on httpcore's anyio streams; httpx: httpx's own transport (used through a
    proxy). Each must behave as the others on every answer here."""
    global KIND
    KIND = request.param
    return KIND


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
            kw.setdefault("timeout", HANG_GUARD_S)  # a hostile answer must end the request by itself
            client = HttpClient(kw.pop("url", None) or server.url, transport=KIND, **kw)
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
        assert b"Accept-Encoding: identity\r\n" in head  # bodies as sent, never to be inflated

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
        writer.close()
        await writer.wait_closed()  # the FIN is sent before the next request is
        closed.set()
        return False  # the server closes the idle connection (a keep-alive timeout)

    async def body(server: Scripted, client: HttpClient) -> None:
        assert await client.post_json("/generate", {}) == {}
        await closed.wait()
        assert await client.post_json("/generate", {}) == {}
        assert server.connections == 2 and client.connections_opened == 2

    _run([answer_then_close, _ok(b"{}")], body)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SPDY/3 200 OK\r\n\r\n{}", "illegal status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "illegal status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "illegal header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "conflicting Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "illegal chunk header"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (200 << 10) + b"\r\n\r\n", "Receive buffer too long"),
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
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", "received 2 bytes, expected 10"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc", "incomplete chunked read"),
        (b"HTTP/1.1 200 OK\r\nContent-", "without sending a response"),
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
                client = HttpClient(url, api_key=key, transport=KIND)
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
        for _ in range(200):  # every other call gets as far as it can: a free slot would connect
            await asyncio.sleep(0)
        assert len(started) == 2 and server.connections == 2  # the other three wait for a slot
        release.set()
        assert await asyncio.gather(*calls) == [{}] * 5
        assert server.connections == 2

    _run([slow] * 5, body, max_connections=2)


def test_a_request_ended_by_its_deadline_or_cancelled_frees_its_connection() -> None:
    """One connection allowed: a request whose answer never comes ends by the deadline, another
    is cancelled by its caller while waiting; each gives its slot back (its connection, its
    exchange unfinished, is closed), so the next request gets a new connection and its answer."""
    hang = asyncio.Event()  # never set: these answers never come
    arrived: list[int] = []

    async def never(head: bytes, writer: asyncio.StreamWriter) -> bool:
        arrived.append(1)
        await hang.wait()
        return False

    async def body(server: Scripted, client: HttpClient) -> None:
        with pytest.raises(InferenceError) as info:
            await client.post_json("/generate", {})
        assert info.value.kind == "timeout"
        assert await client.post_json("/generate", {}) == {"n": 1}
        waiting = asyncio.ensure_future(client.post_json("/generate", {}))
        while len(arrived) < 2:
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await client.post_json("/generate", {}) == {"n": 3}
        assert [c for c, _ in server.requests] == [1, 2, 2, 3]  # nothing sent on a closed one
        assert server.connections == client.connections_opened == 3

    _run([never, _later_ok(1), never, _later_ok(3)], body, max_connections=1, timeout=2.0)


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

    def pool(url: str) -> str:  # the transport, and httpx's pool class under it (by name)
        transport = transport_for(url, max_connections=4)
        return type(getattr(transport, "_pool", transport)).__name__

    assert pool("http://10.0.0.1:30000") == "OriginPool"
    assert pool("https://10.0.0.1:30000") == "OriginPool"
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    assert pool("http://10.0.0.1:30000") == "AsyncHTTPProxy"
    assert pool("https://10.0.0.1:30000") == "OriginPool"  # https_proxy is not set
    monkeypatch.setenv("no_proxy", "10.0.0.1")
    assert pool("http://10.0.0.1:30000") == "OriginPool"
    assert type(transport_for("http://10.0.0.1:1", max_connections=1, kind="httpx")._pool).__name__ == (
        "AsyncConnectionPool"
    )
    with pytest.raises(ValueError, match="one of auto"):
        transport_for("http://10.0.0.1:1", max_connections=1, kind="h2")


def test_a_refused_connection_is_a_connect_failure() -> None:
    async def main() -> None:
        async with Scripted([]) as server:
            url = server.url
        client = HttpClient(url, transport=KIND)  # the server is gone: nothing listens there now
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


def test_the_tls_context_is_made_once_per_ca_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every scoring run makes a transport; the verifying context (the CA bundle loaded) is
    made once per process and CA setting, and again when the environment's CA changes."""
    from hcapo_store.scoring.backends import http

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    default = http._tls_context(*http._ca_setting())
    assert http._tls_context(*http._ca_setting()) is default
    transport_for("http://127.0.0.1:1", max_connections=1)
    assert http._tls_context(*http._ca_setting()) is default
    cert, _key = _self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    named = http._tls_context(*http._ca_setting())
    assert named is not default and http._tls_context(*http._ca_setting()) is named
    stat = cert.stat()
    os.utime(cert, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the file replaced
    assert http._tls_context(*http._ca_setting()) is not named


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
        client = HttpClient(scripted.url.replace("http://", "https://"), transport=KIND)
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


# --------------------------------------------------------------------------- hostile answers


def _later_ok(n: int) -> bytes:
    return _ok(b'{"n": %d}' % n)


@pytest.mark.parametrize("when", ["with-the-answer", "after-the-answer"])
def test_stray_bytes_after_an_answer_drop_the_connection(when: str) -> None:
    """Bytes past the end of an answer belong to no request: the answer is kept, its
    connection is dropped, and every later request gets its own answer on a new one. Sent
    with the answer, they are in h11's buffer, not on the socket httpcore checks before reuse:
    the client closes that connection itself (else the next request failed on them)."""
    read = asyncio.Event()
    sent = asyncio.Event()

    async def stray(head: bytes, writer: asyncio.StreamWriter) -> bool:
        if when == "with-the-answer":
            writer.write(_ok(b'{"n": 0}') + b"garbage!")
        else:
            writer.write(_ok(b'{"n": 0}'))
            await writer.drain()
            await read.wait()  # the client has the whole answer; then the stray bytes come
            writer.write(b"garbage!")
        await writer.drain()
        sent.set()
        return True

    async def body(server: Scripted, client: HttpClient) -> None:
        assert await client.post_json("/generate", {}) == {"n": 0}
        read.set()
        await sent.wait()
        answers = [await client.post_json("/generate", {}) for _ in range(3)]  # none fails
        assert answers == [{"n": 1}, {"n": 2}, {"n": 3}]
        assert [c for c, _ in server.requests] == [1, 2, 2, 2]  # nothing more sent on the first
        assert client.connections_opened == 2

    _run([stray, *[_later_ok(n) for n in (1, 2, 3)]], body)


def test_a_request_waiting_for_the_stray_bytes_connection_gets_a_new_one() -> None:
    """One connection allowed: a second request waits for the first's. The pool hands it the
    connection as the first answer is closed, just before the client closes that connection
    for its stray bytes; httpcore then finds it closed and opens another for it."""
    arrived = asyncio.Event()
    release = asyncio.Event()

    async def stray(head: bytes, writer: asyncio.StreamWriter) -> bool:
        arrived.set()
        await release.wait()
        writer.write(_ok(b'{"n": 0}') + b"garbage!")
        await writer.drain()
        return True

    async def body(server: Scripted, client: HttpClient) -> None:
        first = asyncio.ensure_future(client.post_json("/generate", {}))
        await arrived.wait()
        second = asyncio.ensure_future(client.post_json("/generate", {}))
        for _ in range(200):  # the second gets as far as it can: queued for the one connection
            await asyncio.sleep(0)
        release.set()
        assert await asyncio.gather(first, second) == [{"n": 0}, {"n": 1}]
        assert [c for c, _ in server.requests] == [1, 2]

    _run([stray, _later_ok(1)], body, max_connections=1)


def test_bare_lf_line_ends_are_read_at_once() -> None:
    """RFC 9112 §2.2 lets a recipient take a bare LF as a line end; h11 does, so such an
    answer is read at once (wire.py waited for a CRLF until the request timeout)."""
    bare = b'HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: 8\n\n{"n": 0}'

    async def body(server: Scripted, client: HttpClient) -> None:
        assert await client.post_json("/generate", {}) == {"n": 0}
        assert await client.post_json("/generate", {}) == {"n": 1}
        assert server.connections == 1

    _run([bare, _later_ok(1)], body)


def _endless_trailers(head: bytes, writer: asyncio.StreamWriter) -> Awaitable[bool]:
    async def write() -> bool:
        writer.write(b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n{"n": 0}\r\n0\r\n')
        for k in range(1_000_000):  # bounded: ~20 MB of trailer lines, unless the client leaves
            writer.write(b"X-Trailer-%d: more\r\n" % k)
            await writer.drain()
        return False

    return write()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n{"n": 0}', "Only Transfer-Encoding: chunked"),
        (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n{"n": 0}', "Only Transfer-Encoding: chunked"),
        (_endless_trailers, "Receive buffer too long"),
        (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n 8\r\n{"n": 0}\r\n0\r\n\r\n', "illegal chunk header"),
        (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x8\r\n{"n": 0}\r\n0\r\n\r\n', "illegal chunk header"),
        (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+8\r\n{"n": 0}\r\n0\r\n\r\n', "illegal chunk header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-0\r\n\r\n", "illegal chunk header"),
    ],
    ids=[
        "te-identity",
        "te-not-chunked-last",
        "endless-trailers",
        "chunk-space",
        "chunk-0x",
        "chunk-plus",
        "chunk-minus",
    ],
)
def test_framing_httpx_refuses_fails_the_request_at_once(answer: bytes | Answer, message: str) -> None:
    """Each is refused as it arrives (a connection failure the run records and retries), and
    the next request goes on a new connection and gets its answer."""

    async def body(server: Scripted, client: HttpClient) -> None:
        with pytest.raises(InferenceError) as info:
            await client.post_json("/generate", {})
        assert info.value.kind == "connect" and info.value.retryable and message in str(info.value)
        assert await client.post_json("/generate", {}) == {"n": 1}
        assert server.connections == 2

    _run([answer, _later_ok(1)], body)


@pytest.mark.parametrize(
    ("ids", "close"),
    [(10, True), (10, False), (2_000_000, True)],
    ids=["small-request", "small-request-kept-open", "large-request"],
)
def test_an_early_answer_is_taken_without_waiting(ids: int, close: bool) -> None:
    """A server that answers (413) before it has read the request's body, then closes or
    keeps the connection (reading nothing more): the answer is reported (or, when the unread
    body made the server's kernel reset the connection, a connection failure), never a
    request held until its deadline. (A server that keeps the connection, reads nothing and
    leaves a body larger than the sockets' buffers unsent is not read from: HTTP/1.1 clients,
    httpx's included, finish sending before they read; the write stall ends that request, see
    test_a_server_that_stops_reading_the_body_fails_the_write_not_the_deadline.)"""

    async def body(server: Scripted, client: HttpClient) -> None:
        with pytest.raises(InferenceError) as info:
            await client.post_json("/generate", {"input_ids": list(range(ids))})
        if ids == 10:
            assert info.value.kind == "http_413" and not info.value.retryable and "too large" in str(info.value)
        else:
            assert info.value.kind in ("http_413", "connect"), info.value
        assert not str(info.value).rstrip().endswith(":"), "a failure says what happened"

    async def main() -> None:
        async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")  # the head only: the body stays unread
            answer = b'{"error": {"message": "request too large"}}'
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: %d\r\n" % len(answer))
            writer.write(b"Connection: close\r\n\r\n" if close else b"\r\n")
            writer.write(answer)
            await writer.drain()
            if not close:
                await reader.read()  # until the client leaves
            writer.close()

        server = await asyncio.start_server(early, "127.0.0.1", 0)
        scripted = Scripted([])
        scripted.server = server
        client = HttpClient(scripted.url, timeout=HANG_GUARD_S, transport=KIND)
        try:
            await body(scripted, client)
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


def _gzip_bomb() -> bytes:
    """A few KB that inflate to 256 MB through two layers of gzip (the issue's 2.9 GB, smaller)."""
    return gzip.compress(gzip.compress(bytes(256 << 20), compresslevel=9), compresslevel=9)


def test_an_encoding_not_asked_for_is_refused_unread() -> None:
    bomb = _gzip_bomb()
    assert len(bomb) < 64 << 10
    answer = _ok(bomb, b"Content-Encoding: gzip, gzip")
    error = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb) + bomb
    )

    async def body(server: Scripted, client: HttpClient) -> None:
        with pytest.raises(InferenceError) as info:
            await client.post_json("/generate", {})
        assert info.value.kind == BAD_ENCODING and not info.value.retryable
        assert "Content-Encoding 'gzip, gzip' was not asked for" in str(info.value)
        with pytest.raises(InferenceError) as info:  # an error status keeps its kind; its body is not read
            await client.post_json("/generate", {})
        assert (
            info.value.kind == "http_503" and info.value.retryable and "(a body in gzip, not read)" in str(info.value)
        )
        assert await client.post_json("/generate", {}) == {"n": 1}
        assert all(b"Accept-Encoding: identity\r\n" in head for _, head in server.requests)

    _run([answer, error, _later_ok(1)], body)


# --------------------------------------------------------------------------- a server that stops reading


def _kernel_send_buffer_max() -> int:
    """The most a sending socket's kernel buffer grows to (Linux: tcp_wmem's max; on one
    host's loopback it starts near that): a body must be larger to stall a write at all."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return 16 << 20  # elsewhere: generous


async def _listen_small(rcvbuf: int) -> socket.socket:
    """A listening socket whose connections take at most ~``rcvbuf`` unread bytes."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # inherited by accepted sockets
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    return listener


def test_a_server_that_stops_reading_the_body_fails_the_write_not_the_deadline() -> None:
    """A server that accepts, never reads and never closes: once the body has filled the
    kernels' buffers the write makes no progress, and the request fails as a ``timeout``
    (retried) after ``write_stall``, not after the request's deadline (600 s here)."""
    payload = {"text": "x" * (_kernel_send_buffer_max() + (1 << 20))}

    async def main() -> None:
        listener = await _listen_small(4096)
        accepted: list[socket.socket] = []

        async def accept() -> None:
            conn, _ = await asyncio.get_running_loop().sock_accept(listener)
            accepted.append(conn)  # held open, never read

        server = asyncio.ensure_future(accept())
        client = HttpClient(
            f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=600.0, write_stall=0.5, transport=KIND
        )
        try:
            with pytest.raises(InferenceError) as info:
                await client.post_json("/generate", payload)
        finally:
            await client.close()
            server.cancel()  # done once it accepted; a client that never connected must not hang it
            await asyncio.gather(server, return_exceptions=True)
            for conn in accepted:
                conn.close()
            listener.close()
        assert info.value.kind == "timeout" and info.value.retryable
        assert "WriteTimeout: the server took no more of the request body for 0.5 s" in str(info.value)
        assert len(accepted) == 1

    asyncio.run(main())


def test_a_slow_body_that_progresses_is_not_a_stall() -> None:
    """The write bound is per piece (``WRITE_PIECE``), not for the whole body: a server that
    reads a piece, pauses, and reads on takes far longer than ``write_stall`` over the whole
    body, and the request is answered. The body goes with its Content-Length, not chunked."""
    # A piece may wait write_stall (6 s) before the test fails: a generous bound on a loaded machine,
    # while 72 pauses of 0.1 s make the whole write outlast it.
    pause, write_stall, rcvbuf = 0.1, 6.0, 256 << 10
    # what the kernels (Linux doubles SO_RCVBUF) and asyncio's buffer (64 KiB) can hold unread
    buffered = _kernel_send_buffer_max() + 2 * rcvbuf + 4 * WRITE_PIECE
    payload = {"text": "x" * (buffered + 72 * WRITE_PIECE)}  # the write lasts at least 72 pauses
    waits_in_write = 0  # pauses taken while the client cannot have finished writing

    async def main() -> dict[str, Any]:
        nonlocal waits_in_write
        listener = await _listen_small(rcvbuf)
        loop = asyncio.get_running_loop()

        async def serve() -> None:
            nonlocal waits_in_write
            conn, _ = await loop.sock_accept(listener)
            assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) <= 2 * rcvbuf
            data = b""
            while b"\r\n\r\n" not in data:
                data += await loop.sock_recv(conn, 4096)
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.lower().split(b"\r\n")
            assert not any(line.startswith(b"transfer-encoding") for line in lines)
            length = int(next(line for line in lines if line.startswith(b"content-length:")).split(b":")[1])
            while len(body) < length:
                target = min(length, len(body) + WRITE_PIECE)
                while len(body) < target:
                    more = await loop.sock_recv(conn, target - len(body))
                    if not more:  # the client gave up: its error is the test's failure
                        conn.close()
                        return
                    body += more
                if length - len(body) > buffered:  # the client is still writing: a slow reader
                    waits_in_write += 1
                    await asyncio.sleep(pause)
            answer = b'{"received": %d}' % len(body)
            await loop.sock_sendall(conn, _ok(answer))
            conn.close()

        server = asyncio.ensure_future(serve())
        client = HttpClient(
            f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=600.0, write_stall=write_stall, transport=KIND
        )
        try:
            answer = await client.post_json("/generate", payload)
        finally:
            await client.close()
            await server
            listener.close()
        return answer

    answer = asyncio.run(main())
    assert answer == {"received": len(orjson.dumps(payload))}
    assert waits_in_write * pause > write_stall  # the whole write outlasted the bound
