"""The HTTP side of every server backend: requests, timeouts, and error classification.

Backends build payloads and parse responses; this module sends them through a transport
(``connections.OriginPool`` over httpcore's HTTP/1.1 connections, or httpx's own through a
proxy: httpcore and h11 parse HTTP/1.1, security-boundary work a well-kept library does, so
none of it is written here) and turns transport failures and HTTP statuses into
``InferenceError`` with a ``retryable`` flag (docs/SCORING.md: retry connect errors,
timeouts, 408/429/5xx and "queue full"; fail fast on other 4xx). The retry loop itself lives
in the scheduler, which records every failed attempt.

A score must come from the model the scorer was registered with. The client counts the
connections it opens; a response that arrived after a new connection was opened (the
server may have been restarted with another model behind the same URL) is accepted only
once the served model has been read again and found unchanged (``verify_model``).

A server is not trusted to behave: a timeout per read would let one byte a second keep a
request alive for ever; each request therefore runs under one overall deadline (the
request timeout), and its body is read raw, in chunks, and given up beyond what the request
can need (``response_cap``), so a runaway body cannot exhaust memory. Every request asks
for ``Accept-Encoding: identity`` and a body in any other Content-Encoding is refused
unread: a few KB of nested gzip would otherwise inflate to gigabytes before any cap.

A server that stops taking a request's body (it neither reads it nor closes) is not waited
for until the deadline: the body goes to the transport in ``WRITE_PIECE`` pieces, each under
httpx's write timeout (``write_stall``), so a write that makes no progress for that long fails
(a ``timeout``, retried) while a slow one that progresses does not. The kernels' socket
buffers take a body without the server reading it: only a body larger than they are can
stall; a smaller one waits for the answer, under the deadline, like a slow answer.

Bytes past the end of a complete answer belong to no request: the answer is kept, and a
connection that carried them is closed instead of going back to the pool (h11 would read
them as the start of the next answer and fail that request).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import ssl
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import httpcore
import httpx
import numpy as np
import orjson  # 3-4x faster than json on the large id lists and logprob arrays

from hcapo_store.errors import InferenceError
from hcapo_store.masking import mask_credentials, mask_url, register_secret, register_url_secrets, split_query_token
from hcapo_store.rendering.requests import GroupPrompt, PackedIds
from hcapo_store.scoring.backends import connections
from hcapo_store.scoring.backends.base import BackendScore, split_score

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
MODEL_CHANGED = "model_changed"  # InferenceError kind: the server now serves another model
DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
# A live server takes the next piece of a request body at once, as it accepts a connection:
# the same 10 s as the connect timeout (scoring.job), not --request-timeout, which also
# covers the server's compute. 64 KiB a piece: a write that moves 6 KB/s never stalls.
WRITE_STALL_S = 10.0
WRITE_PIECE = 64 << 10
TOO_LARGE = "too_large"  # InferenceError kind: a body beyond what the request can need
# A response to a scoring request carries a few dozen bytes per prompt token (SGLang: a
# [logprob, id, text] triple; vLLM: a dict per position); the request itself carries a
# few bytes per token, so this many response bytes per request byte is generous.
RESPONSE_BYTES_PER_REQUEST_BYTE = 256
RESPONSE_SLACK_BYTES = 1 << 20
GET_CAP_BYTES = 16 << 20  # model_info, server_info, /v1/models: small documents
ERROR_BODY_BYTES = 4096  # of a non-200 answer, what an error message may quote
BAD_ENCODING = "bad_encoding"  # InferenceError kind: a Content-Encoding the client did not ask for
_JSON = {"Content-Type": "application/json"}
# a request's PackedIds go out as the numpy view of their buffer: the same JSON text, no int objects
_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
T = TypeVar("T")
_IDENTITY = {"Accept-Encoding": "identity"}  # bodies as sent: nothing to inflate past a cap


def wire_ids(ids: Sequence[int]) -> list[int] | np.ndarray:
    """A request's ids for a JSON body: PackedIds as a view of their buffer (orjson writes the
    same text as for the list, tests/test_packed_ids.py), anything else as a list."""
    if isinstance(ids, PackedIds):
        return np.frombuffer(ids.as_array, dtype=np.int32)
    return list(ids)


async def _within(deadline: float | None, work: Coroutine[Any, Any, T]) -> T:
    """``work`` under one overall deadline (``asyncio.TimeoutError`` past it). Python >= 3.11:
    in this task (``asyncio.timeout``); before: ``wait_for``, which runs it in a task of its own."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(deadline):
            return await work
    return await asyncio.wait_for(work, deadline)


