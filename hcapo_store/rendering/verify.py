"""Every fast strategy held to its rule at run time, in one frame (docs/ARCHITECTURE.md).

The stored logprob is the one the plain rule defines (prompt_rule.py, ``place_by_rule``,
``backend.encode``, ``apply_chat_template``). Each shortcut beside a rule is a
:class:`Strategy` here: it names the rule it stands in for and when it is checked against
it (its policy: the first uses of each process or episode, then a sample). A disagreement is
handled the same way for all of them: the strategy is switched off (for the episode, or for
the rest of the process), the rule's result is what is stored, and the fallback is counted
(:func:`fallbacks`, the run's ``ScoreReport.strategy_fallbacks`` and ``score --json``'s
``"strategy_fallbacks"``) and logged once per strategy.

``HCAPO_RENDERING=reference`` in the environment runs the rules only (:func:`reference_mode`):
slower, the same stored numbers.

The checks sample; they do not prove. What is tested beyond them: tests/test_differential.py
(property-based sessions against the rules), tests/test_verify.py (a strategy patched to be
wrong is caught, counted, and the rule's prompt stored).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

RENDERING_ENV = "HCAPO_RENDERING"
RENDERING_MODES = ("fast", "reference")


def reference_mode() -> bool:
    """Whether this process runs the rules only (``HCAPO_RENDERING=reference``); read at each
    builder's creation, so a test may set it for one builder."""
    mode = os.environ.get(RENDERING_ENV, "").strip().lower() or "fast"
    if mode not in RENDERING_MODES:
        raise ValueError(f"{RENDERING_ENV} must be one of {RENDERING_MODES}, got {mode!r}")
    return mode == "reference"


@dataclass(frozen=True)
class Strategy:
    """A shortcut beside a rule: what it is held to, when, and what a disagreement turns off."""

    name: str
    rule: str  # what it must equal
    policy: str  # when it is checked, in words
    scope: Literal["episode", "process"]  # what one disagreement switches off
    first: int = 0  # the first uses checked (per process)
    every: int = 0  # then the last use of every ``every`` (0: none)


ASCII_BPE = Strategy(
    "ascii_bpe",
    "backend.encode (the tokenizers library's own pipeline)",
    "the first 64 pieces of each process, then one piece in 512",
    "process",
    first=64,
    every=512,
)
TEMPLATE_SANDBOX = Strategy(
    "template_sandbox",
    "tokenizer.apply_chat_template",
    "the first render of each tokenizer's template (and again when its special tokens change)",
    "process",
)
BOUNDED_RENDERS = Strategy(
    "bounded_renders",
    "the step's whole-history render (prompt_rule.whole_history)",
    "the last step of every chain, and from the episode's last step halving back to its first",
    "episode",
)
TURN_WINDOWS = Strategy(
    "turn_windows",
    "prompt_rule.whole_turns (every window scanned from the earliest start)",
    "the step where a session first crosses the budget, then one windowed step in 16",
    "episode",
    every=16,
)
PLACEMENT = Strategy(
    "placement",
    "placement.place_by_rule (one render per step, apply_chat_template, tokenizer offsets)",
    "one step (the middle one) of one episode in 128 (the 128th of the process, the 256th, ...)",
    "episode",
    # one check costs ~3 episodes' preparation (a 25k-token episode): one in 64 was ~5 % of the
    # preparation's CPU per step on the budget shape, one in 128 is ~2.5 % (bench/verify_cost.py)
    every=128,
)
CUDA_GRAPHS = Strategy(
    "cuda_graphs",
    "the model's own eager forward (its own causal mask) on the same right-padded inputs",
    "each shape's capture (its first replay against the eager forward before it), then the first 2"
    " replays on new inputs and one in 64 after (scoring/graphs.py)",
    "process",
    first=2,
    every=64,
)
# A hand-off row of a GRPO group hits ~100 kept renders and ~100 kept pieces (99 steps); a check
# costs a render (a piece: five renders of its whole history, ~17 ms here). One in 256 of each cost
# ~30 % of such a row's CPU (bench/group_alignment.py); these rates ~4 %.
KEPT_RENDERS = Strategy(
    "kept_renders",
    "the chat template's render now",
    "the first 4 hits of each process, then one hit in 1024 (rendering/kept_renders.py)",
    "process",
    first=4,
    every=1024,
)
KEPT_PIECES = Strategy(
    "kept_pieces",
    "the turn's piece of a ``turns`` alignment made now on its whole history",
    "the first 2 hits of each process, then one hit in 4096 (rendering/alignment.py)",
    "process",
    first=2,
    every=4096,
)
WINDOWED_TURNS = Strategy(
    "windowed_turns",
    "the ``turns`` piece made on the turn's whole history (alignment.EpisodeRenderer._turn_piece)",
    "the first and the last piece an episode makes on a window, and halving back from the last",
    "episode",
)
EDITED_RENDERS = Strategy(
    "edited_renders",
    "the step's window rendered whole (prompt_rule.render_pair; --action-span policy: and with its action an empty turn)",
    "the first edited step of an episode and the last of every line of edits (rendering/step_edits.py)",
    "episode",
)
TOKENIZER_CLASS = Strategy(
    "tokenizer_class",
    "AutoTokenizer.from_pretrained (transformers' own choice of class for the directory)",
    "every load: the loaded tokenizer's digest against that of AutoTokenizer's load of the same files"
    " in the parent process, or in an earlier process that recorded it (rendering/tokenizers.py"
    " ``load_as``, rendering/tokenizer_memo.py)",
    "process",
)
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        ASCII_BPE,
        TEMPLATE_SANDBOX,
        BOUNDED_RENDERS,
        TURN_WINDOWS,
        PLACEMENT,
        CUDA_GRAPHS,
        KEPT_RENDERS,
        KEPT_PIECES,
        WINDOWED_TURNS,
        EDITED_RENDERS,
        TOKENIZER_CLASS,
    )
}


