"""How far two texts agree, from the start or from the end, compared in C rather than a
character at a time: renderings of one turn share thousands of characters with their
empty-turn twin, and a Python loop over them was a tenth of an episode's preparation.

Slices are compared a block at a time until one differs, then that block is halved until
the first different character is found: O(n) character comparisons done by ``str.__eq__``,
plus O(log block) slices. tests/test_strings.py holds these to the plain loop.
"""

from __future__ import annotations

BLOCK = 256


def common_prefix(a: str, b: str, i: int = 0, j: int = 0, cap: int | None = None) -> int:
    """How many characters ``a[i:]`` and ``b[j:]`` share at their start (at most ``cap``)."""
    n = min(len(a) - i, len(b) - j)
    if cap is not None:
        n = min(n, cap)
    if n <= 0:
        return 0
    k, block = 0, BLOCK
    while k < n:
        step = min(block, n - k)
        if a[i + k : i + k + step] == b[j + k : j + k + step]:
            k += step
            block *= 2  # long agreements (the usual case) in few slices
            continue
        if step == 1:
            return k
        block = step // 2  # the first difference is within this block: narrow down
    return n


def common_suffix(a: str, b: str, limit: int | None = None) -> int:
    """How many characters ``a`` and ``b`` share at their end (at most ``limit``)."""
    n = min(len(a), len(b))
    if limit is not None:
        n = min(n, limit)
    if n <= 0:
        return 0
    k, block = 0, BLOCK
    la, lb = len(a), len(b)
    while k < n:
        step = min(block, n - k)
        if a[la - k - step : la - k] == b[lb - k - step : lb - k]:
            k += step
            block *= 2
            continue
        if step == 1:
            return k
        block = step // 2
    return n