def response_cap(request_bytes: int) -> int:
    """The most bytes a response to a request of ``request_bytes`` may have."""
    return RESPONSE_SLACK_BYTES + RESPONSE_BYTES_PER_REQUEST_BYTE * request_bytes


def overall_deadline(timeout: httpx.Timeout | float) -> float | None:
    """Seconds one whole request may take: the read timeout (``--request-timeout``)."""
    if isinstance(timeout, httpx.Timeout):
        return timeout.read
    return float(timeout)


TRANSPORTS = ("auto", "sockets", "anyio", "httpx")  # transport_for's kinds; tests run each


def transport_for(url: str, *, max_connections: int, kind: str = "auto") -> httpx.AsyncBaseTransport:
    """The transport for requests to ``url``: the origin's own pool (``connections.OriginPool``;
    ``kind`` "sockets" or "anyio" names its network streams, "auto" picks), or httpx's transport
    (``kind`` "httpx", and always when the environment names a proxy for ``url``: ``http_proxy`` /
    ``https_proxy`` / ``all_proxy``, minus ``no_proxy``, as httpx's client reads them).
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` name the CA either way."""
    if kind not in TRANSPORTS or (kind == "sockets" and not connections.SOCKETS):
        raise ValueError(f"transport {kind!r}: one of {', '.join(TRANSPORTS)} (sockets: Python >= 3.11)")
    parsed = httpx.URL(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parsed.scheme) or proxies.get("all")
    if proxy and urllib.request.proxy_bypass(parsed.host):
        proxy = None
    tls = _tls_context(*_ca_setting())
    if kind == "httpx" or proxy or parsed.scheme not in ("http", "https"):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        return httpx.AsyncHTTPTransport(limits=limits, proxy=proxy or None, verify=tls)
    backend = {"sockets": connections.SocketBackend, "anyio": httpcore.AnyIOBackend}.get(kind)
    return connections.OriginPool(
        url, max_connections=max_connections, ssl_context=tls, network_backend=None if backend is None else backend()
    )


def _ca_setting() -> tuple[str | None, str | None, int | None]:
    """The CA the environment names (as httpx reads it) and when that file or folder changed."""
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        where = os.environ.get(name)
        if where:
            try:
                return name, where, os.stat(where).st_mtime_ns
            except OSError:  # httpx's own error follows when the context is made
                return name, where, None
    return None, None, None


@functools.lru_cache(maxsize=8)
def _tls_context(_name: str | None, _where: str | None, _changed: int | None) -> ssl.SSLContext:
    """httpx's verifying context (certifi's bundle, or the environment's CA), made once per
    process and CA setting: loading the bundle cost ~20 ms per scoring run, a third of a
    one-new-episode follow cycle. A CA file replaced on disk makes a new one."""
    return httpx.create_ssl_context(verify=True, trust_env=True)


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


async def _pieces(content: bytes) -> AsyncIterator[bytes]:
    """A request body handed to the transport ``WRITE_PIECE`` bytes at a time."""
    for start in range(0, len(content), WRITE_PIECE):
        yield content[start : start + WRITE_PIECE]


def _with_stray_bytes(response: httpx.Response) -> Any | None:
    """Through httpx's transport (a proxy): the HTTP/1.1 connection of ``response``, read to its
    end, when bytes past that end wait in its h11 parser (``connections.stray_bytes``), else None
    (always None from ``connections.OriginPool``, which closes such a connection itself). (httpx
    has no public handle on the connection: tests/test_wire.py fails if this path stops finding it.)"""
    pooled = getattr(response.stream, "_httpcore_stream", None)  # httpx's wrapper -> the pool's stream
    connection = getattr(getattr(pooled, "_stream", None), "_connection", None)  # -> its HTTP/1.1 connection
    return connection if connection is not None and connections.stray_bytes(connection) else None


