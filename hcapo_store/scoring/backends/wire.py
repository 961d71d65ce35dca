"""A lean HTTP/1.1 transport for httpx: keep-alive connections on asyncio streams.

Scoring sends one request per step (per group) of 20-30k ids. httpx's own transport
(httpcore over anyio) spent ~1.3 ms of CPU on each, more than everything else the client
does for a step (BENCHMARKS.md, bookkeeping); this one ~0.3 ms. It speaks what the scoring
client needs and nothing more: HTTP/1.1 over TCP or TLS, request bodies in memory, responses
framed by Content-Length, chunked, or by the server closing, connections kept alive and
reused. Failures are raised as httpx's exception types, so the caller classifies them as it
always has; a failed request is never sent again here (the scheduler records the attempt and
retries it). A proxy from the environment goes through httpx's transport (``transport_for``).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from collections.abc import AsyncIterator

import httpx

MAX_HEAD_BYTES = 64 << 10  # a response's status line and headers (and a chunk-size line)
READ_BYTES = 64 << 10  # a body is handed on in pieces of at most this many bytes
_NO_BODY_STATUS = frozenset((204, 304))

Origin = tuple[str, str, int]


def transport_for(url: str, *, max_connections: int, connect_timeout: float | None) -> httpx.AsyncBaseTransport:
    """The transport for requests to ``url``: ours, or httpx's when the environment names a
    proxy for it (``http_proxy`` / ``https_proxy`` / ``all_proxy``, minus ``no_proxy``), as
    httpx itself would use."""
    parsed = httpx.URL(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parsed.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(parsed.host):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        return httpx.AsyncHTTPTransport(proxy=proxy, limits=limits)
    return StreamTransport(max_connections=max_connections, connect_timeout=connect_timeout)


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        """Still open as far as we can tell: the server closes idle connections when it likes."""
        return not self.writer.is_closing() and not self.reader.at_eof() and self.reader.exception() is None

    def close(self) -> None:
        self.writer.close()


class StreamTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive connections per origin, at most ``max_connections`` requests at once
    (the rest wait). A ``trace`` request extension is told when a connection is opened, under
    httpcore's event name, so a caller can count connections on either transport."""

    def __init__(self, *, max_connections: int = 64, connect_timeout: float | None = 10.0) -> None:
        self._idle: dict[Origin, list[_Connection]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._connect_timeout = connect_timeout
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        head = _request_head(request)
        body = await request.aread()
        await self._slots.acquire()
        conn: _Connection | None = None
        try:
            conn = self._checkout(origin) or await self._connect(origin, request)
            status, headers, framing, keep_alive = await _send_and_read_head(conn, head, body, request.method)
        except BaseException:
            if conn is not None:
                conn.close()
            self._slots.release()
            raise
        stream = _Body(self, origin, conn, framing, keep_alive)
        return httpx.Response(status, headers=headers, stream=stream, request=request)

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _checkout(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    def _release(self, origin: Origin, conn: _Connection, reusable: bool) -> None:
        if reusable and not self._closed and conn.usable():
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()
        self._slots.release()

    async def _connect(self, origin: Origin, request: httpx.Request) -> _Connection:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()
            context = self._ssl
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    host, port, ssl=context, server_hostname=host if context else None, limit=MAX_HEAD_BYTES
                ),
                self._connect_timeout,
            )
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {self._connect_timeout:g} s") from exc
        except OSError as exc:  # ssl.SSLError too
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        trace = request.extensions.get("trace")
        if trace is not None:
            await trace("connection.connect_tcp.complete", {"return_value": None})
        return _Connection(reader, writer)


