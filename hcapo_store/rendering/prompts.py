"""Per-step hindsight prompts with exact token spans (docs/SCORING.md; docs/ORIGINAL.md §2 for the original's).

For step t (assistant message m) the request is ``prefix + action`` where
``prefix = render(messages[:m] with the hindsight block in message 0, add_generation_prompt=True)``
and ``full = render(messages[:m + 1])``; both texts are tokenized with
``add_special_tokens=False`` and the action is ``full_ids[len(prefix_ids):]``.

Two implementations, meant to produce the same ids:

* :meth:`PromptBuilder.build_step_reference` is the rule: the texts of prompt_rule.py (the
  whole history for ``sliding``/``window``, the whole-turns rule for ``turns``), each
  tokenized from scratch, which is what the original ``_build_prompt_pair`` did for
  ``sliding`` (minus its bugs, see below);
* :meth:`PromptBuilder.build_episode` reaches the texts and ids through the fast
  strategies: :class:`~hcapo_store.rendering.bounded.BoundedRenders` (long sessions in
  ``sliding``/``window``), :class:`~hcapo_store.rendering.step_edits.StepEdits` (a step's
  renders edited from the previous step's), :class:`~hcapo_store.rendering.turn_windows.TurnWindows`
  (``turns``), :class:`SegmentEncoder`'s cached pieces (reusing the ids of the text shared
  with the previous render, ASCII pieces through ascii_bpe.py) and the template sandbox.
  Each is held to its rule by verify.py's check policy (the last step of every bounded
  chain; the first edited step of an episode and the last of every line of edits; the step
  where a ``turns`` session first crosses the budget and a sample after; the
  first ASCII pieces of a process and a sample after; a template's first render): where one
  differs, the rule's prompts are what the episode gets, and the fallback is counted. Steps
  not sampled are not compared at run time; tests compare them on sampled sessions
  (tests/test_differential.py and the files named in prompt_rule.py). With
  ``HCAPO_RENDERING=reference`` (or ``rendering="reference"``) ``build_episode`` is the rule
  for every step.

Differences from the original, on purpose:

* truncation works on token ids (the original decoded and re-encoded, which moved the span);
* a prefix whose ids are not a prefix of the full ids fails with ``alignment`` instead of
  being assumed;
* ``total_action_tokens`` is always the untruncated action length;
* the first scored token can never be position 0 (nothing to condition on): when the
  action alone fills ``max_context`` and every kept token would be scored, its first token
  is counted as skipped instead;
* a null ``plan_score`` prints as ``0`` in the hindsight block (the original crashed on it
  later); a null or negative step reward prints ``n/a``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hcapo_store.rendering import verify
from hcapo_store.rendering.bounded import BoundedRenders, NeedWhole, checked_positions
from hcapo_store.rendering.hindsight import EPISODE_HINDSIGHT_TEMPLATE as EPISODE_HINDSIGHT_TEMPLATE
from hcapo_store.rendering.hindsight import HINDSIGHT_TEMPLATE as HINDSIGHT_TEMPLATE
from hcapo_store.rendering.hindsight import PROMPT_LAYOUTS as PROMPT_LAYOUTS
from hcapo_store.rendering.hindsight import PromptLayout as PromptLayout
from hcapo_store.rendering.hindsight import check_hindsight_template as check_hindsight_template
from hcapo_store.rendering.hindsight import hindsight_text as hindsight_text
from hcapo_store.rendering.hindsight import inject_hindsight as inject_hindsight
from hcapo_store.rendering.hindsight import layout_template as layout_template
from hcapo_store.rendering.hindsight import read_field as read_field
from hcapo_store.rendering.hindsight import template_hash as template_hash
from hcapo_store.rendering.messages import flatten_messages as flatten_messages
from hcapo_store.rendering.messages import normalize_messages as normalize_messages
from hcapo_store.rendering.own_tokens import EMPTY_TURN, NotOwn, OwnTokenLocator
from hcapo_store.rendering.prompt_rule import TRUNCATION_MARKER as TRUNCATION_MARKER
from hcapo_store.rendering.prompt_rule import RenderedStep, check_step, whole_history, whole_turns
from hcapo_store.rendering.requests import FailureReason, PromptFailure, StepPrompt
from hcapo_store.rendering.segments import RenderState, SegmentEncoder
from hcapo_store.rendering.step_edits import StepEdits
from hcapo_store.rendering.template import RenderMemo, TemplateRejected, render_by_rule, render_chat
from hcapo_store.rendering.tokenizers import PerTokenizer
from hcapo_store.rendering.turn_windows import TurnWindows

PROMPT_BUILDER_VERSION = 1

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 32768
DEFAULT_MAX_LOGPROB_TOKENS = 2048

ActionSpan = Literal["rendered", "policy"]
ACTION_SPANS: tuple[ActionSpan, ...] = ("rendered", "policy")
Truncation = Literal["sliding", "window", "turns"]
TRUNCATIONS: tuple[Truncation, ...] = ("sliding", "window", "turns")
# --truncation window: the window start moves in blocks of this fraction of the tail budget.
WINDOW_BLOCK_FRACTION = 4
# --truncation turns: sampled steps checked against the rule are at most this far into a session
TURN_CHECK_MESSAGES = 128


@dataclass
class _StepTexts:
    prefix_ids: list[int]
    full_ids: list[int]
    flattened: bool
    # --truncation turns: the own-text ids of the turns left out of the window
    dropped: int = 0
    # action_span "policy": [start, end) of the policy's own tokens in the action ids, or why not
    own: tuple[int, int] | str | None = None
    # a bounded render (sliding/window): the whole history's prefix ids between the head and
    # the window, counted and not rendered; a tail may start no earlier than visible_from
    hidden: int = 0
    visible_from: int = 0


class HindsightDoesNotFit(Exception):
    """The first message with its hindsight block and the truncation marker take the whole
    ``max_context``: a prompt holding them has no room for the action (a ``context`` failure)."""

    def __init__(self, anchor: int, marker: int, action: int | None, max_context: int) -> None:
        what = "a step's ids" if action is None else f"the action ({action} ids)"
        super().__init__(
            f"first message + hindsight block ({anchor} ids) + truncation marker ({marker}) leave no room "
            f"in --max-context {max_context} for {what}; cut, the prompt would lose the outcome: use a "
            f"--max-context above {anchor + marker} (a new scorer) or a shorter first message or --hindsight-template"
        )


# each tokenizer's largest id: a trainer's every step makes a new builder of its one kept
# tokenizer, and reading the 150k-entry vocabulary costs ~0.2 s
_TOP_IDS = PerTokenizer()


def top_token_id(tokenizer: Any) -> int:
    """The tokenizer's largest id, read once per tokenizer object (again when its length changes:
    tokens added)."""
    return int(_TOP_IDS.get(tokenizer, len(tokenizer), lambda: max(tokenizer.get_vocab().values())))


class PromptBuilder:
    """Builds :class:`StepPrompt` objects for the steps of one episode at a time."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        hindsight_template: str = HINDSIGHT_TEMPLATE,
        max_context: int = DEFAULT_MAX_CONTEXT,
        max_logprob_tokens: int = DEFAULT_MAX_LOGPROB_TOKENS,
        truncation: Truncation = "sliding",
        action_span: ActionSpan = "rendered",
        hindsight: bool = True,
        layout: PromptLayout = "per-step",
        rendering: Literal["fast", "reference"] | None = None,
        checks: verify.Checks = verify.CHECKED,
    ) -> None:
        self._settings: dict[str, Any] = dict(
            hindsight_template=hindsight_template,
            max_context=max_context,
            max_logprob_tokens=max_logprob_tokens,
            truncation=truncation,
            action_span=action_span,
            hindsight=hindsight,
            layout=layout,
        )
        if max_context < 2:
            raise ValueError(f"max_context must be at least 2 tokens, got {max_context}")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        if action_span not in ACTION_SPANS:
            raise ValueError(f"action_span must be one of {ACTION_SPANS}, got {action_span!r}")
        if layout not in PROMPT_LAYOUTS:
            raise ValueError(f"layout must be one of {PROMPT_LAYOUTS}, got {layout!r}")
        self.truncation = truncation
        self.action_span = action_span
        self.hindsight = hindsight  # False: no outcome in the prompt (a baseline scorer)
        # "episode": requests come from rendering/episode_layout.py (one rendering per episode);
        # build_episode below stays the per-step rule.
        self.layout = layout
        hindsight_template = layout_template(hindsight_template, layout)
        check_hindsight_template(hindsight_template, layout)
        self.tokenizer = tokenizer
        self.hindsight_template = hindsight_template
        self.max_context = max_context
        self.max_logprob_tokens = max_logprob_tokens
        # "reference": the rules only (verify.py; None: HCAPO_RENDERING decides)
        self.reference = verify.reference_mode() if rendering is None else rendering == "reference"
        self.checks = checks  # the strategies held to their rules (verify.py); UNCHECKED: measuring only
        self.encoder = SegmentEncoder(tokenizer, reference=self.reference, checks=checks)
        self._known: RenderMemo | None = None  # set while build_episode renders one episode

        # the fast strategies (each tested equal to the rule: prompt_rule.py)
        # (they render through the builder's _render as it is when they call it)
        def render(messages: list[dict], *, generation: bool) -> str:
            return self._render(messages, generation=generation)

        self._turns = TurnWindows(render, self.encoder, max_context)
        self._edits = StepEdits(render, checks, empty_turns=action_span == "policy")
        self._bounded = BoundedRenders(render, self.encoder, max_context, pair=self._edits.pair)
        self._marker_ids = tokenizer.encode(TRUNCATION_MARKER, add_special_tokens=False)
        # sliding/window: whether a long session's steps may render bounded windows (their ids
        # are counted piece by piece between added tokens, which needs the fast path)
        self._can_bound = (
            layout == "per-step" and truncation in ("sliding", "window") and self.encoder.fast_path_off_reason is None
        )
        # episodes whose long history every step rendered whole (a bounded render disagreed
        # with the whole one, or could not be made): their preparation grows with the square
        self.whole_history_episodes = 0
        self.bounded_steps = 0  # steps whose prompt came from a bounded render (checked: _check_bounded)
        self.edited_steps = 0  # steps whose two renders were edited from the previous step's (step_edits.py)
        self._locator = OwnTokenLocator(tokenizer, self.encoder)
        if action_span == "policy" and not self._locator.available:
            raise ValueError("action_span 'policy' needs a fast tokenizer (character offsets)")
        if layout == "episode" and not self._locator.available:
            raise ValueError("the episode layout needs a fast tokenizer (character offsets)")

    def by_rule(self) -> PromptBuilder:
        """A builder of the same settings that runs the rules only (the scorer fingerprint's)."""
        return self if self.reference else PromptBuilder(self.tokenizer, **self._settings, rendering="reference")

    def anchor_ids(self, first: dict) -> list[int]:
        """The first message (hindsight block included) alone: what a truncated prompt keeps."""
        return self.encoder.encode_once(self._anchor_text(first))

    def _anchor_text(self, first: dict) -> str:
        """The anchor's text, without the marker ``--truncation turns`` ends a one-message head
        with: the cut puts its own marker after the anchor (once, not twice)."""
        content = first.get("content")
        marked = TRUNCATION_MARKER.rstrip()
        if isinstance(content, str) and content.endswith(marked):
            first = dict(first, content=content[: -len(marked)])
        return self._render([first], generation=False)

    @property
    def thread_safe(self) -> bool:
        """Whether episodes may be prepared in several threads at once: the episode layout
        keeps no per-episode token cache (what it shares is safe to share: ascii_bpe.py's memo
        is a dict whose single operations the GIL keeps whole, verify.py counts under a lock).
        It does not make preparation parallel: ascii_bpe.py tokenizes pure-ASCII pieces in
        Python, under the GIL; only the backend's share (the other pieces, encoded in one
        batch without the GIL) and the waits overlap."""
        return self.layout == "episode" and self.encoder.fast_path_off_reason is None

    @functools.cached_property
    def top_token_id(self) -> int:
        """The tokenizer's largest id (its vocabulary is a 150k-entry dict: read once)."""
        return top_token_id(self.tokenizer)

    @property
    def marker_ids(self) -> list[int]:
        return self._marker_ids

    # -- rendering: the rule (prompt_rule.py) or a fast strategy; only the path differs

    def render(self, messages: list[dict], *, generation: bool) -> str:
        """The chat template's text of ``messages``: the project's sandbox (render_chat), or in
        reference mode ``apply_chat_template`` itself."""
        return self._render(messages, generation=generation)

    def _render(self, messages: list[dict], *, generation: bool) -> str:
        if self.reference:
            return render_by_rule(self.tokenizer, messages, generation=generation)
        return render_chat(self.tokenizer, messages, generation=generation, known=self._known)

    def _texts(
        self, raw: Sequence[Mapping[str, Any]], normalized: Sequence[dict], m: int, hindsight: str | None, whole: bool
    ) -> RenderedStep:
        """Step ``m``'s prefix and full texts through the fast strategies (build_episode).
        ``whole``: sliding/window render the step's whole history, never a bounded window."""
        check_step(raw, m)
        if self.truncation == "turns":
            return self._turns.render(raw, normalized, m, hindsight)
        if not whole and self._bounded.on:
            return self._bounded.render(raw, normalized, m, hindsight)
        return whole_history(self._render, raw, normalized, m, hindsight, pair=self._edits.pair)

    def _rule_texts(
        self,
        raw: Sequence[Mapping[str, Any]],
        normalized: Sequence[dict],
        m: int,
        hindsight: str | None,
        encode: Callable[[str], list[int]],
    ) -> RenderedStep:
        """Step ``m``'s texts by the rule itself (prompt_rule.py)."""
        if self.truncation == "turns":
            return whole_turns(self._render, encode, raw, normalized, m, hindsight, self.max_context)
        return whole_history(self._render, raw, normalized, m, hindsight)

    def _check_bounded(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        outcome: Any,
        steps: Sequence[Any],
        results: list[StepPrompt | PromptFailure],
        bounded: list[tuple[int, int]],
    ) -> str | None:
        """Compare steps built on bounded renders with their build by the rule: the last step
        of every chain and, from the episode's last, halving back to its first
        (bounded.checked_positions). Each costs a prefix and a full render of its whole
        history; a chain starts with such a pair of renders anyway, so the check adds at most
        that much again, plus about four for the halving. Returns what differed, or None."""

        encode = self._rule_encoder()
        for n in checked_positions([chain for _, chain in bounded]):
            position = bounded[n][0]
            exact = self._exact_step(messages, normalized, outcome, steps[position], encode)
            if exact != results[position]:
                return f"step {read_field(steps[position], 'step_index')} differs from its whole-history build"
        return None

    def _rule_encoder(self) -> Callable[[str], list[int]]:
        """Texts' ids through the episode's cached pieces (a rule's texts, checked), each text's
        pieces and added tokens shared with the text before it taken from that one's ids: the
        whole histories checked from the latest step back share most of their text. Exact as
        every per-step encode (segments.py: pieces between added tokens are tokenized alone)."""
        state = self.encoder.new_state()
        return lambda text: self.encoder.encode(text, state)

    def _rule_steps(
        self, messages: Sequence[Mapping[str, Any]], normalized: list[dict], outcome: Any, steps: Sequence[Any]
    ) -> list[StepPrompt | PromptFailure]:
        """Every step built by the rule (a strategy disagreed for this episode)."""
        encode = self._rule_encoder()
        return [self._exact_step(messages, normalized, outcome, step, encode) for step in steps]

    def _check_turns(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        outcome: Any,
        steps: Sequence[Any],
        results: list[StepPrompt | PromptFailure],
    ) -> str | None:
        """verify.TURN_WINDOWS's policy: the step where the session first crosses the budget
        (its first prompt that leaves anything out) is built by the rule, and one in 16 of the
        later ones whose step is at most TURN_CHECK_MESSAGES messages in (the rule renders every
        window from the earliest start: a long session's late step would cost its square).
        Returns what differed, or None."""
        crossed = False
        for step, result in zip(steps, results):
            if not (isinstance(result, StepPrompt) and result.truncated_prefix_tokens):
                continue
            if crossed:
                if read_field(step, "message_index") > TURN_CHECK_MESSAGES or not self.checks.due(verify.TURN_WINDOWS):
                    continue
            crossed = True
            if self._exact_step(messages, normalized, outcome, step, self._rule_encoder()) != result:
                return f"step {read_field(step, 'step_index')} differs from the whole-turns rule's build"
        return None

    # -- public entry points

    def build_episode(
        self, messages: Sequence[Mapping[str, Any]], outcome: Any, steps: Sequence[Any]
    ) -> list[StepPrompt | PromptFailure]:
        """Every step's prompt (or failure), through the fast strategies, each held to its
        rule by verify.py's policy: a disagreement stores the rule's prompts for the episode.
        In reference mode, the rule for every step (:meth:`build_step_reference`)."""
        normalized = normalize_messages(messages)
        if self.reference:
            return [self._exact_step(messages, normalized, outcome, step, self.encoder.encode_whole) for step in steps]
        # Each message is rendered again for every later step: whether it is plain JSON data
        # is checked once per episode (the normalized messages do not change meanwhile).
        self._known = RenderMemo()
        try:
            self._turns.start_episode()
            results, bounded, edits = self._build_edited(messages, normalized, outcome, steps, self._can_bound, True)
            reason = self._bounded.unbounded
            checked = bounded and self.checks.on
            mismatch = self._check_bounded(messages, normalized, outcome, steps, results, bounded) if checked else None
            if mismatch is not None:
                # Never store a prompt on trust: build every step on its whole history.
                verify.disagreed(verify.BOUNDED_RENDERS, mismatch)
                reason = mismatch
                results, bounded, edits = self._build_edited(messages, normalized, outcome, steps, False, edits)
            self.bounded_steps += len(bounded)
            if self.truncation == "turns" and self.checks.on:
                mismatch = self._check_turns(messages, normalized, outcome, steps, results)
                if mismatch is not None:
                    verify.disagreed(verify.TURN_WINDOWS, mismatch)
                    results = self._rule_steps(messages, normalized, outcome, steps)
            if reason is not None:
                self.whole_history_episodes += 1
                log.info("a long session's steps render their whole history (%s)", reason)
        finally:
            self.encoder.pieces.clear()  # segments rarely repeat across episodes; keep memory flat
            self._known = None
            self._turns.start_episode()
            self._bounded.start_episode(on=False)
            self._edits.start_episode(on=False)
        return results

    def _build_edited(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        outcome: Any,
        steps: Sequence[Any],
        bounded_on: bool,
        edits: bool,
    ) -> tuple[list[StepPrompt | PromptFailure], list[tuple[int, int]], bool]:
        """:meth:`_build_steps` with edited renders where ``edits`` (step_edits.py), held to
        verify.EDITED_RENDERS: a difference builds the episode again with every window rendered
        whole. Returns the results, the bounded steps and whether edits stayed on."""
        self._bounded.start_episode(on=bounded_on)
        self._edits.start_episode(on=edits)
        results, bounded = self._build_steps(messages, normalized, outcome, steps)
        mismatch = self._edits.finish()  # the policy's checks (step_edits.py)
        if mismatch is not None:
            verify.disagreed(verify.EDITED_RENDERS, mismatch)
            return self._build_edited(messages, normalized, outcome, steps, bounded_on, False)
        self.edited_steps += self._edits.edited_steps
        return results, bounded, edits

    def _build_steps(
        self, messages: Sequence[Mapping[str, Any]], normalized: list[dict], outcome: Any, steps: Sequence[Any]
    ) -> tuple[list[StepPrompt | PromptFailure], list[tuple[int, int]]]:
        """Every step's result, and (position, chain number) of those built on a bounded render."""
        states: dict[tuple[str | None, bool], tuple[RenderState, RenderState]] = {}
        anchors: dict[tuple[Any, ...], list[int]] = {}
        results: list[StepPrompt | PromptFailure] = []
        bounded: list[tuple[int, int]] = []
        for step in steps:
            args = (messages, normalized, step, self._hindsight(outcome, step), states, anchors)
            try:
                try:
                    result, chain = self._episode_step(*args, whole=False)
                except NeedWhole:
                    result, chain = self._episode_step(*args, whole=True)
            except TemplateRejected as exc:
                result, chain = PromptFailure(read_field(step, "step_index"), "template", str(exc)), None
            if chain is not None:
                bounded.append((len(results), chain))
            results.append(result)
        return results, bounded

    def _episode_step(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        step: Any,
        hindsight: str | None,
        states: dict[tuple[str | None, bool], tuple[RenderState, RenderState]],
        anchors: dict[tuple[Any, ...], list[int]],
        *,
        whole: bool,
    ) -> tuple[StepPrompt | PromptFailure, int | None]:
        """A step's result, and its chain's number when it was built on a bounded render."""
        index, m = read_field(step, "step_index"), read_field(step, "message_index")
        rendered = self._texts(messages, normalized, m, hindsight, whole)
        key = (hindsight, rendered.flattened)
        first = rendered.messages[0]
        # Prefix and full renders get separate states: each shares most text with the
        # same kind of render of the previous step.
        prefix_state, full_state = states.setdefault(key, (self.encoder.new_state(), self.encoder.new_state()))
        texts = _StepTexts(
            self.encoder.encode(rendered.prefix_text, prefix_state),
            self.encoder.encode(rendered.full_text, full_state),
            rendered.flattened,
            rendered.dropped,
            hidden=rendered.hidden,
            visible_from=rendered.visible_from,
        )
        if rendered.bounded is not None:
            self._bounded.advance(rendered.bounded, len(texts.prefix_ids))
        texts.own = self._own_span(rendered, texts)
        result = self._finish(index, texts, lambda key=key, first=first: self._anchor(anchors, key, first))
        return result, rendered.bounded.chain.number if rendered.hidden else None

    def build_step(self, messages: Sequence[Mapping[str, Any]], outcome: Any, step: Any) -> StepPrompt | PromptFailure:
        return self.build_episode(messages, outcome, [step])[0]

    def build_step_reference(
        self, messages: Sequence[Mapping[str, Any]], outcome: Any, step: Any
    ) -> StepPrompt | PromptFailure:
        """The rule: prompt_rule.py's texts, each tokenized whole on its own (tests, benchmarks)."""
        return self._exact_step(messages, normalize_messages(messages), outcome, step, self.encoder.encode_whole)

    def _exact_step(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        outcome: Any,
        step: Any,
        encode: Callable[[str], list[int]],
    ) -> StepPrompt | PromptFailure:
        """A step built by the rule, each text tokenized on its own with ``encode``."""
        index, m = read_field(step, "step_index"), read_field(step, "message_index")
        hindsight = self._hindsight(outcome, step)
        try:
            rendered = self._rule_texts(messages, normalized, m, hindsight, encode)
        except TemplateRejected as exc:
            return PromptFailure(index, "template", str(exc))
        texts = _StepTexts(
            encode(rendered.prefix_text), encode(rendered.full_text), rendered.flattened, rendered.dropped
        )
        texts.own = self._own_span(rendered, texts)
        first = rendered.messages[0]
        return self._finish(index, texts, lambda: encode(self._anchor_text(first)))

    def _hindsight(self, outcome: Any, step: Any) -> str | None:
        return hindsight_text(outcome, step, self.hindsight_template) if self.hindsight else None

    # -- span logic, shared by both paths

    def _own_span(self, rendered: RenderedStep, texts: _StepTexts) -> tuple[int, int] | str | None:
        """action_span "policy": the policy's own tokens among the action ids (own_tokens.py)."""
        if self.action_span != "policy":
            return None
        messages, prefix_text, full_text = rendered.messages, rendered.prefix_text, rendered.full_text
        empty = rendered.empty_text  # edited beside the step's texts (step_edits.py), checked there
        if empty is None:
            try:
                empty = self._render([*messages[:-1], EMPTY_TURN], generation=False)
            except TemplateRejected as exc:
                return f"template: the template cannot render this turn empty ({exc})"
        if not (full_text.startswith(prefix_text) and empty.startswith(prefix_text)):
            return "the prompt with a generation prompt is not a prefix of the rendered turn"
        action_text = full_text[len(prefix_text) :]
        ids, offsets = self._locator.offsets(action_text)
        if ids != texts.full_ids[len(texts.prefix_ids) :]:
            return "the action's tokens alone differ from its tokens in the conversation"
        try:
            span = self._locator.span(action_text, empty[len(prefix_text) :], messages[-1], ids, offsets)
        except NotOwn as exc:
            return exc.reason
        return span.start, span.end

    def _anchor(self, anchors: dict[tuple[Any, ...], list[int]], key: tuple[Any, ...], first: dict) -> list[int]:
        # by the first message's text too: under --truncation turns a window that leaves turns
        # out ends the head with the marker (_anchor_text takes it off again)
        key = (*key, first.get("content"))
        if key not in anchors:
            anchors[key] = self.anchor_ids(first)
        return anchors[key]

    def _finish(self, index: int, texts: _StepTexts, anchor: Any) -> StepPrompt | PromptFailure:
        prefix_ids, full_ids = texts.prefix_ids, texts.full_ids
        prefix_len = len(prefix_ids)
        if full_ids[:prefix_len] != prefix_ids:
            return PromptFailure(
                index,
                "alignment",
                "the tokens of the prefix rendered with a generation prompt are not a prefix "
                "of the tokens of the full conversation",
            )
        action_ids = full_ids[prefix_len:]
        if not action_ids:
            return PromptFailure(index, "empty_action", "the action renders to no tokens")
        own_start, own_end = 0, len(action_ids)  # "rendered": every token the turn renders to
        if isinstance(texts.own, str):
            reason: FailureReason = "empty_action" if texts.own.startswith("empty_action") else "alignment"
            return PromptFailure(index, reason, f"policy span: {texts.own}")
        if texts.own is not None:
            # The request ends with the policy's last token: logprobs are causal, so what the
            # template adds after it changes nothing scored and is not sent.
            own_start, own_end = texts.own
            action_ids = action_ids[:own_end]
        try:
            kept_prefix, kept_action, history = self._truncate(
                prefix_ids, action_ids, anchor, texts.hidden, texts.visible_from
            )
        except TemplateRejected as exc:
            return PromptFailure(index, "template", f"anchor: {exc}")
        except HindsightDoesNotFit as exc:
            return PromptFailure(index, "context", str(exc))
        input_ids = kept_prefix + kept_action
        own_tokens = own_end - own_start
        scored = min(own_tokens, len(kept_action))
        if self.max_logprob_tokens > 0:
            scored = min(scored, self.max_logprob_tokens)
        # Position 0 has no context, so it cannot be scored.
        first_scored = max(len(input_ids) - scored, 1)
        return StepPrompt(
            step_index=index,
            input_ids=input_ids,
            first_scored=first_scored,
            total_action_tokens=own_tokens,
            skipped_action_tokens=own_tokens - (len(input_ids) - first_scored),
            # the history's ids left out: the anchor stands for the first message, the marker is
            # none of the history (a short prefix behind an action cut to fit: at least 0)
            truncated_prefix_tokens=max(prefix_len + texts.hidden - history, 0) + texts.dropped,
            flattened=texts.flattened,
        )

    def _truncate(
        self, prefix_ids: list[int], action_ids: list[int], anchor: Any, hidden: int = 0, visible_from: int = 0
    ) -> tuple[list[int], list[int], int]:
        """The original's truncation, on ids: anchor + marker + recent prefix tail + action; and
        how many of the kept prefix ids stand for the history (all but the marker).

        The anchor (the first message, the hindsight block at its end) is kept whole: an action
        too long to leave room for it keeps its tail behind it (the original kept the action's
        tail alone), and an anchor that cannot fit fails the step (HindsightDoesNotFit). A
        baseline scorer's anchor (no block) is cut to its start instead.
        ``window``: the tail starts at a multiple of a block instead, so consecutive steps
        keep the same start and their prompts stay prefixes of one another (one request).
        ``hidden``: the prefix is a bounded render, ``hidden`` ids of the whole history left
        out after its head; the tail must then start at ``visible_from`` or later."""
        total = len(prefix_ids) + hidden
        if total + len(action_ids) <= self.max_context:
            if hidden:
                raise NeedWhole
            return prefix_ids, action_ids, len(prefix_ids)
        max_prefix = self.max_context - len(action_ids)
        if max_prefix <= 0 and not self.hindsight:
            return [], action_ids[-self.max_context :], 0
        anchor_ids: list[int] = anchor()
        marker = self._marker_ids
        head = anchor_ids + marker
        if self.hindsight and len(head) > max_prefix:
            # Cut, the anchor would lose its end first: the hindsight block, and the score would
            # be the plain policy's, stored as the hindsight one's.
            room = self.max_context - len(head)
            if room < 1:
                raise HindsightDoesNotFit(len(anchor_ids), len(marker), len(action_ids), self.max_context)
            return head, action_ids[-room:], len(anchor_ids)
        tail_budget = max_prefix - len(head)
        if tail_budget > 0:
            start = total - tail_budget
            if self.truncation == "window":
                start = self._window_start(start, total, tail_budget, len(head))
            if hidden and start - hidden < visible_from:
                raise NeedWhole
            return head + prefix_ids[start - hidden :], action_ids, len(anchor_ids) + total - start
        # a baseline scorer's anchor that does not fit: its start (no block to lose)
        kept = anchor_ids[: max(max_prefix - len(marker), 0)]
        return (kept + marker)[:max_prefix], action_ids, len(kept)

    def _window_start(self, sliding_start: int, prefix_len: int, tail_budget: int, head: int) -> int:
        """The smallest block boundary at or after the sliding start; the sliding start when
        that would leave less than half of this step's tail budget as recent context.

        The block depends only on ``max_context`` and the anchor (the same for every step of
        one hindsight block), never on the step, so steps share their window start."""
        block = max((self.max_context - head) // WINDOW_BLOCK_FRACTION, 1)
        start = -(-sliding_start // block) * block
        return start if prefix_len - start >= tail_budget / 2 else sliding_start