@dataclass(frozen=True)
class Checks:
    """Whether a builder's strategies are held to their rules at run time: :data:`CHECKED`
    (every strategy's policy above; the default of every builder) or :data:`UNCHECKED` (no
    check: the strategies' results are used on trust). UNCHECKED exists to measure what the
    checks cost against the same process without them (bench/verify_cost.py); nothing that
    stores a score uses it. The sandbox's one check of each template's first render is per
    process, outside any builder, and not switched by it."""

    on: bool = True

    def due(self, strategy: Strategy) -> bool:
        """Whether this use of ``strategy`` is checked (counted only when checks are on)."""
        return self.on and due(strategy)

    def sampled(self, strategy: Strategy, n: int) -> list[int]:
        """Which of the next ``n`` uses of ``strategy`` are checked (counted only when checks are on)."""
        return sampled(strategy, n) if self.on else []


CHECKED = Checks(on=True)
UNCHECKED = Checks(on=False)

_lock = threading.Lock()
_uses: dict[str, Iterator[int]] = {}  # each strategy's uses, counted (next() on a count is atomic)
_fallbacks: Counter[str] = Counter()
_logged: set[str] = set()


def due(strategy: Strategy) -> bool:
    """Whether this use of ``strategy`` is one its policy checks (counts the use)."""
    n = next(_counter(strategy))
    return n < strategy.first or (strategy.every > 0 and (n - strategy.first + 1) % strategy.every == 0)


def sampled(strategy: Strategy, n: int) -> list[int]:
    """The positions among the next ``n`` uses of ``strategy`` that :func:`due` would check, the
    ``n`` uses counted at once (one call for a batch of pieces, not one per piece: the per-piece
    calls were about 1 % of the preparation's CPU on the budget shape, bench/verify_cost.py)."""
    if n <= 0:
        return []
    uses = _counter(strategy)
    start = next(uses)
    if n > 1:
        deque(itertools.islice(uses, n - 1), maxlen=0)  # the other n - 1 uses, at C speed
    checked = list(range(min(n, max(0, strategy.first - start))))
    if strategy.every > 0:
        low = max(strategy.first - start, 0)  # the first position past the first uses
        residue = (strategy.first - 1 - start) % strategy.every
        checked += range(low + (residue - low) % strategy.every, n, strategy.every)
    return checked


def _counter(strategy: Strategy) -> Iterator[int]:
    try:
        return _uses[strategy.name]
    except KeyError:
        with _lock:
            return _uses.setdefault(strategy.name, itertools.count())


def disagreed(strategy: Strategy, detail: str) -> None:
    """Count one fallback to ``strategy``'s rule (the caller stores the rule's result and
    switches the strategy off for its scope); the first of each strategy is logged."""
    with _lock:
        _fallbacks[strategy.name] += 1
        first = strategy.name not in _logged
        _logged.add(strategy.name)
    if first:
        log.warning(
            "%s disagreed with its rule (%s): %s; switched off for the %s, the rule's result stored",
            strategy.name,
            strategy.rule,
            detail,
            strategy.scope,
        )


def fallbacks() -> dict[str, int]:
    """The fallbacks counted in this process so far, by strategy."""
    with _lock:
        return {k: v for k, v in _fallbacks.items() if v}


def since(before: dict[str, int]) -> dict[str, int]:
    """The fallbacks counted since ``before`` (a :func:`fallbacks` snapshot)."""
    now = fallbacks()
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
