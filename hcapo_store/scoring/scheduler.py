"""Resumable scoring: claim episodes under a lease, build prompts, request, verify, commit.

- ``concurrency`` episodes are in flight at once; the steps of one episode go in order,
  consecutive steps whose prompts are exact prefixes of one another in one request
  (``grouping.py``; ``RunOptions.grouping = "per-step"`` sends one request per step).
- Results go to one writer (``writer.py``), which commits them in short transactions; a
  score is durable once it is counted. When it cannot store them (``FLUSH_ATTEMPTS``
  failed writes in a row) the run stops and raises ``StoreError``: results are never
  dropped silently. Leases are renewed by ``heartbeat.py``, which outlives database errors.
- Every failed attempt is recorded; retryable failures are retried with bounded,
  jittered backoff (honouring Retry-After); after ``max_attempts`` the step is failed.
  The wait after a connection failure ends as soon as the server answers a probe
  (``health.py``: a restarted server is used again at once).
- Stopping (Ctrl-C or ``stop()``) stops claiming, lets in-flight requests finish for
  ``stop_grace_seconds`` (then cancels them), commits, and gives leased steps back to the queue.
- A dead server is not a reason to fail steps: after ``down_after`` consecutive transport
  failures (or a step's last attempt failing with one) the server is probed; when it does
  not answer, the run stops and the rest stays pending (``health.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hcapo_store.errors import InferenceError, ScoringError, StoreError, UsageError
from hcapo_store.rendering import verify
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import GroupPrompt, PromptFailure
from hcapo_store.scoring import defaults, work_queue
from hcapo_store.scoring.backends.base import Backend, BackendScore
from hcapo_store.scoring.backends.http import MODEL_CHANGED
from hcapo_store.scoring.backoff import backoff_delay
from hcapo_store.scoring.grouping import Grouping
from hcapo_store.scoring.health import ServerHealth
from hcapo_store.scoring.heartbeat import keep_leases
from hcapo_store.scoring.preparing import PreparePool, requests_for
from hcapo_store.scoring.results import ScoreReport, request_shares, score_row
from hcapo_store.scoring.writer import (  # noqa: F401 - FLUSH_SECONDS re-exported (tests pace writes by it)
    FLUSH_ATTEMPTS,
    FLUSH_BACKOFF_BASE,
    FLUSH_BACKOFF_CAP,
    FLUSH_SECONDS,
    ResultWriter,
)
from hcapo_store.storage.models import WORKER_ID_LENGTH
from hcapo_store.storage.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    """How one ``score`` process runs: concurrency, retries, leases, filters, limit."""

    concurrency: int = defaults.CONCURRENCY
    max_attempts: int = defaults.MAX_ATTEMPTS
    lease_seconds: float = defaults.LEASE_SECONDS
    filters: work_queue.Filters = work_queue.Filters()
    limit: int | None = None
    worker_id: str | None = None
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    grouping: Grouping = defaults.GROUPING  # steps whose prompts are exact prefixes share one request
    stop_grace_seconds: float = 10.0  # after a stop, in-flight requests get this long, then are cancelled
    down_after: int = 8  # consecutive transport failures (any episodes) before the server is probed
    # worker processes that load, render and tokenize the claimed episodes (preparing.py); 0: threads
    # of this process; None: preparing.default_prepare_workers (processes for a model on a GPU or a
    # large run against a server, used as they start: threads prepare meanwhile)
    prepare_workers: int | None = None

    def __post_init__(self) -> None:
        # Checked up front: a worker id the workers table cannot hold would fail mid-run.
        wid = self.worker_id
        if wid and (len(wid) > WORKER_ID_LENGTH or "\x00" in wid):
            raise UsageError(
                f"worker id {wid[:40]!r}{'…' if len(wid) > 40 else ''} ({len(wid)} characters): "
                f"a worker id has at most {WORKER_ID_LENGTH} characters and no NUL"
            )


def routing_key(episode_id: int) -> str:
    """The routing key of an episode's requests: opaque and stable (a hash of its row id), so a
    router keeps the episode on the worker whose prefix cache holds its conversation."""
    return "ep-" + hashlib.sha256(f"hcapo-store episode {episode_id}".encode()).hexdigest()[:16]


class Scheduler:
    def __init__(
        self,
        store: Store,
        scorer_id: str,
        backend: Backend,
        builder: PromptBuilder,
        options: RunOptions = RunOptions(),
        on_progress: Callable[[ScoreReport], None] | None = None,
        pool: PreparePool | None = None,
    ) -> None:
        """``pool``: worker processes that prepare the episodes' requests (None: threads)."""
        self.store, self.scorer_id, self.backend, self.builder = store, scorer_id, backend, builder
        self.pool = pool
        self.options = options
        self.worker = options.worker_id or work_queue.default_worker_id()
        self.on_progress = on_progress
        self.report = ScoreReport(scorer_id=scorer_id, worker_id=self.worker)
        self.writer = ResultWriter(store, scorer_id, self.worker, self._landed, on_give_up=self.stop)
        self.health: ServerHealth | None = None  # made in the run's event loop
        self._stopping = threading.Event()
        self._announced: dict[str, int] = {}  # other workers' lease counts already reported
        self._claim_error: StoreError | None = None  # claiming kept failing: the run stopped
        self._model_error: ScoringError | None = None  # another model answered: the run stopped
        self._stop_requested: asyncio.Event | None = None  # set in the loop when _stopping is
        self._loop: asyncio.AbstractEventLoop | None = None
        self._claimed = 0
        # The per-step layout's token caches are not thread-safe; the episode layout keeps none,
        # so its episodes are prepared side by side (PromptBuilder.thread_safe says what of that
        # runs in parallel: the backend's share of tokenizing, not the ASCII pieces).
        self._build_lock = contextlib.nullcontext() if builder.thread_safe else threading.Lock()

    def stop(self) -> None:
        """Stop claiming; in-flight requests finish (within the grace period); the rest is released."""
        self._stopping.set()
        if self._loop is not None and self._stop_requested is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop_requested.set)
            except RuntimeError:  # the loop is closed: nothing in flight to cancel
                pass

    # -- main loop -------------------------------------------------------------

    async def run(self) -> ScoreReport:
        # Each response allocates thousands of small lists; with a large heap (transformers,
        # tokenizer) the cyclic GC's full collections then cost more than the bookkeeping
        # itself. Objects alive now (modules, tokenizer, caches) are exempted for the run.
        # No collection first: it costs ~0.15 s over that heap on every run (every batch of
        # `follow`); garbage frozen with them is collected after the run instead. A process that
        # froze its own heap (a trainer before it forks, a test session) is left as it is: the
        # unfreeze would end its freeze too.
        if gc.get_freeze_count():
            return await self._run()
        gc.freeze()
        try:
            return await self._run()
        finally:
            gc.unfreeze()

    async def _run(self) -> ScoreReport:
        started = time.monotonic()
        fallbacks_before = verify.fallbacks()
        pool_fallbacks_before = Counter(self.pool.fallbacks) if self.pool is not None else Counter()
        work_queue.reap_dead_local_workers(self.store)
        self.report.planned = work_queue.count_claimable(self.store, self.scorer_id, self.options.filters)
        if self.options.limit is not None:
            self.report.planned = min(self.report.planned, self.options.limit)
        work_queue.register_worker(self.store, self.worker, self.scorer_id)
        loop = asyncio.get_running_loop()
        self._loop, self._stop_requested = loop, asyncio.Event()
        self.health = ServerHealth(self.backend, down_after=self.options.down_after, on_down=self.stop)
        if self._stopping.is_set():
            self._stop_requested.set()
        installed = _install_sigint(loop, self.stop)
        flusher = asyncio.create_task(self.writer.run())
        beats = asyncio.create_task(
            keep_leases(
                self.store, self.worker, self.options.lease_seconds, lambda: (self.report.scored, self.report.failed)
            )
        )
        state = "finished"
        write_error: StoreError | None = None
        try:
            await self._run_workers()
        except BaseException:
            state = "crashed"
            raise
        finally:
            flusher.cancel()
            beats.cancel()
            await asyncio.gather(flusher, beats, return_exceptions=True)
            write_error = await self.writer.close() or self._claim_error
            if installed:
                loop.remove_signal_handler(signal.SIGINT)
            self.report.server_down = self.health.down if self.health is not None else None
            self.report.interrupted = (
                self._stopping.is_set() and self.report.server_down is None and not (write_error or self._model_error)
            )
            self.report.elapsed_s = time.monotonic() - started
            self.report.strategy_fallbacks = verify.since(fallbacks_before)
            if self.pool is not None:  # counted in the workers, over the run
                merged = Counter(self.report.strategy_fallbacks) + self.pool.fallbacks - pool_fallbacks_before
                self.report.strategy_fallbacks = dict(merged)
            failed = write_error or self._model_error
            released = self._finish("failed" if failed else "stopped" if self.report.interrupted else state)
        if write_error is not None:
            raise type(write_error)(self._write_failure(write_error, released)) from write_error
        if self._model_error is not None:
            raise self._model_error
        return self.report

    def _finish(self, state: str) -> int | None:
        """Mark the worker ended and release its leases; None when the database refuses
        (the leases then expire, or the next ``score`` on this host releases them)."""
        try:
            self.report.released = work_queue.finish_worker(
                self.store, self.worker, state, scored=self.report.scored, failed=self.report.failed
            )
        except StoreError as exc:
            log.warning("could not release this worker's leases: %s", exc)
            return None
        return self.report.released

    def _write_failure(self, error: StoreError, released: int | None) -> str:
        leases = (
            f"{released} leased step(s) were returned to the queue"
            if released is not None
            else f"its leases could not be released and expire within {self.options.lease_seconds:g}s "
            "(a `score` on this host releases them at once)"
        )
        pending = len(self.writer.pending)
        lost = (
            f"{pending} result(s) could not be stored after {self.writer.failures} attempts"
            if pending
            else f"writing results failed {FLUSH_ATTEMPTS} times in a row"
        )
        return f"scoring stopped: {lost} ({error}); {self.report.scored} result(s) stored, {leases}"

    async def _run_workers(self) -> None:
        """The episode workers; after a stop, those still in flight past the grace period are
        cancelled (their leased steps go back to the queue with the others)."""
        tasks = [asyncio.create_task(self._episode_worker()) for _ in range(max(self.options.concurrency, 1))]
        watchdog = asyncio.create_task(self._cancel_after_grace(tasks))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            watchdog.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _cancel_after_grace(self, tasks: list[asyncio.Task]) -> None:
        assert self._stop_requested is not None
        await self._stop_requested.wait()
        await asyncio.sleep(self.options.stop_grace_seconds)
        running = [t for t in tasks if not t.done()]
        self.report.cancelled = len(running)
        for task in running:
            task.cancel()

    async def _episode_worker(self) -> None:
        while not self._stopping.is_set():
            remaining = None if self.options.limit is None else self.options.limit - self._claimed
            if remaining is not None and remaining <= 0:
                return
            # Reserve before the (awaited) claim so that concurrent workers cannot all
            # claim the same remaining budget; give back what the claim did not use.
            self._claimed += remaining or 0
            try:
                claim = await self._claim(remaining)
            except StoreError as exc:
                # The database keeps refusing (locked, full): stop claiming; the writer stores
                # or gives up on what is pending, and the run ends with one line.
                self._claim_error = self._claim_error or exc
                self.stop()
                return
            self._claimed += (len(claim.leases) if claim is not None else 0) - (remaining or 0)
            if claim is None:
                if await self._wait_for_others():
                    continue
                return
            await self._score_episode(claim)

    async def _wait_for_others(self) -> bool:
        """Nothing claimable, but the work is not done while other workers hold leases:
        those of dead workers on this host are reclaimed at once (True: claim again);
        live ones are waited for until they finish (False) or their leases lapse (True)."""
        assert self._stop_requested is not None
        store, filters = self.store, self.options.filters
        while not self._stopping.is_set():
            await asyncio.to_thread(work_queue.reap_dead_local_workers, store)
            if await asyncio.to_thread(work_queue.count_claimable, store, self.scorer_id, filters):
                return True
            others = await asyncio.to_thread(work_queue.leases_of_others, store, self.scorer_id, self.worker, filters)
            if not others:
                return False
            for o in others:
                if self._announced.get(o.owner) != o.steps:
                    self._announced[o.owner] = o.steps
                    until = time.strftime("%H:%M:%S UTC", time.gmtime(o.until))
                    log.warning(
                        "waiting for %d step(s) leased by worker %s (lease renewed until %s while it runs)",
                        o.steps,
                        o.owner,
                        until,
                    )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), min(self.options.lease_seconds / 3, 2.0))
        return False

    async def _claim(self, remaining: int | None) -> work_queue.Claim | None:
        """Claim an episode; a database error is retried with backoff as a failed write is."""
        failures = 0
        while True:
            try:
                return await asyncio.to_thread(
                    work_queue.claim,
                    self.store,
                    self.scorer_id,
                    self.worker,
                    lease_seconds=self.options.lease_seconds,
                    filters=self.options.filters,
                    max_steps=remaining,
                )
            except StoreError as exc:
                failures += 1
                if failures >= FLUSH_ATTEMPTS or self._stopping.is_set():
                    raise
                log.warning("claiming work failed (%d time(s) in a row; retrying): %s", failures, exc)
                await asyncio.sleep(backoff_delay(failures, base=FLUSH_BACKOFF_BASE, cap=FLUSH_BACKOFF_CAP))

    async def _score_episode(self, claim: work_queue.Claim) -> None:
        prepared = None
        if self.pool is not None:
            wanted = {lease.step_index for lease in claim.leases}
            key = routing_key(claim.episode_id)
            # a pool the run was given waits for its workers; one chosen by default does not
            wait = self.options.prepare_workers is not None
            prepared = await self.pool.prepare(claim.episode_id, wanted, self.options.grouping, key, wait=wait)
        requests, floor = prepared if prepared is not None else await asyncio.to_thread(self._requests_for, claim)
        self.writer.floor(claim.episode_id, floor)
        leases = {lease.step_index: lease for lease in claim.leases}
        for request in requests:
            if self._stopping.is_set():
                return  # unstarted leases are released at the end
            if isinstance(request, PromptFailure):
                lease = leases[request.step_index]
                self._record(
                    work_queue.StepResult(
                        lease.attempt_id, lease.step_id, error_kind=request.reason, error=request.message, final=True
                    )
                )
                continue
            await self._score_request([leases[m.step_index] for m in request.members], request)

    def _requests_for(self, claim: work_queue.Claim) -> tuple[list[GroupPrompt | PromptFailure], int]:
        """The episode's requests for the claimed steps (every one carrying the episode's routing
        key), and its conversation tokens (the prefill floor)."""
        wanted = {lease.step_index for lease in claim.leases}
        key = routing_key(claim.episode_id)
        return requests_for(
            self.store, self.builder, claim.episode_id, wanted, self.options.grouping, key, self._build_lock
        )

    async def _request(self, group: GroupPrompt) -> list[BackendScore]:
        """One request for the group (a lone step goes through ``score`` exactly as before)."""
        if len(group.members) == 1:
            results = [await self.backend.score(group.members[0])]
        else:
            results = await self.backend.score_group(group)
        k = int(getattr(self.backend, "top_k", 0) or 0)
        for prompt, result in zip(group.members, results, strict=True):
            if len(result.logprobs) != prompt.scored_tokens:
                raise InferenceError(
                    "mismatch",
                    f"backend returned {len(result.logprobs)} logprobs for {prompt.scored_tokens} scored tokens",
                    retryable=False,
                )
            if k and (
                result.top is None or len(result.top) != prompt.scored_tokens or any(len(r) != k for r in result.top)
            ):
                rows = None if result.top is None else len(result.top)
                raise InferenceError(
                    "mismatch",
                    f"backend returned {rows} top-{k} rows for {prompt.scored_tokens} scored tokens",
                    retryable=False,
                )
        return results

    async def _score_request(self, leases: list[work_queue.Lease], group: GroupPrompt) -> None:
        """Score one request's steps; every attempt's outcome is recorded for each of them."""
        attempt = max(lease.attempt_count for lease in leases)
        while True:
            attempt += 1
            try:
                results = await self._request(group)
            except InferenceError as exc:
                if exc.kind == MODEL_CHANGED:
                    self._model_changed(leases, exc)
                    return
                final = not exc.retryable or attempt >= self.options.max_attempts
                assert self.health is not None
                if await self.health.is_down(exc, final):
                    final = False  # not the steps' fault: they stay pending for the next run
                for lease in leases:
                    self._record(
                        work_queue.StepResult(
                            lease.attempt_id, lease.step_id, error_kind=exc.kind, error=str(exc)[:2000], final=final
                        )
                    )
                if final or self._stopping.is_set():
                    return
                self.report.retried += len(leases)
                delay = backoff_delay(
                    attempt, base=self.options.backoff_base, cap=self.options.backoff_cap, retry_after=exc.retry_after
                )
                await self.health.wait_before_retry(delay, exc, self._stopping.is_set)
                if self._stopping.is_set():
                    return  # stopped while waiting: the step goes back to the queue
                continue
            assert self.health is not None
            self.health.answered()
            shares = request_shares(group, results[0].cached_tokens)
            for lease, prompt, result, (sent, cached) in zip(leases, group.members, results, shares):
                row = score_row(prompt, result, sent_tokens=sent, sent_cached_tokens=cached)
                self._record(work_queue.StepResult(lease.attempt_id, lease.step_id, score_row=row))
            self.writer.tokens(len(group.input_ids))
            return

    def _model_changed(self, leases: list[work_queue.Lease], exc: InferenceError) -> None:
        """Another model answers at the URL: record the attempt (the steps stay unscored) and stop."""
        for lease in leases:
            self._record(
                work_queue.StepResult(
                    lease.attempt_id, lease.step_id, error_kind=exc.kind, error=str(exc)[:2000], final=False
                )
            )
        if self._model_error is None:
            self._model_error = ScoringError(
                f"scoring stopped: {exc}; rerun `score` against the scorer's model, "
                "or with the new one to start a new scorer"
            )
        self.stop()

    # -- results go to the writer -----------------------------------------------------

    def _record(self, outcome: work_queue.StepResult) -> None:
        if outcome.error_kind is not None and outcome.final:
            self.report.failure_kinds[outcome.error_kind] += 1
            self.report.note_error(outcome.error_kind, outcome.error or "")
        self.writer.record(outcome)

    def _landed(self, scored: int, failed: int, discarded: int, tokens: int) -> None:
        """A batch was committed: count it."""
        self.report.scored += scored
        self.report.failed += failed
        self.report.discarded += discarded
        self.report.prompt_tokens += tokens
        if self.on_progress is not None:
            self.on_progress(self.report)


def _install_sigint(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> bool:
    """First Ctrl-C: stop gracefully. A second one falls through to KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        return False

    def handler() -> None:
        stop()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, handler)
    except (NotImplementedError, RuntimeError):
        return False
    return True
