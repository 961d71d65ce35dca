"""Resumable scoring: claim episodes under a lease, build prompts, request, verify, commit.

- ``concurrency`` episodes are in flight at once; the steps of one episode go in order,
  consecutive steps whose prompts are exact prefixes of one another in one request
  (``grouping.py``; ``RunOptions.grouping = "per-step"`` sends one request per step).
- Results are written by one writer in short transactions (a batch every
  ``FLUSH_SECONDS`` or ``FLUSH_RESULTS``); a score is durable once it is counted.
- Every failed attempt is recorded; retryable failures are retried with bounded,
  jittered backoff (honouring Retry-After); after ``max_attempts`` the step is failed.
- Stopping (Ctrl-C or ``stop()``) stops claiming, lets in-flight requests finish,
  commits, and gives unstarted leased steps back to the queue.
"""

from __future__ import annotations

import asyncio
import random
import gc
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hcapo_store.storage import db
from hcapo_store.scoring import work_queue
from hcapo_store.scoring.backends.base import Backend, BackendScore
from hcapo_store.clock import utcnow
from hcapo_store.storage.episodes import load_episode
from hcapo_store.errors import InferenceError
from hcapo_store.scoring.grouping import GroupPrompt, Grouping, group_prompts
from hcapo_store.scoring.prompts import PromptBuilder, PromptFailure, StepPrompt
from hcapo_store.storage.store import Store

FLUSH_SECONDS = 0.2
FLUSH_RESULTS = 256


def backoff_delay(attempt: int, *, base: float = 0.5, cap: float = 30.0, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; a server's Retry-After wins (bounded by cap)."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), cap)
    return random.uniform(0, min(cap, base * 2 ** max(attempt - 1, 0)))


@dataclass(frozen=True)
class RunOptions:
    """How one ``score`` process runs: concurrency, retries, leases, filters, limit."""

    concurrency: int = 4
    max_attempts: int = 4
    lease_seconds: float = 120.0
    filters: work_queue.Filters = work_queue.Filters()
    limit: int | None = None
    worker_id: str | None = None
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    grouping: Grouping = "grouped"  # steps whose prompts are exact prefixes share one request


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
    failure_kinds: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        rate = self.scored / self.elapsed_s if self.elapsed_s else 0.0
        kinds = ", ".join(f"{k} {n}" for k, n in self.failure_kinds.most_common())
        line = (f"scored {self.scored}, failed {self.failed}, retried {self.retried} attempt(s)"
                f"{f' [{kinds}]' if kinds else ''}; {self.prompt_tokens} prompt tokens; "
                f"{self.elapsed_s:.1f}s ({rate:.1f} steps/s)")
        if self.discarded:
            line += f"; {self.discarded} late result(s) discarded"
        if self.interrupted:
            line += f" — interrupted, {self.released} leased step(s) returned to the queue"
        return line

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "failure_kinds"}
        d["failure_kinds"] = dict(self.failure_kinds)
        return d


def score_row(prompt: StepPrompt, result: BackendScore) -> dict[str, Any]:
    values = np.asarray(result.logprobs, dtype="<f4")
    # The mean is taken over the stored float32 values, so it can be recomputed from the blob.
    return {
        "token_logprobs": values.tobytes(), "token_count": int(values.size),
        "mean_logprob": float(values.astype(np.float64).mean()),
        "total_action_tokens": prompt.total_action_tokens, "skipped_action_tokens": prompt.skipped_action_tokens,
        "truncated_prefix_tokens": prompt.truncated_prefix_tokens, "input_tokens": len(prompt.input_ids),
        "logprob_start_len": prompt.first_scored - 1, "flattened": prompt.flattened,
        "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens, "latency_s": result.latency_s,
        "server_model": result.model_id, "created_at": utcnow().isoformat(timespec="seconds"),
    }


