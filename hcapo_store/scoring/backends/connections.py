"""One server's HTTP/1.1 connections, kept for reuse: the scoring client's transport.

Why not httpx's own pool: it serves any origin, HTTP/2 and proxies, and hands waiting requests
their connections in order, and every request paid for that: each idle connection's socket
checked for readability, anyio's cancel scopes around every read and write. On a per-step
``follow`` batch (792 requests of ~88 KB of ids) that was ~28 % of the follow process's GIL time
(BENCHMARKS.md, nineteenth session). Here a request takes one idle connection (the most recently
used), checks only that one, and gives it back when its answer is closed. HTTP/1.1 itself stays
httpcore's and h11's (``httpcore.AsyncHTTP11Connection``, httpcore's public API): nothing here
parses a byte of HTTP.

Plain TCP goes through the event loop's own socket calls (:class:`SocketBackend`, Python >= 3.11
for ``asyncio.timeout``); TLS, and Python 3.10, through httpcore's anyio streams. A proxy from the
environment keeps httpx's own transport (``http.transport_for``). httpcore's errors leave as
httpx's, as from httpx's transport, so the client classifies one set of exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpcore
import httpx

# As httpx.Limits' default: a connection idle longer than this is closed, not reused (servers
# close idle keep-alive connections on timers of their own).
KEEPALIVE_EXPIRY_S = 5.0
SOCKETS = sys.version_info >= (3, 11)  # SocketBackend's timeouts are asyncio.timeout

if sys.version_info >= (3, 11):
    _deadline = asyncio.timeout
else:  # pragma: no cover - SocketBackend is not chosen before 3.11 (SOCKETS)

    def _deadline(delay: float | None) -> Any:
        raise RuntimeError("SocketBackend needs Python >= 3.11 (asyncio.timeout)")


# httpcore's exceptions and httpx's for them (the table httpx's transport applies)
_AS_HTTPX: dict[type[Exception], type[httpx.HTTPError]] = {
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
}


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    """httpcore's exception raised as httpx's most specific one for it."""
    try:
        yield
    except Exception as exc:
        for kind in type(exc).__mro__:
            mapped = _AS_HTTPX.get(kind)
            if mapped is not None:
                raise mapped(str(exc)) from exc
        raise


def _readable(sock: socket.socket) -> bool:
    """Has ``sock`` something to read, or been closed (poll: no FD_SETSIZE limit)?"""
    if sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class SocketStream(httpcore.AsyncNetworkStream):
    """A connected non-blocking TCP socket, read and written through the event loop's socket calls."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock, self._loop = sock, loop

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            async with _deadline(timeout):
                return await self._loop.sock_recv(self._sock, max_bytes)
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise httpcore.ReadTimeout(f"no data for {timeout:g} s") from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            async with _deadline(timeout):
                await self._loop.sock_sendall(self._sock, buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(f"the peer took no data for {timeout:g} s") from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc) or type(exc).__name__) from exc

    async def aclose(self) -> None:
        self._sock.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # httpcore: an idle connection whose socket is readable was closed
            return _readable(self._sock)
        if info == "socket":
            return self._sock
        if info in ("client_addr", "server_addr"):
            with contextlib.suppress(OSError):
                return self._sock.getsockname() if info == "client_addr" else self._sock.getpeername()
        return None


class SocketBackend(httpcore.AsyncNetworkBackend):
    """Plain TCP connections as :class:`SocketStream` (each address ``getaddrinfo`` gives, in order)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        error: OSError | None = None
        try:
            async with _deadline(timeout):
                for family, kind, proto, _name, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                    sock = socket.socket(family, kind, proto)
                    try:
                        sock.setblocking(False)
                        if family in (socket.AF_INET, socket.AF_INET6):
                            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as anyio does
                        for option in socket_options or ():
                            sock.setsockopt(*option)
                        if local_address is not None:
                            sock.bind((local_address, 0))
                        await loop.sock_connect(sock, address)
                    except OSError as exc:  # this address refused: the next one
                        sock.close()
                        error = exc
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    return SocketStream(sock, loop)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"no connection to {host}:{port} within {timeout:g} s") from exc
        except OSError as exc:  # the name did not resolve
            raise httpcore.ConnectError(str(exc)) from exc
        raise httpcore.ConnectError(str(error) if error else f"{host}:{port}: no address to connect to")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def stray_bytes(connection: Any) -> bool:
    """Do bytes past the end of the last answer wait in the connection's h11 parser? Bytes
    that came in the same packet as the answer are off the socket, so the readability check
    cannot see them, and h11 would read them as the next answer's first line. Any of httpcore's
    HTTP/1.1 connections: this pool's, or httpx's transport's (``http._with_stray_bytes``).
    (httpcore has no public handle on the parser: tests/test_wire.py fails if this stops finding it.)"""
    parser = getattr(connection, "_h11_state", None)
    return parser is not None and bool(parser.trailing_data[0])


class _Answer(httpx.AsyncByteStream):
    """An answer's body; closing it gives its connection back to the pool (or closes it)."""

    def __init__(self, pool: OriginPool, connection: httpcore.AsyncHTTP11Connection, stream: Any) -> None:
        self._pool, self._connection, self._stream = pool, connection, stream
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with _as_httpx():
                await self._stream.aclose()  # h11 ends the exchange: idle again, or closed
        finally:
            await self._pool._returned(self._connection)


