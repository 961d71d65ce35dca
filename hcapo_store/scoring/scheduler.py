"""Resumable scoring: claim episodes under a lease, build prompts, request, verify, commit.

- ``concurrency`` episodes are in flight at once; the steps of one episode go in order,
  consecutive steps whose prompts are exact prefixes of one another in one request
  (``grouping.py``; ``RunOptions.grouping = "per-step"`` sends one request per step).
- Results are written by one writer in short transactions (a batch every
  ``FLUSH_SECONDS`` or ``FLUSH_RESULTS``); a score is durable once it is counted. A
  failed write (database locked, disk full) keeps the batch and is retried with backoff;
  after ``FLUSH_ATTEMPTS`` failures the run stops and raises ``StoreError``: results are
  never dropped silently.
- Every failed attempt is recorded; retryable failures are retried with bounded,
  jittered backoff (honouring Retry-After); after ``max_attempts`` the step is failed.
- Stopping (Ctrl-C or ``stop()``) stops claiming, lets in-flight requests finish for
  ``stop_grace_seconds`` (then cancels them), commits, and gives leased steps back to the queue.
- A dead server is not a reason to fail steps: after ``down_after`` consecutive transport
  failures (or a step's last attempt failing with one) the server is probed; when it does
  not answer, the run stops and the rest stays pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hcapo_store.clock import utcnow
from hcapo_store.errors import InferenceError, ScoringError, StoreError, UsageError
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import GroupPrompt, PromptFailure, StepPrompt
from hcapo_store.scoring import defaults, work_queue
from hcapo_store.scoring.backends.base import Backend, BackendScore
from hcapo_store.scoring.backends.http import MODEL_CHANGED
from hcapo_store.scoring.grouping import Grouping, plan_requests_and_floor
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.models import WORKER_ID_LENGTH
from hcapo_store.storage.store import Store

FLUSH_SECONDS = 0.2
FLUSH_RESULTS = 256
FLUSH_ATTEMPTS = 5  # writes of one batch before the run gives up (each waits the busy timeout)
FLUSH_BACKOFF_BASE, FLUSH_BACKOFF_CAP = 0.5, 10.0

log = logging.getLogger(__name__)
FIRST_ERRORS = 5  # distinct final errors kept in the report, to print
TRANSPORT_KINDS = frozenset({"connect", "timeout"})  # no HTTP answer at all


def backoff_delay(attempt: int, *, base: float = 0.5, cap: float = 30.0, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; a server's Retry-After wins (bounded by cap)."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), cap)
    return random.uniform(0, min(cap, base * 2 ** max(attempt - 1, 0)))


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

    def __post_init__(self) -> None:
        # Checked up front: a worker id the workers table cannot hold would fail mid-run.
        wid = self.worker_id
        if wid and (len(wid) > WORKER_ID_LENGTH or "\x00" in wid):
            raise UsageError(
                f"worker id {wid[:40]!r}{'…' if len(wid) > 40 else ''} ({len(wid)} characters): "
                f"a worker id has at most {WORKER_ID_LENGTH} characters and no NUL"
            )


@dataclass
class ScoreReport:
    scorer_id: str = ""
    worker_id: str = ""
    planned: int = 0
    scored: int = 0
    failed: int = 0
    retried: int = 0
    discarded: int = 0
    released: int = 0
    prompt_tokens: int = 0
    elapsed_s: float = 0.0
    interrupted: bool = False
    server_down: str | None = None  # why the run stopped early: the server stopped answering
    cancelled: int = 0  # in-flight requests cancelled after the stop grace period
    failure_kinds: Counter = field(default_factory=Counter)
    first_errors: list[tuple[str, str]] = field(default_factory=list)  # (kind, message), distinct, in order

    def note_error(self, kind: str, message: str) -> None:
        if len(self.first_errors) < FIRST_ERRORS and all(m != message for _, m in self.first_errors):
            self.first_errors.append((kind, message))

    def summary(self) -> str:
        rate = self.scored / self.elapsed_s if self.elapsed_s else 0.0
        kinds = ", ".join(f"{k} {n}" for k, n in self.failure_kinds.most_common())
        line = (
            f"scored {self.scored}, failed {self.failed}, retried {self.retried} attempt(s)"
            f"{f' [{kinds}]' if kinds else ''}; {self.prompt_tokens} prompt tokens; "
            f"{self.elapsed_s:.1f}s ({rate:.1f} steps/s)"
        )
        if self.discarded:
            line += f"; {self.discarded} late result(s) discarded"
        if self.server_down:
            line += f" — stopped: {self.server_down}; {self.released} leased step(s) returned to the queue"
        elif self.interrupted:
            line += f" — interrupted, {self.released} leased step(s) returned to the queue"
        if self.cancelled:
            line += f" ({self.cancelled} request(s) in flight cancelled)"
        return line

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("failure_kinds", "first_errors")}
        d["failure_kinds"] = dict(self.failure_kinds)
        d["first_errors"] = [{"kind": k, "message": m} for k, m in self.first_errors]
        return d

    def error_lines(self, width: int = 300) -> list[str]:
        """The first distinct final errors, one line each (``kind: message``)."""
        lines = []
        for kind, message in self.first_errors:
            text = " ".join(message.split())
            text = text if text.startswith(f"{kind}:") else f"{kind}: {text}"
            lines.append(text if len(text) <= width else text[: width - 1] + "…")
        return lines


def routing_key(episode_id: int) -> str:
    """The routing key of an episode's requests: opaque and stable (a hash of its row id), so a
    router keeps the episode on the worker whose prefix cache holds its conversation."""
    return "ep-" + hashlib.sha256(f"hcapo-store episode {episode_id}".encode()).hexdigest()[:16]


def score_row(
    prompt: StepPrompt, result: BackendScore, *, sent_tokens: int | None = None, sent_cached_tokens: int | None = None
) -> dict[str, Any]:
    """The stored row of one step's result; ``sent_*``: its share of its request's tokens."""
    values = np.asarray(result.logprobs, dtype="<f4")
    # The mean is taken over the stored float32 values, so it can be recomputed from the blob.
    return {
        "token_logprobs": values.tobytes(),
        "token_count": int(values.size),
        "mean_logprob": float(values.astype(np.float64).mean()),
        "total_action_tokens": prompt.total_action_tokens,
        "skipped_action_tokens": prompt.skipped_action_tokens,
        "truncated_prefix_tokens": prompt.truncated_prefix_tokens,
        "input_tokens": len(prompt.input_ids),
        "logprob_start_len": prompt.first_scored - 1,
        "flattened": prompt.flattened,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "latency_s": result.latency_s,
        "server_model": result.model_id,
        "created_at": utcnow().isoformat(timespec="seconds"),
        "sent_tokens": sent_tokens,
        "sent_cached_tokens": sent_cached_tokens,
    }


def request_shares(group: GroupPrompt, cached: int | None) -> list[tuple[int, int | None]]:
    """Per member, (tokens sent, tokens cached) of the request it shared: each member counts the
    ids after the previous member's end; the server's cached count goes to the first member."""
    out: list[tuple[int, int | None]] = []
    previous = 0
    for i, member in enumerate(group.members):
        end = len(member.input_ids)
        out.append((end - previous, cached if i == 0 or cached is None else 0))
        previous = end
    return out


class Scheduler:
    def __init__(
        self,
        store: Store,
        scorer_id: str,
        backend: Backend,
        builder: PromptBuilder,
        options: RunOptions = RunOptions(),
        on_progress: Callable[[ScoreReport], None] | None = None,
    ) -> None:
        self.store, self.scorer_id, self.backend, self.builder = store, scorer_id, backend, builder
        self.options = options
        self.worker = options.worker_id or work_queue.default_worker_id()
        self.on_progress = on_progress
        self.report = ScoreReport(scorer_id=scorer_id, worker_id=self.worker)
        self._pending: list[work_queue.StepResult] = []
        self._inflight: tuple[asyncio.Future[tuple[int, int, int]], _Batch] | None = None  # a write off the loop
        self._flush_now: asyncio.Event | None = None  # set when a full batch waits
        self._pending_floors: list[tuple[int, int]] = []  # (episode id, conversation tokens)
        self._pending_tokens = 0
        self._stopping = threading.Event()
        self._announced: dict[str, int] = {}  # other workers' lease counts already reported
        self._flush_failures = 0  # consecutive failed writes of the pending batch
        self._write_error: StoreError | None = None
        self._gave_up: StoreError | None = None  # the writer stopped the run
        self._model_error: ScoringError | None = None  # another model answered: the run stopped
        self._stop_requested: asyncio.Event | None = None  # set in the loop when _stopping is
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport_failures = 0  # consecutive, across episodes
        self._probe_lock: asyncio.Lock | None = None
        self._claimed = 0
        # The per-step layout's token caches are not thread-safe; the episode layout keeps none
        # and tokenizes through the backend alone, so episodes are prepared side by side (the
        # backend releases the GIL while it encodes).
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
        # `follow`); garbage frozen with them is collected after the run instead.
        gc.freeze()
        try:
            return await self._run()
        finally:
            gc.unfreeze()

    async def _run(self) -> ScoreReport:
        started = time.monotonic()
        work_queue.reap_dead_local_workers(self.store)
        self.report.planned = work_queue.count_claimable(self.store, self.scorer_id, self.options.filters)
        if self.options.limit is not None:
            self.report.planned = min(self.report.planned, self.options.limit)
        work_queue.register_worker(self.store, self.worker, self.scorer_id)
        loop = asyncio.get_running_loop()
        self._loop, self._stop_requested, self._probe_lock = loop, asyncio.Event(), asyncio.Lock()
        self._flush_now = asyncio.Event()
        if self._stopping.is_set():
            self._stop_requested.set()
        installed = _install_sigint(loop, self.stop)
        flusher = asyncio.create_task(self._flush_loop())
        beats = asyncio.create_task(self._heartbeat_loop())
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
            await self._settle()
            write_error = self._drain() or self._gave_up
            if installed:
                loop.remove_signal_handler(signal.SIGINT)
            self.report.interrupted = (
                self._stopping.is_set() and self.report.server_down is None and not (write_error or self._model_error)
            )
            self.report.elapsed_s = time.monotonic() - started
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
        lost = (
            f"{len(self._pending)} result(s) could not be stored after {self._flush_failures} attempts"
            if self._pending
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
                self._gave_up = self._gave_up or exc
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
        requests, floor = await asyncio.to_thread(self._requests_for, claim)
        self._pending_floors.append((claim.episode_id, floor))
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
        with db.read(self.store.engine) as conn:
            episode = load_episode(conn, claim.episode_id)
        wanted = {lease.step_index for lease in claim.leases}
        steps = [s for s in episode.steps if s.step_index in wanted]
        with self._build_lock:
            requests, floor = plan_requests_and_floor(
                self.builder, episode.messages, episode.outcome, steps, episode.steps, grouping=self.options.grouping
            )
        key = routing_key(claim.episode_id)
        return [
            r if isinstance(r, PromptFailure) else GroupPrompt(tuple(replace(m, routing_key=key) for m in r.members))
            for r in requests
        ], floor

    async def _request(self, group: GroupPrompt) -> list[BackendScore]:
        """One request for the group (a lone step goes through ``score`` exactly as before)."""
        if len(group.members) == 1:
            results = [await self.backend.score(group.members[0])]
        else:
            results = await self.backend.score_group(group)
        for prompt, result in zip(group.members, results, strict=True):
            if len(result.logprobs) != prompt.scored_tokens:
                raise InferenceError(
                    "mismatch",
                    f"backend returned {len(result.logprobs)} logprobs for {prompt.scored_tokens} scored tokens",
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
                if await self._server_is_down(exc, final):
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
                await asyncio.sleep(
                    backoff_delay(
                        attempt,
                        base=self.options.backoff_base,
                        cap=self.options.backoff_cap,
                        retry_after=exc.retry_after,
                    )
                )
                if self._stopping.is_set():
                    return  # stopped while waiting: the step goes back to the queue
                continue
            self._transport_failures = 0
            shares = request_shares(group, results[0].cached_tokens)
            for lease, prompt, result, (sent, cached) in zip(leases, group.members, results, shares):
                row = score_row(prompt, result, sent_tokens=sent, sent_cached_tokens=cached)
                self._record(work_queue.StepResult(lease.attempt_id, lease.step_id, score_row=row))
            self._pending_tokens += len(group.input_ids)
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

    async def _server_is_down(self, exc: InferenceError, final: bool) -> bool:
        """After a transport failure: is the server gone? Probed (one probe at a time) after
        ``down_after`` in a row, or before a step would fail for good because of one."""
        if exc.kind not in TRANSPORT_KINDS:
            self._transport_failures = 0  # the server answered
            return False
        self._transport_failures += 1
        if self.report.server_down is not None:
            return True
        if not final and self._transport_failures < self.options.down_after:
            return False
        ping = getattr(self.backend, "ping", None)
        if ping is None:
            return False
        assert self._probe_lock is not None
        async with self._probe_lock:
            if self.report.server_down is None and not await ping():
                self.report.server_down = (
                    f"the server stopped answering ({self._transport_failures} transport "
                    f"failure(s) in a row, then a probe: {exc})"
                )
                self.stop()
            else:
                self._transport_failures = 0
        return self.report.server_down is not None

    # -- the single writer -------------------------------------------------------

    def _record(self, outcome: work_queue.StepResult) -> None:
        if outcome.error_kind is not None and outcome.final:
            self.report.failure_kinds[outcome.error_kind] += 1
            self.report.note_error(outcome.error_kind, outcome.error or "")
        self._pending.append(outcome)
        if len(self._pending) >= FLUSH_RESULTS and not self._flush_failures and self._flush_now is not None:
            self._flush_now.set()  # the flush loop writes them (off this thread) at once

    # The pending batch is taken on the event loop's thread and written in a worker thread:
    # a database lock held for seconds (another writer, a checkpoint) never stops the loop
    # from sending requests and reading answers. A batch whose write fails goes back in
    # front of what arrived meanwhile.

    def _take(self) -> _Batch:
        batch = _Batch(self._pending, self._pending_floors, self._pending_tokens)
        self._pending, self._pending_floors, self._pending_tokens = [], [], 0
        return batch

    def _write(self, batch: _Batch) -> tuple[int, int, int]:
        """One transaction (any thread): (scored, failed, discarded)."""
        with db.write(self.store.engine) as conn:
            counts = work_queue.write_results(conn, self.scorer_id, self.worker, batch.results)
            work_queue.write_floors(conn, self.scorer_id, batch.floors)
        return counts

    def _put_back(self, batch: _Batch) -> None:
        self._pending[:0] = batch.results
        self._pending_floors[:0] = batch.floors
        self._pending_tokens += batch.tokens

    def _landed(self, batch: _Batch, counts: tuple[int, int, int]) -> None:
        scored, failed, discarded = counts
        self.report.scored += scored
        self.report.failed += failed
        self.report.discarded += discarded
        self.report.prompt_tokens += batch.tokens
        if self.on_progress is not None:
            self.on_progress(self.report)

    def _flush(self) -> None:
        """Write the pending batch here, in one transaction; on failure it stays pending."""
        if not self._pending and not self._pending_floors:
            return
        batch = self._take()
        try:
            counts = self._write(batch)
        except BaseException:
            self._put_back(batch)
            raise
        self._landed(batch, counts)

    async def _flush_off_loop(self) -> None:
        """:meth:`_flush` with the write in a worker thread. Cancelled while it writes, the
        write goes on: :meth:`_settle` (before the last write) waits for its outcome."""
        if not self._pending and not self._pending_floors:
            return
        batch = self._take()
        future = asyncio.get_running_loop().run_in_executor(None, self._write, batch)
        self._inflight = (future, batch)
        try:
            counts = await asyncio.shield(future)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._inflight = None
            self._put_back(batch)
            raise
        self._inflight = None
        self._landed(batch, counts)

    async def _settle(self) -> None:
        """The outcome of a write the cancelled flush loop left running."""
        if self._inflight is None:
            return
        future, batch = self._inflight
        self._inflight = None
        try:
            counts = await future
        except Exception:
            self._put_back(batch)
            return
        self._landed(batch, counts)

    def _failed_write(self, exc: StoreError) -> None:
        self._flush_failures += 1
        self._write_error = exc
        log.warning(
            "writing %d result(s) failed (%d time(s) in a row; the run stops after %d): %s",
            len(self._pending),
            self._flush_failures,
            FLUSH_ATTEMPTS,
            exc,
        )

    async def _try_flush_off_loop(self) -> bool:
        try:
            await self._flush_off_loop()
        except StoreError as exc:
            self._failed_write(exc)
            return False
        self._flush_failures, self._write_error = 0, None
        return True

    def _try_flush(self) -> bool:
        try:
            self._flush()
        except StoreError as exc:
            self._failed_write(exc)
            return False
        self._flush_failures, self._write_error = 0, None
        return True

    def _flush_backoff(self) -> float:
        return backoff_delay(self._flush_failures, base=FLUSH_BACKOFF_BASE, cap=FLUSH_BACKOFF_CAP)

    async def _flush_loop(self) -> None:
        assert self._flush_now is not None
        delay = FLUSH_SECONDS
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), delay)
            self._flush_now.clear()
            if await self._try_flush_off_loop():
                delay = FLUSH_SECONDS
            elif self._flush_failures >= FLUSH_ATTEMPTS:
                self._gave_up = self._write_error
                self.stop()  # results cannot be stored: stop computing more
                return
            else:
                delay = self._flush_backoff()

    def _drain(self) -> StoreError | None:
        """The last write of the run, retried like the others; the error if it gave up."""
        while not self._try_flush():
            if self._flush_failures >= FLUSH_ATTEMPTS:
                return self._write_error
            time.sleep(self._flush_backoff())
        return None

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.options.lease_seconds / 3, 0.05))
            await asyncio.to_thread(
                work_queue.heartbeat,
                self.store,
                self.worker,
                lease_seconds=self.options.lease_seconds,
                scored=self.report.scored,
                failed=self.report.failed,
            )


@dataclass
class _Batch:
    """Results taken from the pending list for one write."""

    results: list[work_queue.StepResult]
    floors: list[tuple[int, int]]
    tokens: int


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
