"""Parsing episodes in worker processes while the main process stores them.

Ingest is CPU-bound Python (JSON, conversion, compression): in one process it uses one core.
``parse_ahead`` reads sources up to two chunks ahead of the one being stored and hands their
parsing to a process pool. The pipeline still decides for each source, in order and inside
its transaction, whether to load it at all, and then takes the worker's result instead of
parsing. Which sources are parsed ahead is a guess (those not already stored unchanged when
the chunk was read): a wrong guess costs one parse, never a different result. Small ingests
(fewer than ``MIN_PARALLEL`` episodes to parse) never start the pool. Its processes start as
:mod:`hcapo_store.worker_processes` says (what they import first is the application's choice).
"""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from itertools import islice

from hcapo_store import worker_processes
from hcapo_store.errors import IngestError
from hcapo_store.ingestion.discovery import Source
from hcapo_store.ingestion.parsing import ParsedEpisode

# Sources read ahead per step: the unchanged-lookup is one query per chunk, and at most two
# chunks of files and parsed episodes are held (memory stays flat in the number of episodes).
CHUNK = 16
# A chunk with fewer sources to parse is parsed in process: starting the pool costs ~0.2 s,
# about what 8 real-size episodes take to parse.
MIN_PARALLEL = 8


def default_jobs() -> int:
    """Worker processes by default: one per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class _ParsedAhead:
    """A source's ``load`` that takes a worker's result (or its error) when it is there."""

    future: Future[ParsedEpisode]
    inline: Callable[[], ParsedEpisode]

    def __call__(self) -> ParsedEpisode:
        try:
            return self.future.result()
        except (BrokenProcessPool, CancelledError):
            # a worker was killed (out of memory, by hand) or the pool shut down: parse here
            return self.inline()


def _ignore_interrupts() -> None:
    # Ctrl-C reaches the whole process group: the parent alone decides what an interrupt
    # means (roll back the open batch) and shuts the workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(jobs: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=jobs, mp_context=worker_processes.context(), initializer=_ignore_interrupts)


def parse_ahead(
    sources: Iterator[Source | IngestError],
    *,
    jobs: int,
    stored: Callable[[list[Source]], set[tuple[str, str]]],
) -> Generator[Source | IngestError, None, None]:
    """``sources`` in the same order, each Source's ``load`` taken from a worker when it was
    parsed ahead. ``stored(chunk)`` returns the (key, content hash) pairs already stored as
    current: those are not parsed ahead. Close the iterator to stop the workers."""
    if jobs <= 1:
        yield from sources
        return
    pool: ProcessPoolExecutor | None = None
    broken = False
    ahead: deque[Source | IngestError] = deque()

    def refill() -> bool:
        nonlocal pool, broken
        chunk = list(islice(sources, CHUNK))
        if not chunk:
            return False
        candidates = [s for s in chunk if isinstance(s, Source)]
        if pool is None and (broken or len(candidates) < MIN_PARALLEL):
            candidates = []  # no pool would start for so few: no lookup either (follow's batches)
        known = stored(candidates) if candidates else set()
        todo = {id(s) for s in candidates if not {(s.key, s.content_hash), (s.key, s.earlier_hash)} & known}
        if pool is None and not broken and len(todo) >= MIN_PARALLEL:
            pool = _start(jobs)
        for item in chunk:
            if pool is not None and not broken and isinstance(item, Source) and id(item) in todo:
                try:
                    item = replace(item, load=_ParsedAhead(pool.submit(item.load), item.load))
                except BrokenProcessPool:
                    broken = True
            ahead.append(item)
        return True

    try:
        more = refill() and refill()
        while ahead:
            item = ahead.popleft()
            if more and len(ahead) < CHUNK:
                more = refill()
            yield item
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
