"""Long ``sliding``/``window`` sessions fast: bounded renders standing for whole histories.

The rule (prompt_rule.whole_history) renders a step's whole history, so preparing a session
grows with the square of its length. Once a step's rendered history passes BOUND_START x
max_context ids, later steps of its **chain** render the head (through the first user
message, the hindsight block in the first) and the messages from the chain's start on. The
ids the whole history has between them (``hidden``) were counted once, when the chain moved
there, as the difference of two renders of one step; a prompt's tail is cut from the window
at the whole history's offset, so its ids are the whole history's without rendering it.

A chain never reaches across one of the session's own user turns (a template may render
earlier turns anew after one: Qwen3 drops the reasoning of the turns before the last user
query), so a session has one chain per stretch between user turns.

Nothing built here is trusted: :func:`checked_positions` names the steps the prompt builder
rebuilds on their whole history after the episode (the last step of **every** chain, where
a count gone wrong shows, and halving back from the episode's last), and any difference
sends the whole episode back to whole-history builds, counted as a fallback of
``bounded_renders`` (verify.py). The other steps are not checked one by one: they are held
equal to the rule by tests (tests/test_bounded_history.py, tests/test_differential.py), which
sample sessions; nothing proves them equal.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hcapo_store.rendering.hindsight import inject_hindsight
from hcapo_store.rendering.messages import flatten_messages, own_text
from hcapo_store.rendering.prompt_rule import Pair, Render, RenderedStep, head_end_of, whole_pair, window_starts
from hcapo_store.rendering.segments import RenderState, SegmentEncoder
from hcapo_store.rendering.template import TemplateRejected

# Once a step's rendered history passes BOUND_START x max_context ids, later steps render the
# head and the messages from a later start on, about BOUND_TARGET x max_context ids of them,
# moved on again whenever a window passes BOUND_ADVANCE x max_context (BoundedRenders.advance).
# The first bound is higher: below it a window saves less than checking it costs.
BOUND_START = 1.6
BOUND_ADVANCE = 1.35
BOUND_TARGET = 1.1


class NeedWhole(Exception):
    """A bounded render cannot give this step's prompt (it fits whole, or its tail reaches
    back past the window): render the step's whole history instead."""


@dataclass
class Chain:
    """Steps render the head and the messages from ``start`` on; the ids the whole history has
    between them were counted once, when the chain moved there (BoundedRenders.advance)."""

    start: int  # a window's first message after the head (the head's end: the whole history)
    hidden: int  # ids of messages[head_end:start] in the whole history's render
    last: int  # the message index of the last step rendered on this chain
    number: int = 0  # which chain of the episode (for the check: its last step is rebuilt whole)


@dataclass
class BoundedStep:
    """What a step rendered on a chain needs after its ids are known, to move the chain on."""

    messages: Sequence[dict]
    head_end: int
    m: int
    hindsight: str | None
    flattened: bool
    chain: Chain


def checked_positions(chains: Sequence[int]) -> list[int]:
    """Which of an episode's bounded steps are rebuilt on their whole history, given each
    bounded step's chain number in build order: the last step of every chain (a count that
    went wrong stays wrong for the rest of its chain, so its last step shows it), and the
    episode's last halving back to its first. Descending: the latest first."""
    picks: set[int] = set()
    n = len(chains) - 1
    while n > 0:
        picks.add(n)
        n //= 2
    if chains:
        picks.add(0)
    last_of: dict[int, int] = {}
    for position, number in enumerate(chains):
        last_of[number] = position
    picks.update(last_of.values())
    return sorted(picks, reverse=True)


@dataclass
class _Memo:
    """What one episode's bounded renders remember."""

    on: bool = False  # False: every step renders its whole history
    unbounded: str | None = None  # why bounded renders stopped in this episode
    flat: list[dict] | None = None
    chains: dict[bool, Chain] = field(default_factory=dict)  # the current chain, by flattened
    made: int = 0  # chains started so far
    heads: dict[tuple[str | None, bool], str] = field(default_factory=dict)  # the head's render
    # per window start: the window render's text up to where a tail may start, and its ids
    visible: dict[tuple[str | None, bool, int], tuple[str, int]] = field(default_factory=dict)
    breaks: list[int] | None = None  # see BoundedRenders._breaks
    sizes: dict[bool, tuple[list[int], list[int]]] = field(default_factory=dict)  # see BoundedRenders._sizes


