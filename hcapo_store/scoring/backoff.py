"""Exponential backoff with full jitter, shared by request retries, claims, writes and heartbeats."""

from __future__ import annotations

import random


def backoff_delay(attempt: int, *, base: float = 0.5, cap: float = 30.0, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; a server's Retry-After wins (bounded by cap)."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), cap)
    return random.uniform(0, min(cap, base * 2 ** max(attempt - 1, 0)))
