"""``--truncation turns`` fast: the turn window of prompt_rule.whole_turns, found in a few renders.

The rule (prompt_rule.whole_turns) scans the starts from the earliest and renders each
window; over a long session that is quadratic. Here the first candidate tried is guessed
from the turns' own token counts, then judged on its real render and walked to its
neighbour, so a step renders about three windows of at most ``max_context`` (the guess, its
neighbour, the shortest window) instead of its whole history. The guess only chooses where
to look: the window taken is the earliest that fits among the candidates rendered, the same
as the rule's while a window's prefix grows with the turns it holds. Two cases where it does
not are handled (:meth:`TurnWindows._earliest_fit`): the whole history, the one window
without the truncation marker, can be shorter than the window one turn shorter (issue 40:
a template that drops earlier reasoning once a user turn follows), so it is tried whenever
it may fit; and when two windows rendered break the order, the rule's scan decides.

What is checked, and how: at run time the step where a session first crosses the budget, and
one in 16 of the later windowed steps (up to prompts.TURN_CHECK_MESSAGES messages in), are
built by the rule; a difference stores the rule's prompts for the episode and counts a
``turn_windows`` fallback (verify.py). Tests hold it to the rule on sampled sessions
(tests/test_turns_truncation.py, tests/test_prompt_rule.py, tests/test_differential.py);
nothing proves the two equal for every template.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hcapo_store.rendering.hindsight import inject_hindsight
from hcapo_store.rendering.messages import flatten_messages, own_text
from hcapo_store.rendering.prompt_rule import (
    TRUNCATION_MARKER,
    Render,
    RenderedStep,
    head_end_of,
    marked_head,
    render_pair,
    window_starts,
)
from hcapo_store.rendering.segments import RenderState, SegmentEncoder
from hcapo_store.rendering.template import TemplateRejected

# The template markup a message adds to its own text, roughly, in ids, when a session has no
# earlier turn to measure it on; it only places the first window tried.
TURN_OVERHEAD_TOKENS = 8


@dataclass
class TurnIndex:
    """Per episode: where windows may start and each turn's own ids."""

    head_end: int  # messages[:head_end] are always kept: through the first user message
    starts: list[int]  # message indices that may start a window, ascending (never a tool result)
    cum: list[int]  # cum[i]: the own-text ids of messages[:i]

    @classmethod
    def of(cls, messages: Sequence[Mapping[str, Any]], encoder: SegmentEncoder) -> TurnIndex:
        head_end = head_end_of(messages)
        cum = [0]
        for n in encoder.count([own_text(m) for m in messages]):
            cum.append(cum[-1] + n)
        return cls(head_end, window_starts(messages, head_end), cum)

    def starts_until(self, m: int) -> int:
        """How many starts a window ending at message ``m`` may take (0: ``m`` is in the head)."""
        return bisect.bisect_right(self.starts, m) if m >= self.head_end else 0

    def first_fit(self, count: int, m: int, budget: float, overhead: float) -> int:
        """The first of ``count`` starts whose turns before message ``m`` fit ``budget`` by
        a guess (their own ids and ``overhead`` more per message); the last start when none
        does."""
        lo, hi = 0, count - 1
        while lo < hi:
            mid = (lo + hi) // 2
            start = self.starts[mid]
            if self.cum[m] - self.cum[start] + overhead * (m - start) <= budget:
                hi = mid
            else:
                lo = mid + 1
        return lo


