"""``follow`` between cycles: wait for a file-system event or the next look, and wait for a
scoring server that stopped answering."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hcapo_store.scoring.health import PROBE_SECONDS
from hcapo_store.scoring.job import run_sync

log = logging.getLogger(__name__)


def wait_for_server(backend: Any, seconds: float, stop: Any) -> bool:
    """Wait up to ``seconds`` for a server that stopped answering; True when it answered a
    probe before that. Online loops restart the server at every weight sync: a blind wait grown
    to a minute would leave the batch idle long after the server is back."""
    import time

    ping = getattr(backend, "ping", None)
    end = time.monotonic() + seconds
    while not stop.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return False
        if stop.wait(min(PROBE_SECONDS, left)):  # as often as a scoring run's retry asks
            return False
        if ping is not None and run_sync(lambda: _ping_once(backend)):
            return True
    return False


async def _ping_once(backend: Any) -> bool:
    try:
        return bool(await backend.ping())
    finally:
        await backend.close()  # the probe's own client; the next cycle starts the backend afresh


class ServerDown(Exception):
    """The scoring server stopped answering; ``follow`` waits and tries again. ``report``: the
    cycle's report so far (the batches it published before the server stopped)."""

    report: Any = None


class Waiter:
    """Between cycles: wake on a file-system event under the paths (watchfiles, in a thread
    started before the first scan, so no change falls between a scan and the watch) or after
    ``poll_seconds``, whichever comes first. ``poll_only`` (network file systems, where no
    event arrives) just waits; the scan finds the changes either way."""

    def __init__(
        self,
        paths: Sequence[Path],
        poll_seconds: float,
        stop: Any,
        poll_only: bool,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        import threading

        self.poll_seconds, self.stop = poll_seconds, stop
        self.changed = threading.Event()
        if poll_only:
            return
        try:
            import watchfiles
        except ImportError:  # the periodic scan alone still finds every change
            return
        ready = threading.Event()

        def run() -> None:
            try:
                for changes in watchfiles.watch(
                    *[str(p) for p in paths],
                    stop_event=stop,
                    rust_timeout=100,
                    yield_on_timeout=True,
                    debounce=50,
                    raise_interrupt=False,
                ):
                    ready.set()
                    if changes:
                        self.changed.set()
            except Exception as exc:  # the periodic look goes on finding every change: said, not fatal
                message = (
                    f"file-system events stopped ({type(exc).__name__}: {exc}); looking at the paths "
                    f"every {poll_seconds:g} s instead"
                )
                log.warning("follow: %s", message)
                if on_failure is not None:
                    on_failure(message)
            finally:
                ready.set()

        threading.Thread(target=run, name="hcapo-follow-watch", daemon=True).start()
        ready.wait(30)

    def wait(self) -> None:
        """Until a change, ``poll_seconds``, or the stop; the change flag is cleared before the
        next scan, so a change during that scan wakes the wait after it."""
        import time

        end = time.monotonic() + self.poll_seconds
        while not self.stop.is_set() and not self.changed.is_set():
            left = end - time.monotonic()
            if left <= 0:
                break
            self.changed.wait(min(left, 0.2))
        self.changed.clear()
