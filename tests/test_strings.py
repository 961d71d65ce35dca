"""rendering/strings.py's block comparisons equal the plain character loop, on every pair of a
random corpus built to differ at every distance from the start and the end (and not at all)."""

from __future__ import annotations

import random

from hcapo_store.rendering.strings import BLOCK, common_prefix, common_suffix


def plain_prefix(a: str, b: str, i: int = 0, j: int = 0, cap: int | None = None) -> int:
    n = 0
    while (cap is None or n < cap) and i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
        n += 1
    return n


def plain_suffix(a: str, b: str, limit: int | None = None) -> int:
    n = 0
    while (limit is None or n < limit) and n < len(a) and n < len(b) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _pairs() -> list[tuple[str, str]]:
    rng = random.Random(7)
    base = "".join(rng.choice("ab<|>é\n") for _ in range(3 * BLOCK + 17))
    pairs = [("", ""), ("", "x"), (base, base), (base, base[:-1]), (base[1:], base)]
    # One change at every distance (a prefix or suffix ending inside every block size), and
    # texts of different lengths that share a prefix or a suffix.
    for at in [*range(0, 40), *range(BLOCK - 3, BLOCK + 3), *range(2 * BLOCK - 2, 2 * BLOCK + 2), len(base) - 1]:
        changed = base[:at] + ("Z" if base[at] != "Z" else "Y") + base[at + 1 :]
        pairs += [(base, changed), (changed, base), (base, base[:at]), (base[at:], base)]
    return pairs


def test_common_prefix_equals_the_character_loop():
    for a, b in _pairs():
        assert common_prefix(a, b) == plain_prefix(a, b), (len(a), len(b))
        for i, j, cap in [(1, 1, None), (3, 0, 64), (0, 5, 1), (10, 10, 0), (len(a), 0, 8), (2, 2, 10_000)]:
            assert common_prefix(a, b, i, j, cap) == plain_prefix(a, b, i, j, cap), (len(a), len(b), i, j, cap)


def test_common_suffix_equals_the_character_loop():
    for a, b in _pairs():
        assert common_suffix(a, b) == plain_suffix(a, b), (len(a), len(b))
        for limit in (0, 1, 7, BLOCK, 10_000):
            assert common_suffix(a, b, limit) == plain_suffix(a, b, limit), (len(a), len(b), limit)
