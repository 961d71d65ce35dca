"""Where a run prepares its requests: each claimed episode loaded, rendered, tokenized and cut
into requests (:func:`requests_for`), in a thread of this process or in worker processes.

Rendering and tokenizing are mostly pure Python (rendering/ascii_bpe.py), so in a thread they
hold the GIL; an in-process model on a GPU launches its kernels from Python too, and every
millisecond its thread waits for the GIL the GPU idles (bench/gpu_gaps.py: 13-21 such pauses of
several ms per forward on an H100). ``RunOptions.prepare_workers`` > 0 moves the preparation into
that many worker processes (:class:`PreparePool`): each opens the store and builds the same
``PromptBuilder`` (the tokenizer from its directory, the same settings and rendering mode), and
sends back the same requests, so the ids, and the stored log-probabilities, are the thread's.
``None`` (the default) chooses in one place, :func:`default_prepare_workers`: processes when the
in-process model computes on a GPU, or for a large run against a server; threads otherwise (see
there why). A run that chose processes by default does not wait for them to start (~4 s):
its threads prepare the episodes claimed meanwhile. A run given a number waits for its workers.

A pool outlives its run: the next run with the same store and builder (``score_live`` at every
training step) finds its workers started. :func:`close_pools` ends them (and at exit).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

from hcapo_store import worker_processes
from hcapo_store.rendering import verify
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import GroupPrompt, PackedIds, PromptFailure
from hcapo_store.rendering.tokenizers import LoadedClass, load_as, loaded_class
from hcapo_store.scoring import defaults
from hcapo_store.scoring.grouping import Grouping, plan_requests_and_floor
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store

Requests = list[GroupPrompt | PromptFailure]


def requests_for(
    store: Store,
    builder: PromptBuilder,
    episode_id: int,
    wanted: set[int],
    grouping: Grouping,
    key: str,
    lock: AbstractContextManager[Any] | None = None,
) -> tuple[Requests, int]:
    """The requests for the steps ``wanted`` (step indexes) of one episode, each carrying the
    routing ``key``, and the episode's conversation tokens (its prefill floor). ``lock``: held
    while the builder renders (a builder that is not ``thread_safe``, shared by threads)."""
    with db.read(store.engine) as conn:
        episode = load_episode(conn, episode_id)
    steps = [s for s in episode.steps if s.step_index in wanted]
    with lock or contextlib.nullcontext():
        requests, floor = plan_requests_and_floor(
            builder, episode.messages, episode.outcome, steps, episode.steps, grouping=grouping
        )
    return [
        r if isinstance(r, PromptFailure) else GroupPrompt(tuple(replace(m, routing_key=key) for m in r.members))
        for r in requests
    ], floor


def default_prepare_workers(backend: Any, pending_steps: int = 0, cpus: int | None = None) -> int:
    """Worker processes when ``RunOptions.prepare_workers`` is None, else 0 (threads).

    * An in-process model: ``defaults.PREPARE_PROCESSES`` on a GPU, 0 on a CPU. On a GPU the
      model's thread launches each kernel under the GIL, so preparation beside it in threads
      starves the GPU; on a CPU a forward spends its time in torch's own threads without the GIL,
      and worker processes would take cores from it.
    * A server (a backend without ``in_process``): ``defaults.PREPARE_PROCESSES`` when the run
      has at least ``defaults.PREPARE_PROCESSES_FROM_STEPS`` steps to score (``pending_steps``)
      and this process may use two CPUs or more (``cpus``; None: :func:`usable_cpus`). The model
      runs elsewhere, but the client's event loop (sending the requests, reading the answers)
      shares this process's GIL with the threads that prepare: a per-step batch took ×0.55–0.71
      the time with two workers (bench/follow.py). A smaller run spends less preparing than its
      workers' start costs."""
    if not getattr(backend, "in_process", False):
        large = pending_steps >= defaults.PREPARE_PROCESSES_FROM_STEPS
        return defaults.PREPARE_PROCESSES if large and (cpus or usable_cpus()) >= 2 else 0
    try:
        where = backend.computes_in().get("device")
    except RuntimeError:  # not started: nothing known of its device
        return 0
    return defaults.PREPARE_PROCESSES if where == "cuda" else 0


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class BuilderRecipe:
    """What makes a ``PromptBuilder`` again in another process: the tokenizer's directory, the
    builder's keyword arguments, its rendering mode (``fast`` or ``reference``), and the class
    ``AutoTokenizer`` chose for the directory here (None where this process did not load it
    with ``load_tokenizer``): a worker loads through that class, checked against this
    process's load, and never imports ``AutoTokenizer`` and torch under it."""

    tokenizer: str
    options: tuple[tuple[str, Any], ...]
    rendering: str
    loaded: LoadedClass | None = None

    @classmethod
    def of(cls, tokenizer: str, options: dict[str, Any], builder: PromptBuilder) -> BuilderRecipe:
        rendering = "reference" if builder.reference else "fast"
        return cls(tokenizer, tuple(sorted(options.items())), rendering, loaded_class(tokenizer))

    def build(self) -> PromptBuilder:
        tokenizer = load_as(self.tokenizer, self.loaded)
        return PromptBuilder(tokenizer, **dict(self.options), rendering=self.rendering)  # type: ignore[arg-type]


