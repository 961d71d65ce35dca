"""Is the inference server there? Counting transport failures, the "server is down" verdict,
and the wait before a retry, which ends as soon as the server answers again.

A transport failure is a request with no HTTP answer at all (``connect``, ``timeout``).
After ``down_after`` of them in a row (across episodes), or before a step would fail for
good because of one, the server is probed; when the probe gets no answer either, the run
stops and the rest stays pending (not the steps' fault).

The wait before retrying a request that could not connect is not a blind sleep: online loops
restart the server at every weight sync, and an exponential backoff grown to 30 s while it
was away would keep the run idle that long after it is back. The server is probed every
``PROBE_SECONDS`` while waiting and the retry goes out as soon as it answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hcapo_store.errors import InferenceError

TRANSPORT_KINDS = frozenset({"connect", "timeout"})  # no HTTP answer at all
PROBE_SECONDS = 0.5  # how often a connect backoff asks the server whether it is back


class ServerHealth:
    """Transport failures in a row, the down verdict, and retry waits cut short by a probe."""

    def __init__(self, backend: Any, *, down_after: int, on_down: Callable[[], None]) -> None:
        # ping(): does the server answer HTTP at all? Backends without one (in-process) are never "down".
        self._ping: Callable[[], Awaitable[bool]] | None = getattr(backend, "ping", None)
        self.down_after = down_after
        self.on_down = on_down
        self.failures = 0  # consecutive transport failures, across episodes
        self.down: str | None = None  # why the run stopped: the server stopped answering
        self._verdict = asyncio.Lock()  # one probe for the verdict at a time
        self._probe: asyncio.Task[bool] | None = None  # one probe shared by every waiting retry

    def answered(self) -> None:
        """A request got an answer: the server is there."""
        self.failures = 0

    async def is_down(self, exc: InferenceError, final: bool) -> bool:
        """After a failed request: is the server gone? Probed (one probe at a time) after
        ``down_after`` transport failures in a row, or before a step would fail for good
        because of one. A down server calls ``on_down`` once."""
        if exc.kind not in TRANSPORT_KINDS:
            self.failures = 0  # the server answered
            return False
        self.failures += 1
        if self.down is not None:
            return True
        if not final and self.failures < self.down_after:
            return False
        if self._ping is None:
            return False
        async with self._verdict:
            if self.down is None and not await self._ping():
                self.down = (
                    f"the server stopped answering ({self.failures} transport failure(s) in a row, then a probe: {exc})"
                )
                self.on_down()
            else:
                self.failures = 0
        return self.down is not None

    async def wait_before_retry(self, delay: float, exc: InferenceError, stopping: Callable[[], bool]) -> None:
        """Wait ``delay`` seconds before retrying after ``exc``; after a connection failure
        the wait ends early, as soon as the server answers a probe (or the run is stopping)."""
        if exc.kind != "connect" or self._ping is None:
            await asyncio.sleep(delay)
            return
        end = time.monotonic() + delay
        while not stopping():
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(PROBE_SECONDS, left))
            if time.monotonic() < end and await self._shared_probe():
                return  # back: retry now instead of sleeping out the backoff

    async def _shared_probe(self) -> bool:
        """One ping in flight for all waiting retries (a dozen episodes backing off at once
        do not each knock on a restarting server)."""
        assert self._ping is not None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ping())
        return await asyncio.shield(self._probe)
