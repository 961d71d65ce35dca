"""What a scoring run produces besides the scores: the run's report, and the stored row of
one step's result with its share of the request it rode in."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hcapo_store.clock import utcnow
from hcapo_store.rendering.requests import GroupPrompt, StepPrompt
from hcapo_store.scoring.backends.base import BackendScore
from hcapo_store.scoring.work_queue import TOPK_KEY

FIRST_ERRORS = 5  # distinct final errors kept in the report, to print


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
    # fast rendering strategies that disagreed with their rule during the run, by strategy:
    # the rule's prompts were stored (rendering/verify.py)
    strategy_fallbacks: dict[str, int] = field(default_factory=dict)

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
        if self.strategy_fallbacks:
            line += f"; {fallback_text(self.strategy_fallbacks)}"
        return line

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("failure_kinds", "first_errors")}
        d["failure_kinds"] = dict(self.failure_kinds)
        d["first_errors"] = [{"kind": k, "message": m} for k, m in self.first_errors]
        d["strategy_fallbacks"] = dict(self.strategy_fallbacks)
        return d

    def error_lines(self, width: int = 300) -> list[str]:
        """The first distinct final errors, one line each (``kind: message``)."""
        lines = []
        for kind, message in self.first_errors:
            text = " ".join(message.split())
            text = text if text.startswith(f"{kind}:") else f"{kind}: {text}"
            lines.append(text if len(text) <= width else text[: width - 1] + "…")
        return lines


def fallback_text(fallbacks: dict[str, int]) -> str:
    """``strategy fallbacks: none`` or each strategy's count (the rule's prompts stored)."""
    if not fallbacks:
        return "strategy fallbacks: none"
    counts = ", ".join(f"{name} {n}" for name, n in sorted(fallbacks.items()))
    return f"strategy fallbacks (the rule's prompts stored): {counts}"


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
        **({} if result.top is None else {TOPK_KEY: topk_row(result.top, values.size)}),
    }


def topk_row(top: list[list[tuple[int, float]]], n: int) -> dict[str, Any]:
    """The ``topk_scores`` columns of one step's top-k rows (storage/topk.py)."""
    from hcapo_store.storage.topk import TopK

    k = len(top[0]) if top else 0
    ids, logprobs = TopK.of(top, k).encode()
    return {"k": k, "token_count": n, "ids": ids, "logprobs": logprobs}


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