class Scheduler:
    def __init__(self, store: Store, scorer_id: str, backend: Backend, builder: PromptBuilder,
                 options: RunOptions = RunOptions(),
                 on_progress: Callable[[ScoreReport], None] | None = None) -> None:
        self.store, self.scorer_id, self.backend, self.builder = store, scorer_id, backend, builder
        self.options = options
        self.worker = options.worker_id or work_queue.default_worker_id()
        self.on_progress = on_progress
        self.report = ScoreReport(scorer_id=scorer_id, worker_id=self.worker)
        self._pending: list[work_queue.StepResult] = []
        self._pending_tokens = 0
        self._stopping = threading.Event()
        self._claimed = 0
        self._build_lock = threading.Lock()  # the PromptBuilder's token caches are not thread-safe

    def stop(self) -> None:
        """Stop claiming; in-flight requests finish; the rest is released."""
        self._stopping.set()

    # -- main loop -------------------------------------------------------------

    async def run(self) -> ScoreReport:
        # Each response allocates thousands of small lists; with a large heap (transformers,
        # tokenizer) the cyclic GC's full collections then cost more than the bookkeeping
        # itself. Objects alive now (modules, tokenizer, caches) are exempted for the run.
        gc.collect()
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
        installed = _install_sigint(loop, self.stop)
        flusher = asyncio.create_task(self._flush_loop())
        beats = asyncio.create_task(self._heartbeat_loop())
        state = "finished"
        try:
            await asyncio.gather(*(self._episode_worker() for _ in range(max(self.options.concurrency, 1))))
        except BaseException:
            state = "crashed"
            raise
        finally:
            flusher.cancel()
            beats.cancel()
            self._flush()
            if installed:
                loop.remove_signal_handler(signal.SIGINT)
            self.report.interrupted = self._stopping.is_set()
            self.report.released = work_queue.finish_worker(
                self.store, self.worker, "stopped" if self.report.interrupted else state,
                scored=self.report.scored, failed=self.report.failed)
            self.report.elapsed_s = time.monotonic() - started
        return self.report

    async def _episode_worker(self) -> None:
        while not self._stopping.is_set():
            remaining = None if self.options.limit is None else self.options.limit - self._claimed
            if remaining is not None and remaining <= 0:
                return
            # Reserve before the (awaited) claim so that concurrent workers cannot all
            # claim the same remaining budget; give back what the claim did not use.
            self._claimed += remaining or 0
            claim = await asyncio.to_thread(
                work_queue.claim, self.store, self.scorer_id, self.worker, lease_seconds=self.options.lease_seconds,
                filters=self.options.filters, max_steps=remaining)
            self._claimed += (len(claim.leases) if claim is not None else 0) - (remaining or 0)
            if claim is None:
                return
            await self._score_episode(claim)

    async def _score_episode(self, claim: work_queue.Claim) -> None:
        prompts = await asyncio.to_thread(self._prompts_for, claim)
        leases = {lease.step_index: lease for lease in claim.leases}
        requests = group_prompts([prompts[lease.step_index] for lease in claim.leases],
                                 grouping=self.options.grouping, max_tokens=self.builder.max_context)
        for request in requests:
            if self._stopping.is_set():
                return  # unstarted leases are released at the end
            if isinstance(request, PromptFailure):
                lease = leases[request.step_index]
                self._record(work_queue.StepResult(lease.attempt_id, lease.step_id, error_kind=request.reason,
                                           error=request.message, final=True))
                continue
            await self._score_request([leases[m.step_index] for m in request.members], request)

    def _prompts_for(self, claim: work_queue.Claim) -> dict[int, StepPrompt | PromptFailure]:
        with self.store.engine.connect() as conn:
            episode = load_episode(conn, claim.episode_id)
        wanted = {lease.step_index for lease in claim.leases}
        steps = [s for s in episode.steps if s.step_index in wanted]
        with self._build_lock:
            built = self.builder.build_episode(episode.messages, episode.outcome, steps)
        return {p.step_index: p for p in built}

    async def _request(self, group: GroupPrompt) -> list[BackendScore]:
        """One request for the group (a lone step goes through ``score`` exactly as before)."""
        if len(group.members) == 1:
            results = [await self.backend.score(group.members[0])]
        else:
            results = await self.backend.score_group(group)
        for prompt, result in zip(group.members, results, strict=True):
            if len(result.logprobs) != prompt.scored_tokens:
                raise InferenceError("mismatch", f"backend returned {len(result.logprobs)} logprobs for "
                                     f"{prompt.scored_tokens} scored tokens", retryable=False)
        return results

    async def _score_request(self, leases: list[work_queue.Lease], group: GroupPrompt) -> None:
        """Score one request's steps; every attempt's outcome is recorded for each of them."""
        attempt = max(lease.attempt_count for lease in leases)
        while True:
            attempt += 1
            try:
                results = await self._request(group)
            except InferenceError as exc:
                final = not exc.retryable or attempt >= self.options.max_attempts
                for lease in leases:
                    self._record(work_queue.StepResult(lease.attempt_id, lease.step_id, error_kind=exc.kind,
                                                       error=str(exc)[:2000], final=final))
                if final or self._stopping.is_set():
                    return
                self.report.retried += len(leases)
                await asyncio.sleep(backoff_delay(attempt, base=self.options.backoff_base,
                                                  cap=self.options.backoff_cap, retry_after=exc.retry_after))
                continue
            for lease, prompt, result in zip(leases, group.members, results):
                self._record(work_queue.StepResult(lease.attempt_id, lease.step_id,
                                                   score_row=score_row(prompt, result)))
            self._pending_tokens += len(group.input_ids)
            return

    # -- the single writer -------------------------------------------------------

    def _record(self, outcome: work_queue.StepResult) -> None:
        if outcome.error_kind is not None and outcome.final:
            self.report.failure_kinds[outcome.error_kind] += 1
        self._pending.append(outcome)
        if len(self._pending) >= FLUSH_RESULTS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        tokens, self._pending_tokens = self._pending_tokens, 0
        with db.write(self.store.engine) as conn:
            scored, failed, discarded = work_queue.write_results(conn, self.scorer_id, self.worker, batch)
        self.report.scored += scored
        self.report.failed += failed
        self.report.discarded += discarded
        self.report.prompt_tokens += tokens
        if self.on_progress is not None:
            self.on_progress(self.report)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            self._flush()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.options.lease_seconds / 3, 0.05))
            await asyncio.to_thread(work_queue.heartbeat, self.store, self.worker, lease_seconds=self.options.lease_seconds,
                                    scored=self.report.scored, failed=self.report.failed)


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
