"""``--prompt-layout episode``: the conversation rendered once per episode, every step scored in place.

The per-step layout sends, for every step, the conversation up to it with a hindsight block
that names the step's own subtask: 26–51× the conversation's tokens on real-size episodes,
and a template that rewrites earlier turns (Qwen3) defeats any prefix cache. Here:

* one hindsight block per episode (``EPISODE_HINDSIGHT_TEMPLATE``: the outcome, without the
  per-step "current subtask" lines) in the first message, as in the per-step layout;
* the whole conversation rendered once with it, exactly as a trainer renders the episode;
  each step's own tokens (its reasoning, text, tool calls and end-of-turn token: what
  ``--action-span policy`` scores) located in that rendering by ``placement.py`` and
  verified on the ids;
* one request per window: when the conversation (up to its last step) fits ``max_context``
  the whole of it is one request; otherwise windows of ``anchor + marker + recent ids`` (the
  per-step truncation's shape) start half a budget before their first step, so every step
  sees at least half a budget of the conversation before it, and consecutive windows overlap
  by about that half: about 2× the conversation's tokens, however long the episode.

What the model sees differs from the per-step layout: the subtask lines are gone, the
conversation after a step is not in its request only when the request ends there (logprobs
are causal, so nothing after a scored token changes it), and every turn is rendered as the
whole conversation renders it (Qwen3 writes no empty think block on turns before the last).
Qwen3 renders the turns before the last user message without their reasoning: there, as in
a trainer's whole-conversation row, such a turn's text and tool calls are scored, not its
reasoning (``--prompt-layout per-step --action-span policy`` scores the reasoning too). It
is a different scorer (``prompt_layout`` in the spec).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

from hcapo_store.rendering import verify
from hcapo_store.rendering.placement import Placement, Placer, Steps, place_by_rule, place_with_fallback
from hcapo_store.rendering.prompts import (
    HindsightDoesNotFit,
    PromptBuilder,
    flatten_messages,
    hindsight_text,
    inject_hindsight,
    layout_template,
    normalize_messages,
    read_field,
)
from hcapo_store.rendering.requests import FailureReason, GroupPrompt, IdsPrefix, PromptFailure, StepPrompt
from hcapo_store.rendering.strings import common_prefix
from hcapo_store.rendering.template import TemplateRejected

# A window after the first starts this fraction of the budget before its first step.
CONTEXT_FRACTION = 2


class EpisodeLayout:
    """Builds the episode layout's requests with a :class:`PromptBuilder`'s settings."""

    def __init__(self, builder: PromptBuilder) -> None:
        self.builder = builder
        # A turn the template renders without its reasoning is scored as rendered (module docstring).
        self.placer = Placer(builder.tokenizer, reasoning_required=False, encoder=builder.encoder)

    def requests(
        self, messages: Sequence[Mapping[str, Any]], outcome: Any, steps: Sequence[Any]
    ) -> list[GroupPrompt | PromptFailure]:
        """One request per window, in order; a step that cannot be placed is a failure."""
        through = max((read_field(s, "message_index") for s in steps), default=-1)
        return self.requests_and_floor(messages, outcome, steps, through)[0]

    def requests_and_floor(
        self, messages: Sequence[Mapping[str, Any]], outcome: Any, steps: Sequence[Any], through: int
    ) -> tuple[list[GroupPrompt | PromptFailure], int | None]:
        """:meth:`requests`, and the episode's conversation tokens through message ``through``
        (its last step: :func:`conversation_tokens`) counted on the rendering placed, without
        tokenizing the episode a second time; None when they cannot be counted there."""
        order = sorted(steps, key=lambda s: read_field(s, "message_index"))
        wanted = [(read_field(s, "step_index"), read_field(s, "message_index")) for s in order]
        block = hindsight_text(outcome, {}, self.builder.hindsight_template) if self.builder.hindsight else None
        try:
            placement, placed, flattened = place_with_fallback(
                self,
                inject_hindsight(normalize_messages(messages), block),
                wanted,
                lambda: flatten_messages(inject_hindsight(messages, block)),
            )
        except TemplateRejected as exc:
            failures: list[GroupPrompt | PromptFailure] = [
                PromptFailure(i, "template", f"the chat template cannot render this episode: {exc}") for i, _ in wanted
            ]
            return failures, None
        floor = None if flattened else self._floor(placement, placed, through)
        return self._requests(placement, wanted, flattened, placed[0]), floor

    def place(self, msgs: list[dict], steps: Steps) -> Placement:
        """The placement of ``steps`` in ``msgs``: the linear :class:`Placer`, held to
        ``place_by_rule`` by verify.PLACEMENT's policy (one step, the middle one, of the
        episodes it samples: the whole rendering, its ids and that step's span or refusal);
        on a disagreement the rule places the episode. In reference mode, the rule."""
        if self.builder.reference:
            return self._by_rule(msgs, steps)
        placement = self.placer.place(msgs, steps)
        if steps and self.builder.checks.due(verify.PLACEMENT):
            index = steps[len(steps) // 2][0]
            rule = self._by_rule(msgs, [steps[len(steps) // 2]])
            fast_span, rule_span = placement.spans.get(index), rule.spans.get(index)
            if (
                rule.text != placement.text
                or rule.ids != list(placement.ids)
                or (fast_span and (fast_span.start, fast_span.end)) != (rule_span and (rule_span.start, rule_span.end))
                or (index in placement.refused) != (index in rule.refused)
            ):
                verify.disagreed(verify.PLACEMENT, f"step {index}'s placement differs from the rule's")
                return self._by_rule(msgs, steps)
        return placement

    def _by_rule(self, msgs: list[dict], steps: Steps) -> Placement:
        try:
            return place_by_rule(self.builder.tokenizer, msgs, steps, reasoning_required=False)
        except Exception as exc:  # the template's refusal of the whole conversation
            raise TemplateRejected(f"{type(exc).__name__}: {exc}") from exc

    def _floor(self, placement: Placement, placed: list[dict], through: int) -> int | None:
        """The floor's rendering (the messages through ``through``, normalized, the hindsight
        block in the first) shares most of the whole rendering: the whole rendering's ids
        before the last clean cut where the two still agree, plus the rest of the floor's
        text encoded alone. None when the tokenizer cannot vouch for a cut (counted on its own)."""
        if through == len(placed) - 1:
            return len(placement.ids)
        try:
            text = self.builder.render(placed[: through + 1], generation=False)
        except TemplateRejected:
            return None
        cut = self.builder.encoder.clean_cut(placement.text, common_prefix(text, placement.text))
        if cut is None:
            return None
        # The ids that start before the cut (starts ascend).
        n = bisect_left(placement.offsets, cut, key=itemgetter(0))
        return n + len(self.builder.encoder.encode_once(text[cut:]))

    def _requests(
        self, placement: Placement, wanted: list[tuple[int, int]], flattened: bool, first: dict
    ) -> list[GroupPrompt | PromptFailure]:
        out: list[GroupPrompt | PromptFailure] = []
        for index, reason in placement.refused.items():
            kind: FailureReason = "empty_action" if reason.startswith("empty_action") else "alignment"
            if reason.startswith("template"):
                kind = "template"
            out.append(PromptFailure(index, kind, f"episode layout: {reason}"))
        placed = [(i, placement.spans[i]) for i, _ in wanted if i in placement.spans]
        if not placed:
            return out
        ids, budget = placement.ids, self.builder.max_context
        head: list[int] | None = None
        j = 0
        window_start = 0  # where the current window starts in the conversation's ids
        while j < len(placed):
            start, end = placed[j][1].start, placed[j][1].end
            if j > 0 or end > budget:  # not the first window: anchor + marker + recent ids
                if head is None:
                    made = self._head(first, budget)
                    if isinstance(made, HindsightDoesNotFit):  # no window past the first can hold it
                        out += [PromptFailure(i, "context", f"episode layout: {made}") for i, _ in placed[j:]]
                        break
                    head = made
                room = budget - len(head)
                window_start = max(start - room // CONTEXT_FRACTION, end - room, 0)
                base = head + ids[window_start : window_start + room]
                offset = len(head) - window_start
                # the conversation's ids left out: the anchor stands for the first message's (a
                # head of nothing, a baseline's first message too long to keep, has no marker either)
                left_out = max(window_start - max(len(head) - len(self.builder.marker_ids), 0), 0)
            else:
                window_start, base, offset, left_out = 0, ids[: min(budget, len(ids))], 0, 0
            members: list[StepPrompt] = []
            while j < len(placed) and placed[j][1].end + offset <= len(base):
                index, span = placed[j]
                members.append(
                    self._member(index, span.start, span.end, base, offset, window_start, left_out, flattened)
                )
                j += 1
            out.append(GroupPrompt(tuple(members)))
        return out

    def _head(self, first: dict, budget: int) -> list[int] | HindsightDoesNotFit:
        """The anchor (the first message, hindsight block included) and the truncation marker,
        whole, as the per-step layout keeps them: cut, the anchor would lose its end first, the
        outcome (a step longer than the room they leave keeps its tail, as there). Without a
        block (a baseline scorer) a first message longer than half the budget keeps its start."""
        anchor, marker = self.builder.anchor_ids(first), self.builder.marker_ids
        if self.builder.hindsight:
            if len(anchor) + len(marker) >= budget:
                return HindsightDoesNotFit(len(anchor), len(marker), None, budget)
            return anchor + marker
        keep = budget // 2 - len(marker)
        return anchor[:keep] + marker if keep > 0 else []

    def _member(
        self,
        index: int,
        start: int,
        end: int,
        base: list[int],
        offset: int,
        window_start: int,
        left_out: int,
        flattened: bool,
    ) -> StepPrompt:
        own = end - start
        kept = end - max(start, window_start)  # a step longer than the window keeps its tail
        scored = min(kept, self.builder.max_logprob_tokens) if self.builder.max_logprob_tokens > 0 else kept
        stop = end + offset
        first_scored = max(stop - scored, 1)
        return StepPrompt(
            step_index=index,
            input_ids=IdsPrefix(base, stop),
            first_scored=first_scored,
            total_action_tokens=own,
            skipped_action_tokens=own - (stop - first_scored),
            truncated_prefix_tokens=left_out,
            flattened=flattened,
        )


def conversation_tokens(
    builder: PromptBuilder,
    messages: Sequence[Mapping[str, Any]],
    outcome: Any,
    steps: Sequence[Any],
    *,
    keep_pieces: bool = False,
) -> int:
    """The prefill floor of an episode for any layout: its conversation rendered once with the
    episode's hindsight block, up to the end of its last step (each token prefilled once).

    ``keep_pieces``: the rendering's pieces stay in the builder's token cache, for a per-step
    build of the same episode that follows at once (under the same lock; it encodes those
    pieces again otherwise, and clears the cache when done)."""
    if not steps:
        return 0
    last = max(read_field(s, "message_index") for s in steps)
    template = layout_template(builder.hindsight_template, "episode")
    block = hindsight_text(outcome, {}, template) if builder.hindsight else None
    shown = messages[: last + 1]
    for convert in (normalize_messages, flatten_messages):  # flattened only when the template rejects
        msgs = convert(shown)
        try:
            text = builder.render(inject_hindsight(msgs, block), generation=False)
        except TemplateRejected:
            continue
        encoder = builder.encoder
        return len(encoder.encode(text, encoder.new_state()) if keep_pieces else encoder.encode_once(text))
    return 0