class BoundedRenders:
    """The bounded renders of one episode's steps at a time (``start_episode``)."""

    def __init__(self, render: Render, encoder: SegmentEncoder, max_context: int, pair: Pair | None = None) -> None:
        self._render = render
        # a step's two renders of its window: whole (the rule), or edited from the previous
        # step's (step_edits.py)
        self._pair: Pair = pair or whole_pair(render)
        self.encoder = encoder
        self.max_context = max_context
        self._probe_state: RenderState = encoder.new_state()
        self._memo = _Memo()

    def start_episode(self, on: bool) -> None:
        self._memo = _Memo(on=on)

    @property
    def on(self) -> bool:
        return self._memo.on

    @property
    def unbounded(self) -> str | None:
        return self._memo.unbounded

    def stop(self, reason: str) -> None:
        self._memo.on, self._memo.unbounded = False, reason

    def render(
        self, raw: Sequence[Mapping[str, Any]], normalized: Sequence[dict], m: int, hindsight: str | None
    ) -> RenderedStep:
        """Step ``m`` on its chain; flattened when the template rejects the messages."""
        try:
            return self._on_chain(raw, normalized, m, hindsight, False)
        except TemplateRejected:
            if self._memo.flat is None:
                self._memo.flat = flatten_messages(raw)
            return self._on_chain(raw, self._memo.flat, m, hindsight, True)

    def _breaks(self, raw: Sequence[Mapping[str, Any]]) -> list[int]:
        """``breaks[i]``: how many of ``raw[:i]`` are neither assistant turns nor tool results
        (as given: a flattened tool result is still one). A chain never reaches across one."""
        memo = self._memo
        if memo.breaks is None:
            memo.breaks = [0]
            for message in raw:
                memo.breaks.append(memo.breaks[-1] + (message.get("role") not in ("assistant", "tool")))
        return memo.breaks

    def _sizes(self, messages: Sequence[dict], flattened: bool, head_end: int) -> tuple[list[int], list[int]]:
        """The messages a window may start at (after the head, never a tool result) and the
        cumulative characters of the messages' own words: what window starts are guessed from."""
        memo = self._memo
        if flattened not in memo.sizes:
            chars = [0]
            for message in messages:
                chars.append(chars[-1] + len(own_text(message)))
            memo.sizes[flattened] = (window_starts(messages, head_end), chars)
        return memo.sizes[flattened]

    def _head_text(self, head: list[dict], hindsight: str | None, flattened: bool) -> str:
        key = (hindsight, flattened)
        if key not in self._memo.heads:
            self._memo.heads[key] = self._render(head, generation=False)
        return self._memo.heads[key]

    def _visible_from(self, text: str, head: list[dict], hindsight: str | None, flattened: bool, start: int) -> int:
        """How many of the window render's ids precede the first one a tail may start at: past
        the head's render and one added token clear of it, so from there on the window's ids
        are the whole history's (segments.py: settled_cut). Raises NeedWhole when the window
        render does not begin with the head's own render (a template that renders the head
        according to what follows it: nothing can be counted then)."""
        memo = self._memo
        key = (hindsight, flattened, start)
        known = memo.visible.get(key)
        if known is not None and text.startswith(known[0]):
            return known[1]
        head_text = self._head_text(head, hindsight, flattened)
        cut = self.encoder.settled_cut(text, len(head_text)) if text.startswith(head_text) else None
        if cut is None:
            self.stop("the template renders the first messages differently when turns are left out")
            raise NeedWhole
        memo.visible[key] = (text[:cut], len(self.encoder.encode_once(text[:cut])))
        return memo.visible[key][1]

    def _on_chain(
        self, raw: Sequence[Mapping[str, Any]], messages: Sequence[dict], m: int, hindsight: str | None, flattened: bool
    ) -> RenderedStep:
        """Step ``m`` on its chain: the whole history while the chain starts at the head's end,
        else the head and the messages from the chain's start to the action, the ids between
        them the chain's ``hidden`` count. A step after a user turn (or the first of a build,
        or one before the chain's last) starts a new chain from the head's end."""
        memo = self._memo
        breaks = self._breaks(raw)
        head_end = head_end_of(messages)
        chain = memo.chains.get(flattened)
        if chain is None or not chain.last < m or not chain.start < m or breaks[m] != breaks[chain.last]:
            chain = memo.chains[flattened] = Chain(head_end, 0, m, memo.made)
            memo.made += 1
        chain.last = m
        step = BoundedStep(messages, head_end, m, hindsight, flattened, chain)
        if chain.start <= head_end:
            rendered = self._pair(inject_hindsight(messages[: m + 1], hindsight), head_end, flattened)
        else:
            head = inject_hindsight(messages[:head_end], hindsight)
            rendered = self._pair([*head, *messages[chain.start : m + 1]], head_end, flattened)
            rendered.visible_from = self._visible_from(rendered.prefix_text, head, hindsight, flattened, chain.start)
            rendered.hidden = chain.hidden
        rendered.bounded = step
        return rendered

    def advance(self, step: BoundedStep, prefix_len: int) -> None:
        """Move the chain of a step whose prefix passed BOUND_START (a whole history) or
        BOUND_ADVANCE (a window) x max_context ids to the latest start that leaves about
        BOUND_TARGET x max_context ids of messages (guessed from their characters, then
        rendered: at least max_context ids must follow the head, so any tail fits). The ids
        between the old start and the new one are this step's two renders' difference: the
        whole history's length stays known."""
        memo, chain, m = self._memo, step.chain, step.m
        bound = BOUND_START if chain.start <= step.head_end else BOUND_ADVANCE
        if not memo.on or prefix_len <= bound * self.max_context:
            return
        starts, chars = self._sizes(step.messages, step.flattened, step.head_end)
        lo = bisect.bisect_right(starts, chain.start)
        hi = bisect.bisect_left(starts, m)  # a start before the action: a window is never empty
        if lo >= hi:
            return
        # Guessed from the messages' own characters, at this window's ids per character; the
        # guess only picks the first window tried, which is then rendered and counted.
        per_char = prefix_len / max(chars[m] - chars[chain.start], 1)

        def guess(k: int) -> float:
            return (chars[m] - chars[starts[k]]) * per_char

        target = BOUND_TARGET * self.max_context
        k, top = lo, hi - 1  # the latest k whose guess reaches the target (guesses fall with k)
        while k < top:
            mid = (k + top + 1) // 2
            k, top = (mid, top) if guess(mid) >= target else (k, mid - 1)
        head = inject_hindsight(step.messages[: step.head_end], step.hindsight)
        for _ in range(4):
            start = starts[k]
            try:
                text = self._render([*head, *step.messages[start:m]], generation=True)
                visible = self._visible_from(text, head, step.hindsight, step.flattened, start)
            except (TemplateRejected, NeedWhole):
                return
            ids = len(self.encoder.encode(text, self._probe_state))
            if ids - visible >= self.max_context:
                chain.start, chain.hidden = start, chain.hidden + prefix_len - ids
                return
            if k == lo:
                return
            k = max(lo, k - (hi - k))  # too few ids: twice the messages
