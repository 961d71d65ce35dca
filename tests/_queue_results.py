"""Queue results the work-queue tests write by hand (no scoring run): a step scored with a
minimal, valid score row."""

from __future__ import annotations

from hcapo_store.scoring import work_queue


def done_result(lease: work_queue.Lease) -> work_queue.StepResult:
    """``lease``'s step stored as scored: one token, logprob 0."""
    row = {
        "token_logprobs": b"\0\0\0\0",
        "token_count": 1,
        "mean_logprob": 0.0,
        "total_action_tokens": 1,
        "skipped_action_tokens": 0,
        "truncated_prefix_tokens": 0,
        "input_tokens": 2,
        "logprob_start_len": 0,
        "flattened": False,
        "prompt_tokens": 2,
        "cached_tokens": None,
        "latency_s": 0.0,
        "server_model": "m",
        "created_at": "2026-01-01T00:00:00",
    }
    return work_queue.StepResult(lease.attempt_id, lease.step_id, score_row=row)