# --- the worker processes' side -----------------------------------------------------------------

_worker: dict[str, Any] = {}  # in a worker: its store and builder


def _start_worker(url: str, recipe: BuilderRecipe) -> None:
    # Ctrl-C reaches the process group: the parent alone decides what it means
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker["reported"] = verify.fallbacks()  # the forkserver's, if any: not this worker's
    _worker["store"] = Store.open(url, create=False)
    _worker["builder"] = recipe.build()


def _prepare_in_worker(
    episode_id: int, wanted: set[int], grouping: Grouping, key: str
) -> tuple[Requests, int, dict[str, int]]:
    requests, floor = requests_for(_worker["store"], _worker["builder"], episode_id, wanted, grouping, key)
    # the fallbacks since the last report: the first episode's include the start's (the tokenizer's load)
    fallbacks = verify.since(_worker["reported"])
    _worker["reported"] = verify.fallbacks()
    return packed(requests), floor, fallbacks


def packed(requests: Requests) -> Requests:
    """The requests with each list of ids as PackedIds: sent to the parent as buffers, not one
    object per id (IdsPrefix windows are sent once per window already)."""
    return [
        r
        if isinstance(r, PromptFailure)
        else GroupPrompt(
            tuple(
                replace(m, input_ids=PackedIds.of(m.input_ids)) if type(m.input_ids) is list else m for m in r.members
            )
        )
        for r in requests
    ]


def _ready() -> bool:
    return "builder" in _worker


# --- the parent's side --------------------------------------------------------------------------


class PreparePool:
    """``workers`` processes preparing episodes of one store with one builder recipe."""

    def __init__(self, url: str, recipe: BuilderRecipe, workers: int) -> None:
        self.url, self.recipe, self.workers = url, recipe, workers
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=worker_processes.context(),
            initializer=_start_worker,
            initargs=(url, recipe),
        )
        # start them now, while the run starts: not on its first episode
        self._starting = [self._pool.submit(_ready) for _ in range(workers)]
        self.fallbacks: Counter[str] = Counter()  # rendering fallbacks counted in the workers

    @property
    def started(self) -> bool:
        """Whether a worker has started (opened the store, built the builder)."""
        return any(f.done() for f in self._starting)

    @property
    def broken(self) -> bool:
        return self._pool is None

    async def prepare(
        self, episode_id: int, wanted: set[int], grouping: Grouping, key: str, *, wait: bool = True
    ) -> tuple[Requests, int] | None:
        """The episode's requests and floor from a worker; None when the pool is broken (a worker
        was killed), or when no worker has started yet and not ``wait``: the caller then prepares
        in a thread, as without a pool (the same requests: tests/test_prepare_processes.py)."""
        if self._pool is None or (not wait and not self.started):
            return None
        loop = asyncio.get_running_loop()
        try:
            requests, floor, fallbacks = await loop.run_in_executor(
                self._pool, _prepare_in_worker, episode_id, wanted, grouping, key
            )
        except BrokenProcessPool:
            self.close()
            return None
        self.fallbacks.update(fallbacks)
        return requests, floor

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


_pools: dict[tuple[str, BuilderRecipe, int], PreparePool] = {}  # least recently used first
_pools_lock = threading.Lock()
# pools kept at once: a log-ratio training step scores with two recipes (with and without the
# hindsight block), and one kept pool made each step start both again (~1 s a worker)
KEPT_POOLS = 2


def shared_pool(url: str, recipe: BuilderRecipe, workers: int) -> PreparePool | None:
    """The pool for this store, recipe and size, started at its first use and kept for the next
    runs (``KEPT_POOLS`` at a time: the least recently used one is ended first). None for an
    in-memory database (no other process can open it)."""
    if workers < 1 or _in_memory(url):
        return None
    key = (url, recipe, workers)
    with _pools_lock:
        pool = _pools.pop(key, None)
        if pool is None or pool.broken:
            while len(_pools) >= KEPT_POOLS:
                _pools.pop(next(iter(_pools))).close()
            pool = PreparePool(url, recipe, workers)
        _pools[key] = pool  # now the most recently used
        return pool


def _in_memory(url: str) -> bool:
    return url.startswith("sqlite") and (":memory:" in url or "mode=memory" in url or url.rstrip("/") == "sqlite:")


def close_pools() -> None:
    """End every kept pool's workers."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)

__all__: Sequence[str] = (
    "BuilderRecipe",
    "PreparePool",
    "close_pools",
    "default_prepare_workers",
    "packed",
    "requests_for",
    "shared_pool",
    "usable_cpus",
)