class HttpClient:
    """One pooled async client per server, with an API key sent as a Bearer token."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        max_connections: int = 64,
        write_stall: float | None = WRITE_STALL_S,
        transport: str = "auto",
    ) -> None:
        """``timeout``: its read timeout is the whole request's deadline (``--request-timeout``);
        ``write_stall``: the seconds a request body may make no progress (at most the deadline;
        None: the deadline alone bounds it), in place of ``timeout``'s write timeout; ``transport``:
        ``transport_for``'s kind."""
        register_url_secrets(base_url)
        register_secret(api_key)
        base_url, query_token = split_query_token(base_url)
        api_key = api_key or query_token  # ?api_key=... goes in the header, not in every path
        self.base_url = base_url.rstrip("/")  # may carry user:password (sent as basic auth)
        self.deadline = overall_deadline(timeout)
        self.display_url = mask_url(self.base_url)  # what messages show
        self.connections_opened = 0  # counted by the trace hook; see HttpBackend.verify_model
        self.verified_connections = 0  # connections opened when the served model was last read
        url = httpx.URL(self.base_url)
        self._headers = {**_IDENTITY, "Authorization": f"Bearer {api_key}"} if api_key else dict(_IDENTITY)
        if url.username or url.password:  # as httpx's client does: the URL's credentials win
            token = base64.b64encode(f"{url.username}:{url.password}".encode()).decode("ascii")
            self._headers["Authorization"] = f"Basic {token}"
        self._root = str(url.copy_with(username=None, password=None))
        self._urls: dict[str, httpx.URL] = {}
        if not isinstance(timeout, httpx.Timeout):
            timeout = httpx.Timeout(timeout)
        limits = timeout.as_dict()
        if write_stall is not None:
            limits["write"] = write_stall if self.deadline is None else min(write_stall, self.deadline)
        self.write_stall = limits["write"]
        self._extensions = {"timeout": limits, "trace": self._trace}
        # Requests go straight to a transport: httpx's client layer (URL merging, cookies,
        # auth and redirect hooks) cost 0.5 ms per request and none of it is used here.
        self._transport = transport_for(self._root, max_connections=max_connections, kind=transport)

    async def close(self) -> None:
        await self._transport.aclose()

    async def get_json(self, path: str) -> Any:
        return await self._request("GET", path, None)

    async def post_json(
        self,
        path: str,
        payload: Any,
        headers: dict[str, str] | None = None,
        *,
        decode: Callable[[bytes], Any] = orjson.loads,
    ) -> Any:
        """POST ``payload`` as JSON; the answer decoded by ``decode`` (JSON by default)."""
        return await self._request("POST", path, payload, headers, decode)

    async def _trace(self, name: str, info: dict[str, Any]) -> None:
        if name.endswith((".connect_tcp.complete", ".connect_unix_socket.complete")):
            self.connections_opened += 1

    async def _request(
        self,
        method: str,
        path: str,
        payload: Any,
        extra: dict[str, str] | None = None,
        decode: Callable[[bytes], Any] = orjson.loads,
    ) -> Any:
        where = f"{method} {self.display_url}{path}"
        try:
            status, headers, body = await _within(self.deadline, self._exchange(method, path, payload, extra))
        except asyncio.TimeoutError as exc:  # the overall deadline, not httpx's per-read timeout
            raise InferenceError(
                "timeout", f"{where}: no complete answer within {self.deadline:g} s", retryable=True
            ) from exc
        except httpx.WriteTimeout as exc:  # a body piece the server did not take: it stopped reading
            raise InferenceError(
                "timeout",
                f"{where}: WriteTimeout: the server took no more of the request body for {self.write_stall:g} s "
                "(it stopped reading)",
                retryable=True,
            ) from exc
        except httpx.TimeoutException as exc:
            raise InferenceError("timeout", f"{where}: {type(exc).__name__}", retryable=True) from exc
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            detail = str(exc) or "the server closed or reset the connection"  # httpcore's ReadError may say nothing
            raise InferenceError(
                "connect", mask_credentials(f"{where}: {type(exc).__name__}: {detail}"), retryable=True
            ) from exc
        except httpx.HTTPError as exc:
            raise InferenceError("http", mask_credentials(f"{where}: {exc}"), retryable=True) from exc
        if status != 200:
            text = mask_credentials(body[:300].decode("utf-8", "replace"))
            retryable = status in RETRYABLE_STATUS or "queue is full" in text.lower()
            raise InferenceError(
                f"http_{status}", f"{method} {path}: {text}", retryable=retryable, retry_after=_retry_after(headers)
            )
        try:
            return decode(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # orjson's error is a JSONDecodeError
            raise InferenceError(
                "bad_response",
                mask_credentials(f"{method} {path}: malformed JSON: {body[:200]!r}"),
                retryable=False,
            ) from exc

    async def _exchange(
        self, method: str, path: str, payload: Any, extra: dict[str, str] | None = None
    ) -> tuple[int, httpx.Headers, bytes]:
        """Send one request and read its body in chunks, up to what the request can need."""
        content = None if payload is None else orjson.dumps(payload, option=_DUMPS_OPTIONS)
        cap = GET_CAP_BYTES if content is None else response_cap(len(content))
        headers = self._headers if content is None else {**self._headers, **(extra or {}), **_JSON}
        body: bytes | AsyncIterator[bytes] | None = content
        if content is not None and len(content) > WRITE_PIECE:
            # In pieces, each under the write timeout: a stall fails, a slow write does not.
            # The declared length keeps httpx from sending it chunked.
            body = _pieces(content)
            headers = {**headers, "Content-Length": str(len(content))}
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self._root + path)
        request = httpx.Request(method, url, content=body, headers=headers, extensions=self._extensions)
        response = await self._transport.handle_async_request(request)
        stray = None
        try:
            if response.status_code != 200:
                cap = ERROR_BODY_BYTES  # only quoted in a message: the rest is not read
            encoding = response.headers.get("content-encoding", "").strip().lower()
            if encoding not in ("", "identity"):  # never inflated: refused unread
                if response.status_code != 200:
                    return response.status_code, response.headers, f"(a body in {encoding}, not read)".encode()
                raise InferenceError(
                    BAD_ENCODING,
                    mask_credentials(
                        f"{method} {self.display_url}{path}: response refused: Content-Encoding "
                        f"{encoding[:80]!r} was not asked for (the client asks for identity)"
                    ),
                    retryable=False,
                )
            declared = response.headers.get("content-length")
            if response.status_code == 200 and declared and declared.isdigit() and int(declared) > cap:
                raise self._too_large(method, path, cap, f"it declares {int(declared)} bytes")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_raw():  # as sent: no decoder ever runs
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    if response.status_code != 200:
                        break
                    raise self._too_large(method, path, cap, "its body ran past that")
            else:
                stray = _with_stray_bytes(response)
            return response.status_code, response.headers, b"".join(chunks)
        finally:
            await response.aclose()
            if stray is not None and not stray.is_closed():  # idle in the pool: closed before reuse
                await stray.aclose()

    def _too_large(self, method: str, path: str, cap: int, why: str) -> InferenceError:
        return InferenceError(
            TOO_LARGE,
            f"{method} {self.display_url}{path}: response refused: an answer to this request needs at most {cap} bytes, {why}",
            retryable=False,
        )