def _request_head(request: httpx.Request) -> bytes:
    # httpx.Request has already set Host and Content-Length.
    lines = [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += [name, b": ", value, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)


# How a response body ends: ("length", n), ("chunked", 0), ("close", 0) or ("none", 0).
Framing = tuple[str, int]


async def _send_and_read_head(
    conn: _Connection, head: bytes, body: bytes, method: str
) -> tuple[int, list[tuple[bytes, bytes]], Framing, bool]:
    """Send the request, read the response head: (status, headers, framing, keep-alive)."""
    try:
        conn.writer.write(head)
        if body:
            conn.writer.write(body)
        await conn.writer.drain()
    except (ConnectionError, OSError) as exc:
        raise httpx.WriteError(f"{type(exc).__name__}: {exc}") from exc
    while True:
        try:
            raw = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            where = "in the middle of the response head" if exc.partial else "without sending a response"
            raise httpx.RemoteProtocolError(f"server disconnected {where}") from exc
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError(f"response head longer than {MAX_HEAD_BYTES} bytes") from exc
        except (ConnectionError, OSError) as exc:
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from exc
        status, version, headers = _parse_head(raw)
        if not 100 <= status < 200:  # 1xx: an interim answer, the real one follows
            break
    return status, headers, _framing(status, headers, method), _keep_alive(version, headers)


def _parse_head(raw: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    lines = raw[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not (parts[1].isdigit() and len(parts[1]) == 3):
        raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"malformed response header line: {line[:80]!r}")
        headers.append((name, value.strip()))
    return int(parts[1]), parts[0], headers


def _values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for k, v in headers if k.lower() == name]


def _framing(status: int, headers: list[tuple[bytes, bytes]], method: str) -> Framing:
    if method == "HEAD" or status in _NO_BODY_STATUS:
        return ("none", 0)
    encodings = b",".join(_values(headers, b"transfer-encoding")).lower()
    if encodings:
        if encodings.split(b",")[-1].strip() != b"chunked":
            return ("close", 0)  # RFC 9112 6.3: not chunked last, read until the server closes
        return ("chunked", 0)
    lengths = {v.strip() for value in _values(headers, b"content-length") for v in value.split(b",")}
    if not lengths:
        return ("close", 0)
    if len(lengths) > 1 or not next(iter(lengths)).isdigit():
        raise httpx.RemoteProtocolError(f"bad Content-Length: {sorted(lengths)!r}")
    return ("length", int(next(iter(lengths))))


def _keep_alive(version: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    tokens = {t.strip().lower() for value in _values(headers, b"connection") for t in value.split(b",")}
    if version == b"HTTP/1.0":
        return b"keep-alive" in tokens
    return b"close" not in tokens


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; closing it hands the connection back (when the body
    was read to its end and the connection may be kept) or closes it."""

    def __init__(
        self, transport: StreamTransport, origin: Origin, conn: _Connection, framing: Framing, keep_alive: bool
    ) -> None:
        self._transport, self._origin, self._conn = transport, origin, conn
        self._framing, self._keep_alive = framing, keep_alive
        self._complete = framing[0] == "none"
        self._received = 0  # body bytes read (chunked: the chunks' data)
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        kind, length = self._framing
        try:
            if kind == "length":
                async for piece in self._exactly(length):
                    yield piece
            elif kind == "chunked":
                async for piece in self._chunked():
                    yield piece
            elif kind == "close":
                while piece := await self._conn.reader.read(READ_BYTES):
                    yield piece
                self._keep_alive = False
        except asyncio.IncompleteReadError as exc:
            of = f" of {length}" if kind == "length" else ""
            raise httpx.ReadError(
                f"server closed the connection in the middle of the response body "
                f"(after {self._received}{of} body bytes)"
            ) from exc
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError(f"chunk-size line longer than {MAX_HEAD_BYTES} bytes") from exc
        except (ConnectionError, OSError) as exc:
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from exc
        self._complete = True

    async def _exactly(self, n: int) -> AsyncIterator[bytes]:
        """The next ``n`` body bytes as they arrive; IncompleteReadError if the server closes first."""
        left = n
        while left:
            piece = await self._conn.reader.read(min(left, READ_BYTES))
            if not piece:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(piece)
            self._received += len(piece)
            yield piece

    async def _chunked(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                size = -1
            if size < 0:
                raise httpx.RemoteProtocolError(f"bad chunk-size line: {line[:80]!r}")
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailer fields: not used
                return
            async for piece in self._exactly(size):
                yield piece
            if await reader.readexactly(2) != b"\r\n":
                raise httpx.RemoteProtocolError("chunk not followed by CRLF")

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._transport._release(self._origin, self._conn, self._complete and self._keep_alive)
