"""Several servers of one model without a router: each episode on one server, moved when it dies.

``score --server A --server B ...``: every request carries its episode's routing key
(``scheduler.routing_key``); the server for a key is chosen by rendezvous hashing
(highest random weight) of the key and the server URLs, so an episode's requests all reach
the server whose prefix cache holds its conversation, episodes spread evenly, and when a
server leaves only its own episodes move (to the server that comes next for each of them).

A server that fails a request at the transport level (no HTTP answer) and then does not
answer a probe is taken out for the rest of the run and the request goes to the next server
for its key at once; the scheduler sees no failure. When every server is out, the last
transport error reaches the scheduler, which pauses or stops as for one dead server.

The servers must serve the same model the same way: they are read at start and refused when
their identity (model, weight version) or their input limits differ, naming both. Each
server's own checks (model identity per connection, ids echo, response size) stay its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from hcapo_store.errors import InferenceError, ScoringError
from hcapo_store.rendering.requests import GroupPrompt, StepPrompt
from hcapo_store.scoring.backends.base import Backend, BackendScore

log = logging.getLogger(__name__)
T = TypeVar("T")
TRANSPORT = ("connect", "timeout")  # no HTTP answer: maybe a dead server


def rendezvous_order(key: str, names: Sequence[str]) -> list[int]:
    """Indices of ``names`` from the most to the least preferred server for ``key``."""
    weights = [hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest() for name in names]
    return sorted(range(len(names)), key=lambda i: weights[i], reverse=True)


class MultiServerBackend:
    """One backend over several servers of the same model (see the module docstring)."""

    def __init__(self, backends: Sequence[Backend], names: Sequence[str]) -> None:
        if len(backends) < 2 or len(backends) != len(names):
            raise ValueError("MultiServerBackend needs two or more backends, one name each")
        if len(set(names)) != len(names):
            raise ScoringError(f"--server given twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
        self.backends = list(backends)
        self.names = list(names)  # for messages (credentials masked) and for hashing
        self.kind = backends[0].kind
        self.down: set[int] = set()
        self._probe_lock: asyncio.Lock | None = None

    # -- start: every server answers, and serves the same

    async def start(self) -> None:
        self._probe_lock = asyncio.Lock()
        results = await asyncio.gather(*(b.start() for b in self.backends), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                if (
                    isinstance(result, InferenceError)
                    and result.kind in TRANSPORT
                    and len(self.down) + 1 < len(self.backends)
                ):
                    log.warning("server %s does not answer (%s): scoring goes on without it", self.names[i], result)
                    self.down.add(i)
                    continue
                raise result
        self._check_same()

    def _check_same(self) -> None:
        live = self._live()
        first = live[0]
        for i in live[1:]:
            for what, read in (("model", _identity), ("weight version", _weight_version), ("input limit", _limit)):
                a, b = read(self.backends[first]), read(self.backends[i])
                if a != b:
                    raise ScoringError(
                        f"the servers do not serve the same: {self.names[first]} has {what} {a!r}, "
                        f"{self.names[i]} has {b!r}; give --server only for servers of one model"
                    )

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.backends), return_exceptions=True)

    def _live(self) -> list[int]:
        return [i for i in range(len(self.backends)) if i not in self.down]

    # -- facts: the live servers agree on them

    def identity(self) -> dict[str, Any]:
        return self.backends[self._live()[0]].identity()

    def context_length(self) -> int | None:
        return self.backends[self._live()[0]].context_length()

    def weight_version(self) -> str | None:
        return _weight_version(self.backends[self._live()[0]])

    def tokenizer_path(self) -> str | None:
        read = getattr(self.backends[self._live()[0]], "tokenizer_path", None)
        return read() if callable(read) else None

    async def server_tokens(self, text: str) -> tuple[list[int], bool] | None:
        read = getattr(self.backends[self._live()[0]], "server_tokens", None)
        return await read(text) if read is not None else None

    async def check_token_id(self, token_id: int) -> str | None:
        check = getattr(self.backends[self._live()[0]], "check_token_id", None)
        return await check(token_id) if check is not None else None

    async def ping(self) -> bool:
        """Does any server still answer?"""
        for i in self._live():
            ping = getattr(self.backends[i], "ping", None)
            if ping is None or await ping():
                return True
        return False

    # -- scoring: the key's server, then the next when one dies

    async def score(self, prompt: StepPrompt) -> BackendScore:
        return await self._route(prompt.routing_key, lambda b: b.score(prompt))

    async def score_group(self, group: GroupPrompt) -> list[BackendScore]:
        return await self._route(group.members[-1].routing_key, lambda b: b.score_group(group))

    async def _route(self, key: str | None, call: Callable[[Backend], Awaitable[T]]) -> T:
        while True:
            live = [i for i in rendezvous_order(key or "", self.names) if i not in self.down]
            if not live:
                raise InferenceError("connect", "every server of --server is down", retryable=True)
            i = live[0]
            try:
                return await call(self.backends[i])
            except InferenceError as exc:
                if exc.kind not in TRANSPORT or len(live) == 1 or not await self._gone(i):
                    raise
                log.warning(
                    "server %s stopped answering (%s): its episodes move to the other %d server(s)",
                    self.names[i],
                    exc,
                    len(live) - 1,
                )

    async def _gone(self, i: int) -> bool:
        """After a transport failure on server ``i``: take it out when a probe gets no answer."""
        assert self._probe_lock is not None
        async with self._probe_lock:
            if i in self.down:
                return True
            ping = getattr(self.backends[i], "ping", None)
            if ping is not None and await ping():
                return False
            self.down.add(i)
            return True


def _identity(backend: Backend) -> Any:
    return backend.identity()


def _weight_version(backend: Backend) -> str | None:
    read = getattr(backend, "weight_version", None)
    return read() if callable(read) else None


def _limit(backend: Backend) -> int | None:
    return backend.context_length()
