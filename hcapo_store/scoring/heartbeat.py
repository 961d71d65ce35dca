"""The lease heartbeat of a scoring run: renews this worker's leases every third of a lease.

A database error (another process holding SQLite's write lock past the busy timeout, a
PostgreSQL lock, a full disk) does not end it: the beat is retried with backoff, as claims
and writes are, sooner than the next regular beat, so that a lock held for a while does
not let the leases lapse and another worker score the same steps. It ends only when the
run cancels it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hcapo_store.errors import StoreError
from hcapo_store.scoring import work_queue
from hcapo_store.scoring.backoff import backoff_delay
from hcapo_store.storage.store import Store

RETRY_BASE = 0.5  # first retry after a failed beat; doubles up to a sixth of a lease
log = logging.getLogger(__name__)


async def keep_leases(store: Store, worker: str, lease_seconds: float, counts: Callable[[], tuple[int, int]]) -> None:
    """Beat until cancelled; ``counts()``: the run's (scored, failed) so far."""
    interval = max(lease_seconds / 3, 0.05)
    retry_cap = max(lease_seconds / 6, 0.05)
    failures = 0
    while True:
        await asyncio.sleep(backoff_delay(failures, base=RETRY_BASE, cap=retry_cap) if failures else interval)
        scored, failed = counts()
        try:
            await asyncio.to_thread(
                work_queue.heartbeat, store, worker, lease_seconds=lease_seconds, scored=scored, failed=failed
            )
        except StoreError as exc:
            failures += 1
            log.warning("renewing this worker's leases failed (%d time(s) in a row; retrying): %s", failures, exc)
            continue
        if failures:
            log.info("renewing this worker's leases worked again after %d failure(s)", failures)
        failures = 0