class OriginPool(httpx.AsyncBaseTransport):
    """Up to ``max_connections`` HTTP/1.1 connections to the one origin of ``url``; a request
    beyond them waits for one to be given back."""

    def __init__(
        self,
        url: str,
        *,
        max_connections: int,
        ssl_context: ssl.SSLContext | None = None,
        network_backend: httpcore.AsyncNetworkBackend | None = None,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_S,
    ) -> None:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https"):
            raise ValueError(f"{url}: only http and https URLs have an origin pool")
        default_port = 443 if parsed.scheme == "https" else 80
        self._origin = httpcore.Origin(parsed.raw_scheme, parsed.raw_host, parsed.port or default_port)
        self._host = parsed.raw_host.decode("ascii")
        self._tls: ssl.SSLContext | None = None
        if parsed.scheme == "https":
            self._tls = ssl_context or httpx.create_ssl_context()
            self._tls.set_alpn_protocols(["http/1.1"])  # as httpcore sets it: no HTTP/2 here
        if network_backend is None:
            network_backend = SocketBackend() if SOCKETS and self._tls is None else httpcore.AnyIOBackend()
        self._backend = network_backend
        self._keepalive = keepalive_expiry
        self._idle: list[httpcore.AsyncHTTP11Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if (url.raw_scheme, url.raw_host, url.port or self._origin.port) != (
            self._origin.scheme,
            self._origin.host,
            self._origin.port,
        ):
            raise ValueError(f"{url}: not this pool's origin ({self._origin})")
        await self._slots.acquire()
        connection = None
        try:
            connection = await self._connection(request)
            core = httpcore.Request(
                method=request.method,
                url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
                headers=request.headers.raw,
                content=request.stream,
                extensions=request.extensions,
            )
            with _as_httpx():
                response = await connection.handle_async_request(core)
        except BaseException:
            self._slots.release()
            if connection is not None:  # h11 closed it already unless it failed before sending
                await connection.aclose()
            raise
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Answer(self, connection, response.stream),
            extensions=response.extensions,
        )

    async def _connection(self, request: httpx.Request) -> httpcore.AsyncHTTP11Connection:
        """An idle connection still open, else a new one."""
        while self._idle:
            connection = self._idle.pop()
            if not connection.has_expired():
                return connection
            await connection.aclose()
        timeout = request.extensions.get("timeout", {}).get("connect")
        with _as_httpx():
            stream = await self._backend.connect_tcp(self._host, self._origin.port, timeout=timeout)
            if self._tls is not None:
                try:
                    server_name = request.extensions.get("sni_hostname") or self._host
                    stream = await stream.start_tls(self._tls, server_hostname=server_name, timeout=timeout)
                except BaseException:
                    await stream.aclose()
                    raise
        trace = request.extensions.get("trace")
        if trace is not None:  # the event httpcore's own connections report
            await trace("connection.connect_tcp.complete", {"return_value": stream})
        return httpcore.AsyncHTTP11Connection(self._origin, stream, keepalive_expiry=self._keepalive)

    async def _returned(self, connection: httpcore.AsyncHTTP11Connection) -> None:
        """An answer was closed: its connection is idle again (kept) or not (closed)."""
        keep = not self._closed and connection.is_idle() and not stray_bytes(connection)
        if keep:
            self._idle.append(connection)
        self._slots.release()
        if not keep:
            await connection.aclose()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.aclose()
