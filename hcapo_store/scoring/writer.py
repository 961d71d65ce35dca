"""The single writer of a scoring run: results are committed in short transactions, off the
event loop, and never dropped silently.

- Results wait in a pending list and are written as one batch every ``FLUSH_SECONDS``, or
  at once when ``FLUSH_RESULTS`` wait; a score is durable once it is counted.
- The batch is taken on the event loop's thread and written in a worker thread, so a
  database lock held for seconds (another writer, a checkpoint) never stops the loop from
  sending requests and reading answers.
- A failed write (database locked, disk full) puts its batch back in front of what
  arrived meanwhile, and is retried with backoff; after ``FLUSH_ATTEMPTS`` failures in a
  row the writer gives up (``gave_up``) and asks the run to stop.

There is one flush path, :meth:`ResultWriter.flush`: the periodic loop and the last write
of the run (:meth:`ResultWriter.close`) both go through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from hcapo_store.errors import StoreError
from hcapo_store.scoring import work_queue
from hcapo_store.scoring.backoff import backoff_delay
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

FLUSH_SECONDS = 0.2
FLUSH_RESULTS = 256
FLUSH_ATTEMPTS = 5  # writes of one batch before the run gives up (each waits the busy timeout)
FLUSH_BACKOFF_BASE, FLUSH_BACKOFF_CAP = 0.5, 10.0

log = logging.getLogger(__name__)

# (scored, failed, discarded, prompt tokens) of a batch that landed
Landed = Callable[[int, int, int, int], None]


@dataclass
class _Batch:
    """Results taken from the pending list for one write."""

    results: list[work_queue.StepResult]
    floors: list[tuple[int, int]]
    tokens: int


class ResultWriter:
    """Pending results and their writes; ``landed`` is told what each committed batch held."""

    def __init__(self, store: Store, scorer_id: str, worker: str, landed: Landed, on_give_up: Callable[[], None]):
        self.store, self.scorer_id, self.worker = store, scorer_id, worker
        self.landed, self.on_give_up = landed, on_give_up
        self.pending: list[work_queue.StepResult] = []
        self._floors: list[tuple[int, int]] = []  # (episode id, conversation tokens)
        self._tokens = 0
        self.failures = 0  # consecutive failed writes
        self.error: StoreError | None = None  # the last failed write's
        self.gave_up: StoreError | None = None
        self._inflight: tuple[asyncio.Future[tuple[int, int, int]], _Batch] | None = None
        self._wake: asyncio.Event | None = None  # set when a full batch waits

    # -- what the run hands over

    def record(self, outcome: work_queue.StepResult) -> None:
        self.pending.append(outcome)
        if len(self.pending) >= FLUSH_RESULTS and not self.failures and self._wake is not None:
            self._wake.set()  # the loop writes them (off this thread) at once

    def floor(self, episode_id: int, tokens: int) -> None:
        self._floors.append((episode_id, tokens))

    def tokens(self, n: int) -> None:
        self._tokens += n

    # -- the one flush path

    async def flush(self) -> bool:
        """Write what is pending in one transaction in a worker thread; False (the batch
        stays pending, counted as a failure) when the database refuses. Cancelled while it
        writes, the write goes on: :meth:`close` waits for its outcome."""
        if not self.pending and not self._floors:
            return True
        batch = _Batch(self.pending, self._floors, self._tokens)
        self.pending, self._floors, self._tokens = [], [], 0
        future = asyncio.get_running_loop().run_in_executor(None, self._write, batch)
        self._inflight = (future, batch)
        try:
            counts = await asyncio.shield(future)
        except asyncio.CancelledError:
            raise  # still in flight: close() settles it
        except StoreError as exc:
            self._inflight = None
            self._put_back(batch)
            self._failed(exc)
            return False
        except BaseException:
            self._inflight = None
            self._put_back(batch)
            raise
        self._inflight = None
        self._land(batch, counts)
        return True

    async def run(self) -> None:
        """Flush every ``FLUSH_SECONDS`` (or when woken) until cancelled or given up."""
        self._wake = asyncio.Event()
        delay = FLUSH_SECONDS
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            if await self.flush():
                delay = FLUSH_SECONDS
            elif self.failures >= FLUSH_ATTEMPTS:
                self.gave_up = self.error
                self.on_give_up()  # results cannot be stored: stop computing more
                return
            else:
                delay = self.backoff()

    async def close(self) -> StoreError | None:
        """The last write of the run, after the one a cancelled loop left running; retried
        like the others. The error when it gave up (or had given up before)."""
        await self._settle()
        while not await self.flush():
            if self.failures >= FLUSH_ATTEMPTS:
                return self.error
            await asyncio.sleep(self.backoff())
        return self.gave_up

    def backoff(self) -> float:
        return backoff_delay(self.failures, base=FLUSH_BACKOFF_BASE, cap=FLUSH_BACKOFF_CAP)

    # -- internals

    def _write(self, batch: _Batch) -> tuple[int, int, int]:
        """One transaction (any thread): (scored, failed, discarded)."""
        with db.write(self.store.engine) as conn:
            counts = work_queue.write_results(conn, self.scorer_id, self.worker, batch.results)
            work_queue.write_floors(conn, self.scorer_id, batch.floors)
        return counts

    def _put_back(self, batch: _Batch) -> None:
        self.pending[:0] = batch.results
        self._floors[:0] = batch.floors
        self._tokens += batch.tokens

    def _land(self, batch: _Batch, counts: tuple[int, int, int]) -> None:
        self.failures, self.error = 0, None
        self.landed(*counts, batch.tokens)

    def _failed(self, exc: StoreError) -> None:
        self.failures += 1
        self.error = exc
        log.warning(
            "writing %d result(s) failed (%d time(s) in a row; the run stops after %d): %s",
            len(self.pending),
            self.failures,
            FLUSH_ATTEMPTS,
            exc,
        )

    async def _settle(self) -> None:
        """The outcome of a write the cancelled loop left running."""
        if self._inflight is None:
            return
        future, batch = self._inflight
        self._inflight = None
        try:
            counts = await future
        except Exception:
            self._put_back(batch)  # close() writes it again, counting its own attempts
            return
        self._land(batch, counts)