class HttpBackend:
    """What the server backends share: the server root URL, and one ``HttpClient`` per
    event loop (pooled connections belong to the loop that opened them), opened by
    ``start()`` and dropped by ``close()``."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        client: HttpClient | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.display_url = mask_url(self.url)  # for messages: credentials masked
        self.api_key = api_key
        self.client = client
        self.timeout = timeout  # for the clients start() creates; None: DEFAULT_TIMEOUT
        self.served: dict[str, Any] | None = None  # the served model's facts, fixed at the first start()
        self._verify_lock: asyncio.Lock | None = None

    def _open(self) -> HttpClient:
        if self.client is None:
            self.client = HttpClient(
                self.url, api_key=self.api_key, timeout=DEFAULT_TIMEOUT if self.timeout is None else self.timeout
            )
        return self.client

    def _started(self) -> HttpClient:
        """The client ``start()`` opened: scoring reuses it and never opens one itself."""
        if self.client is None:
            raise RuntimeError(f"{type(self).__name__}.score() before start()")
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        self._verify_lock = None  # belongs to the closing event loop

    async def ping(self) -> bool:
        """Does the server answer HTTP at all (any status)? False on connection failures and timeouts."""
        try:
            await self._open().get_json("/health")
        except InferenceError as exc:
            return exc.kind not in ("connect", "timeout")
        return True

    async def get_optional(self, path: str) -> Any | None:
        """GET an endpoint that older or other servers may lack: None on a 4xx."""
        try:
            return await self._open().get_json(path)
        except InferenceError as exc:
            if not exc.kind.startswith("http_4"):
                raise
            return None

    # -- the served model must not change under a scorer

    def served_facts(self) -> dict[str, Any]:
        """What identifies the served model (read by ``start()``); overridden per server."""
        return {}

    async def read_served_facts(self) -> dict[str, Any]:
        """Read the served model's facts from the server again; overridden per server."""
        return {}

    def remember_served(self) -> None:
        """Called at the end of ``start()``: the first start fixes the model, later ones must match."""
        facts = self.served_facts()
        if self.served is None:
            self.served = facts
        else:
            self._compare_served(facts, "on reconnect")
        if self.client is not None:
            self.client.verified_connections = self.client.connections_opened

    def _compare_served(self, facts: dict[str, Any], when: str) -> None:
        if self.served is not None and facts != self.served:
            changed = {
                k: (self.served.get(k), facts.get(k))
                for k in set(self.served) | set(facts)
                if self.served.get(k) != facts.get(k)
            }
            detail = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items()))
            raise InferenceError(
                MODEL_CHANGED,
                f"the server at {self.url} now serves another model ({when}: {detail}); nothing from it is stored",
                retryable=False,
            )

    async def verify_model(self) -> None:
        """After any new connection, read the served model again before a response is accepted."""
        client = self.client
        if client is None or client.connections_opened == client.verified_connections:
            return
        if self._verify_lock is None:
            self._verify_lock = asyncio.Lock()
        async with self._verify_lock:
            seen = client.connections_opened
            if seen == client.verified_connections:
                return
            self._compare_served(await self.read_served_facts(), "after a reconnect")
            client.verified_connections = seen

    async def _rejection(self, path: str, payload: dict[str, Any]) -> str | None:
        """None when the server accepts this request, else its 4xx reason (used to probe
        whether the model has a token id: servers report no vocabulary size)."""
        try:
            await self._open().post_json(path, payload)
        except InferenceError as exc:
            if exc.kind.startswith("http_4"):
                return str(exc)
            raise
        return None

    async def _tokenize(self, payload: dict[str, Any]) -> list[int] | None:
        """The ids of the server's own ``POST /tokenize`` (SGLang and vLLM alike), or None when
        it has none or cannot tokenize (a 4xx: an older server, or one without a tokenizer)."""
        try:
            body = await self._open().post_json("/tokenize", payload)
        except InferenceError as exc:
            if exc.kind.startswith("http_4"):
                return None
            raise
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise InferenceError(
                "bad_response", f"POST /tokenize: no list of token ids in {str(body)[:200]!r}", retryable=False
            )
        return tokens

    async def score_group(self, group: GroupPrompt) -> list[BackendScore]:
        """One request from the first member's first scored token to the end (SGLang:
        ``logprob_start_len`` one before it; vLLM returns every position anyway). Every
        position is verified as for one step, then each member keeps its own span."""
        return split_score(group, await self.score(group.as_prompt()))  # type: ignore[attr-defined]