class TurnWindows:
    """The turn windows of one episode's steps (``start_episode`` forgets the last one's)."""

    def __init__(self, render: Render, encoder: SegmentEncoder, max_context: int) -> None:
        self._render = render
        self.encoder = encoder
        self.max_context = max_context
        self._probe_state: RenderState = encoder.new_state()
        self._indexes: dict[bool, TurnIndex] = {}  # by flattened
        self._flat: list[dict] | None = None
        # how many ids the marker may add to a window beyond the turns it replaces
        self.marker_slack = len(encoder.encode_once(TRUNCATION_MARKER)) + TURN_OVERHEAD_TOKENS
        self._floor: int | None = None

    def message_floor(self) -> int:
        """The fewest ids the template adds for one more message, however empty (measured once
        on an empty tool result, assistant and user turn inserted in a conversation's middle,
        one id less for a merge at an edge; 0 when the template rejects them): how much the whole history is longer, at least,
        than a window that leaves ``k`` messages out, besides the marker."""
        if self._floor is None:
            call: dict = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
            tool: dict = {"role": "tool", "content": "", "tool_call_id": "c", "name": "f"}
            base: list[dict] = [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", "tool_calls": [call]},
                tool,
                {"role": "assistant", "content": "c"},
            ]
            inserted: list[dict] = [{"role": "assistant", "content": ""}, {"role": "user", "content": ""}]
            try:
                shortest = len(self.encoder.encode_once(self._render(base, generation=False)))
                added = [
                    len(self.encoder.encode_once(self._render([*base[:3], extra, *base[3:]], generation=False)))
                    - shortest
                    for extra in [tool, *inserted]
                ]
            except TemplateRejected:
                added = [0]
            self._floor = max(min(added) - 1, 0)
        return self._floor

    def start_episode(self) -> None:
        self._indexes, self._flat = {}, None

    def render(
        self, raw: Sequence[Mapping[str, Any]], normalized: Sequence[dict], m: int, hindsight: str | None
    ) -> RenderedStep:
        try:
            return self._window(self._index(normalized, False), normalized, m, hindsight, False)
        except TemplateRejected:
            if self._flat is None:
                self._flat = flatten_messages(raw)
            return self._window(self._index(self._flat, True), self._flat, m, hindsight, True)

    def _index(self, messages: Sequence[dict], flattened: bool) -> TurnIndex:
        if flattened not in self._indexes:
            self._indexes[flattened] = TurnIndex.of(messages, self.encoder)
        return self._indexes[flattened]

    def _window(
        self, index: TurnIndex, messages: Sequence[dict], m: int, hindsight: str | None, flattened: bool
    ) -> RenderedStep:
        """Step ``m``'s texts over the head and the turns from the earliest start whose prompt,
        action included, fits ``max_context`` (prompt_rule._turns states it). A step's window
        depends on nothing but the step."""
        count = index.starts_until(m)
        starts = index.starts
        if not count:  # the step is inside the head: nothing to leave out
            return render_pair(self._render, inject_hindsight(messages[: m + 1], hindsight), flattened)
        head = inject_hindsight(messages[: index.head_end], hindsight)
        marked = marked_head(head)
        windows: dict[int, list[dict]] = {}
        prefixes: dict[int, tuple[str, int]] = {}

        def window(n: int) -> list[dict]:
            if n not in windows:
                windows[n] = [*(head if n == 0 else marked), *messages[starts[n] : m + 1]]
            return windows[n]

        def prefix_len(n: int) -> int:
            if n not in prefixes:
                text_ = self._render(window(n)[:-1], generation=True)
                prefixes[n] = (text_, len(self.encoder.encode(text_, self._probe_state)))
            return prefixes[n][1]

        # The shortest window (the head and the action turn) gives the action's length and
        # the head's; the one before it, what the template adds per message around their
        # own words; the turns in between are guessed from that, and then rendered.
        last = count - 1
        shortest_full = self._render(window(last), generation=False)
        action = len(self.encoder.encode(shortest_full, self._probe_state)) - prefix_len(last)
        budget = self.max_context - action
        overhead = float(TURN_OVERHEAD_TOKENS)
        if last > 0:
            sample = starts[last - 1]
            own = index.cum[m] - index.cum[sample]
            overhead = max((prefix_len(last - 1) - prefix_len(last) - own) / (m - sample), 0.0)
        n = self._earliest_fit(index, count, m, budget, overhead, prefix_len)
        full = shortest_full if n == last else self._render(window(n), generation=False)
        dropped = index.cum[starts[n]] - index.cum[index.head_end]
        return RenderedStep(prefixes[n][0], full, window(n), flattened, dropped)

    def _earliest_fit(
        self, index: TurnIndex, count: int, m: int, budget: int, overhead: float, prefix_len: Callable[[int], int]
    ) -> int:
        """The earliest of ``count`` starts whose prefix fits ``budget`` (the last when none
        does), as the rule finds it: the guess, walked to its neighbours, then two checks.

        The walk assumes a window one turn shorter never has more ids than a longer one. Among
        the windows that leave turns out (all ending the head with the marker) a template that
        breaks this is caught: whenever two windows the walk rendered say otherwise, the rule's
        own scan from the earliest start decides. The whole history is the one window without
        the marker, so it may be shorter than the window one turn shorter (the turn left out
        weighs less than the marker): it is tried whenever it may fit by what the walk saw,
        the shortest window it saw miss the budget, less the marker's ids and a few, plus the
        template's fewest ids per message for each message the whole history adds to it (so
        a long session still renders windows, never its whole history)."""
        last = count - 1
        seen: dict[int, int] = {}

        def length(n: int) -> int:
            seen[n] = prefix_len(n)
            return seen[n]

        n = index.first_fit(count, m, budget - prefix_len(last), overhead)
        if length(n) <= budget:
            while n > 0 and length(n - 1) <= budget:
                n -= 1
        else:
            while n < last and length(n) > budget:
                n += 1
        marked = [seen[k] for k in sorted(seen) if k > 0]
        if any(shorter > longer for longer, shorter in zip(marked, marked[1:])):
            n = 0
            while n < last and prefix_len(n) > budget:
                n += 1
        elif 0 not in seen:
            failed = n if seen[n] > budget else n - 1  # the shortest window known not to fit
            left_out = index.starts[failed] - index.starts[0]  # messages the whole history adds
            floor = seen[failed] - self.marker_slack + left_out * self.message_floor()
            if floor <= budget and prefix_len(0) <= budget:
                n = 0
        return n
