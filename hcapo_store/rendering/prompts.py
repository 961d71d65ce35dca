"""Per-step hindsight prompts with exact token spans (docs/SCORING.md; docs/ORIGINAL.md §2 for the original's).

For step t (assistant message m) the request is ``prefix + action`` where
``prefix = render(messages[:m] with the hindsight block in message 0, add_generation_prompt=True)``
and ``full = render(messages[:m + 1])``; both texts are tokenized with
``add_special_tokens=False`` and the action is ``full_ids[len(prefix_ids):]``.

Two implementations produce the same ids:

* :meth:`PromptBuilder.build_step_reference` renders and tokenizes both texts from scratch,
  which is what the original ``_build_prompt_pair`` did (minus its bugs, see below);
* :meth:`PromptBuilder.build_episode` renders the same texts but tokenizes them through
  :class:`SegmentEncoder`, which reuses the ids of the text shared with the previous render
  and caches the ids of every text segment between added tokens.

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

import bisect
import functools
import hashlib
import logging
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hcapo_store.rendering.own_tokens import EMPTY_TURN, NotOwn, OwnTokenLocator
from hcapo_store.rendering.requests import FailureReason, PromptFailure, StepPrompt
from hcapo_store.rendering.segments import RenderState, SegmentEncoder
from hcapo_store.rendering.template import PlainCache, TemplateRejected, render_chat
from hcapo_store.tool_arguments import arguments_text, as_mapping

PROMPT_BUILDER_VERSION = 1

log = logging.getLogger(__name__)

HINDSIGHT_TEMPLATE = """\
[HINDSIGHT — This is post-hoc scoring context, not visible during generation]
Trajectory outcome:
- Final reward: {reward:.4f}
- Phase reached: {phase}
- Plan score: {plan_score}
- Subtask scores: {scores_summary}
- Subtasks completed: {scored_count}/{plan_count}
- Current subtask: {current_subtask}
- Current subtask score: {current_subtask_score}"""

# The episode layout (rendering/episode_layout.py) has one hindsight block per episode: the
# outcome, without the per-step "current subtask" lines, which have no single value there.
EPISODE_HINDSIGHT_TEMPLATE = HINDSIGHT_TEMPLATE.split("\n- Current subtask:")[0]
PER_STEP_PLACEHOLDERS = ("current_subtask", "current_subtask_score")

TRUNCATION_MARKER = "\n\n[... earlier trajectory context truncated; hindsight outcome preserved above ...]\n\n"

DEFAULT_MAX_CONTEXT = 32768
DEFAULT_MAX_LOGPROB_TOKENS = 2048

ActionSpan = Literal["rendered", "policy"]
ACTION_SPANS: tuple[ActionSpan, ...] = ("rendered", "policy")
Truncation = Literal["sliding", "window", "turns"]
TRUNCATIONS: tuple[Truncation, ...] = ("sliding", "window", "turns")
# --truncation window: the window start moves in blocks of this fraction of the tail budget.
WINDOW_BLOCK_FRACTION = 4
# --truncation turns: the template markup a message adds to its own text, roughly, in ids,
# when a session has no earlier turn to measure it on; it only places the first window tried.
TURN_OVERHEAD_TOKENS = 8
# --truncation sliding/window over a long session: once a step's rendered history passes
# BOUND_START x max_context ids, later steps render the head and the messages from a later
# start on, about BOUND_TARGET x max_context ids of them, moved on again whenever a window
# passes BOUND_ADVANCE x max_context (PromptBuilder._advance). The first bound is higher:
# below it a window saves less than checking it costs.
BOUND_START = 1.6
BOUND_ADVANCE = 1.35
BOUND_TARGET = 1.1
PromptLayout = Literal["per-step", "episode"]
PROMPT_LAYOUTS: tuple[PromptLayout, ...] = ("per-step", "episode")


# --------------------------------------------------------------------------- hindsight


def template_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_field(obj: Any, name: str, default: Any = None) -> Any:
    """Outcomes and steps arrive as dicts or as dataclasses/ORM rows."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def hindsight_text(outcome: Any, step: Any, template: str = HINDSIGHT_TEMPLATE) -> str:
    """Fill the hindsight block the way the original ``build_hindsight_info`` did.

    A null ``plan_score`` prints as ``0`` (the store's rule: null counts as 0 where a number is needed; docs/ORIGINAL.md Q11).
    """
    frozen: Mapping[str, float] = read_field(outcome, "frozen_scores") or {}
    plan = read_field(outcome, "plan") or frozen
    plan_score = read_field(outcome, "plan_score")
    score = read_field(step, "subtask_reward")
    return template.format(
        reward=float(read_field(outcome, "reward")),
        phase=read_field(outcome, "phase") or "?",
        plan_score=0 if plan_score is None else plan_score,
        scores_summary=", ".join(f"{k}={v:.3f}" for k, v in frozen.items()) or "none",
        scored_count=len(frozen),
        plan_count=max(len(plan), 1),
        current_subtask=read_field(step, "subtask_id") or read_field(step, "phase"),
        current_subtask_score=f"{score:.3f}" if score is not None and score >= 0 else "n/a",
    )


# The fields ``hindsight_text`` fills, in the order of the default template.
HINDSIGHT_PLACEHOLDERS = (
    "reward",
    "phase",
    "plan_score",
    "scores_summary",
    "scored_count",
    "plan_count",
    "current_subtask",
    "current_subtask_score",
)


def layout_template(template: str, layout: PromptLayout) -> str:
    """The hindsight template a layout uses: the episode layout's default drops the per-step lines."""
    return EPISODE_HINDSIGHT_TEMPLATE if layout == "episode" and template == HINDSIGHT_TEMPLATE else template


def check_hindsight_template(template: str, layout: PromptLayout = "per-step") -> None:
    """Fail at configuration time, not at step 57, when a user template has unknown fields
    (or, for the episode layout, per-step fields that have no value there)."""
    names = [n for n in HINDSIGHT_PLACEHOLDERS if layout == "per-step" or n not in PER_STEP_PLACEHOLDERS]
    allowed = "allowed placeholders: " + ", ".join(f"{{{name}}}" for name in names)
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # e.g. a single "{" or "}"
        raise ValueError(
            f"hindsight template cannot be parsed ({exc}; write {{{{ and }}}} for literal braces); {allowed}"
        ) from exc
    unknown = [f for f in fields if f.split(".")[0].split("[")[0] not in names]
    if layout == "episode" and any(f.split(".")[0].split("[")[0] in PER_STEP_PLACEHOLDERS for f in fields):
        raise ValueError(
            "the episode layout has one hindsight block per episode, so {current_subtask} and "
            "{current_subtask_score} have no value there; leave them out of the template, or use "
            f"--prompt-layout per-step; {allowed}"
        )
    if unknown:
        raise ValueError(
            f"hindsight template has unknown placeholder(s) {', '.join('{' + f + '}' for f in unknown)}; {allowed}"
        )
    try:
        hindsight_text(
            {"reward": 0.0, "phase": "p", "plan_score": 0.0, "frozen_scores": {"S1": 0.0}},
            {"subtask_id": "S1", "phase": "executing", "subtask_reward": 0.0},
            template,
        )
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"hindsight template cannot be filled: {exc!r}; {allowed}") from exc


def inject_hindsight(messages: Sequence[Mapping[str, Any]], hindsight: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``hindsight`` appended to the first one's content (None: the plain
    conversation, for the baseline scorer π(a|s) of ``score --no-hindsight``). The first
    message is a copy; the others are the same objects (nothing changes a message once built,
    and renders recognise the messages they have already checked: template.py)."""
    out: list[dict[str, Any]] = [dict(m) for m in messages[:1]]
    if hindsight is not None and out:
        out[0]["content"] = (out[0].get("content") or "") + "\n\n" + hindsight
    # the rest as given: the stored, normalized and flattened messages are dicts
    return out + [m if isinstance(m, dict) else dict(m) for m in messages[1:]]


# --------------------------------------------------------------------------- messages


def _parse_arguments(arguments: Any) -> Any:
    """JSON-object strings become mappings (templates `tojson` or iterate them); others stay."""
    parsed = as_mapping(arguments)
    return arguments if parsed is None else parsed


def normalize_message(message: Mapping[str, Any]) -> dict:
    """A template-ready copy: None values dropped, tool-call arguments as mappings."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            call = dict(call)
            function = dict(call.get("function") or {})
            if "arguments" in function:
                function["arguments"] = _parse_arguments(function["arguments"])
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    return [normalize_message(m) for m in messages]


def flatten_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The original's fallback: tool traffic as plain text, for templates that reject it."""
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "tool":
            out.append(
                {
                    "role": "user",
                    "content": f"[Tool Result: {m.get('name', 'tool')}]\n{m.get('content', '')}",
                }
            )
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            for call in m["tool_calls"]:
                function = call.get("function", {})
                parts.append(f"[Tool Call: {function.get('name', '?')}]\n{arguments_text(function.get('arguments'))}")
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append(dict(m))
    return out


# --------------------------------------------------------------------------- building


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


@dataclass
class _Chain:
    """Per-step sliding/window over one long session: steps render the head and the messages
    from ``start`` on; the ids the whole history has between them were counted once, when the
    chain moved there, as the difference of two renders of one step (PromptBuilder._advance)."""

    start: int  # a window's first message after the head (the head's end: the whole history)
    hidden: int  # ids of messages[head_end:start] in the whole history's render
    last: int  # the message index of the last step rendered on this chain


@dataclass
class _Bounded:
    """What a step rendered on a chain needs after its ids are known, to move the chain on."""

    messages: Sequence[dict]
    head_end: int
    m: int
    hindsight: str | None
    flattened: bool
    chain: _Chain


@dataclass
class _Rendered:
    """One step's two renders: ``messages`` is what was rendered, the action last."""

    prefix_text: str
    full_text: str
    messages: list[dict]
    flattened: bool
    dropped: int = 0  # --truncation turns: own-text ids of the turns left out
    hidden: int = 0  # a bounded render: see _StepTexts
    visible_from: int = 0
    bounded: _Bounded | None = None


class _NeedWhole(Exception):
    """A bounded render cannot give this step's prompt (it fits whole, or its tail reaches
    back past the window): render the step's whole history instead."""


def _own_text(message: Mapping[str, Any]) -> str:
    """A message's own words (content, reasoning, tool calls), without template markup."""
    parts = []
    for name in ("content", "reasoning_content"):
        value = message.get(name)
        if value is not None:
            parts.append(value if isinstance(value, str) else repr(value))
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        parts.append(f"{function.get('name', '')} {arguments_text(function.get('arguments'))}")
    return "\n".join(parts)


@dataclass
class _TurnIndex:
    """--truncation turns, per episode: where windows may start and each turn's own ids."""

    head_end: int  # messages[:head_end] are always kept: through the first user message
    starts: list[int]  # message indices that may start a window, ascending (never a tool result)
    cum: list[int]  # cum[i]: the own-text ids of messages[:i]

    @staticmethod
    def head_of(messages: Sequence[Mapping[str, Any]]) -> int:
        """Where the head ends: after the first user message (the first message without one)."""
        return next((i + 1 for i, m in enumerate(messages) if m.get("role") == "user"), 1)

    @staticmethod
    def starts_of(messages: Sequence[Mapping[str, Any]], head_end: int) -> list[int]:
        """The messages a window may start at: after the head, never a tool result."""
        return [i for i in range(head_end, len(messages)) if messages[i].get("role") != "tool"]

    @classmethod
    def of(cls, messages: Sequence[Mapping[str, Any]], encoder: SegmentEncoder) -> _TurnIndex:
        head_end = cls.head_of(messages)
        cum = [0]
        for n in encoder.count([_own_text(m) for m in messages]):
            cum.append(cum[-1] + n)
        return cls(head_end, cls.starts_of(messages, head_end), cum)

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


@dataclass
class _EpisodeMemo:
    """What build_episode keeps while it builds one episode's steps."""

    turns: dict[bool, _TurnIndex] = field(default_factory=dict)  # by flattened
    flat: list[dict] | None = None
    # sliding/window: render long histories bounded (False: every step renders its whole history)
    bounded: bool = False
    chains: dict[bool, _Chain] = field(default_factory=dict)  # by flattened
    heads: dict[tuple[str | None, bool], str] = field(default_factory=dict)  # the head's render
    # per window start: the window render's text up to where a tail may start, and its ids
    visible: dict[tuple[str | None, bool, int], tuple[str, int]] = field(default_factory=dict)
    breaks: list[int] | None = None  # see PromptBuilder._breaks
    sizes: dict[bool, tuple[list[int], list[int]]] = field(default_factory=dict)  # see PromptBuilder._sizes
    unbounded: str | None = None  # why bounded renders stopped in this episode

    def stop_bounding(self, reason: str) -> None:
        self.bounded, self.unbounded = False, reason


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
    ) -> None:
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
        self.encoder = SegmentEncoder(tokenizer)
        self._known: PlainCache | None = None  # set while build_episode renders one episode
        self._episode: _EpisodeMemo | None = None  # likewise
        self._probe_state = self.encoder.new_state()  # --truncation turns: candidate windows
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
        self._locator = OwnTokenLocator(tokenizer, self.encoder)
        if action_span == "policy" and not self._locator.available:
            raise ValueError("action_span 'policy' needs a fast tokenizer (character offsets)")
        if layout == "episode" and not self._locator.available:
            raise ValueError("the episode layout needs a fast tokenizer (character offsets)")

    def anchor_ids(self, first: dict) -> list[int]:
        """The first message (hindsight block included) alone: what a truncated prompt keeps."""
        return self.encoder.encode_once(self._render([first], generation=False))

    @property
    def thread_safe(self) -> bool:
        """Whether episodes may be prepared in several threads at once: the episode layout
        keeps no token cache and, on the fast path, tokenizes through the backend only."""
        return self.layout == "episode" and self.encoder.fast_path_off_reason is None

    @functools.cached_property
    def top_token_id(self) -> int:
        """The tokenizer's largest id (its vocabulary is a 150k-entry dict: read once)."""
        return int(max(self.tokenizer.get_vocab().values()))

    @property
    def marker_ids(self) -> list[int]:
        return self._marker_ids

    # -- rendering, shared by both paths: only tokenization differs

    def _render(self, messages: list[dict], *, generation: bool) -> str:
        return render_chat(self.tokenizer, messages, generation=generation, known=self._known)

    def _render_pair(
        self,
        raw: Sequence[Mapping[str, Any]],
        normalized: Sequence[dict],
        m: int,
        hindsight: str | None,
        whole: bool = False,
    ) -> _Rendered:
        """The prefix and full texts of step ``m``; flattens when the template rejects.
        ``whole``: sliding/window render the step's whole history, never a bounded window."""
        if self.truncation == "turns":
            return self._render_turns(raw, normalized, m, hindsight)
        if not whole and self._episode is not None and self._episode.bounded:
            try:
                return self._render_bounded(raw, normalized, m, hindsight, False)
            except TemplateRejected:
                return self._render_bounded(raw, self._flat_messages(raw), m, hindsight, True)
        try:
            return self._render_whole(inject_hindsight(normalized[: m + 1], hindsight), False)
        except TemplateRejected:
            return self._render_whole(flatten_messages(inject_hindsight(raw[: m + 1], hindsight)), True)

    def _render_whole(self, messages: list[dict], flattened: bool) -> _Rendered:
        """``messages`` rendered without their last one (with a generation prompt) and whole."""
        return _Rendered(
            self._render(messages[:-1], generation=True), self._render(messages, generation=False), messages, flattened
        )

    # -- --truncation turns: a bounded window of whole turns per step (linear in the session)

    def _render_turns(
        self, raw: Sequence[Mapping[str, Any]], normalized: Sequence[dict], m: int, hindsight: str | None
    ) -> _Rendered:
        try:
            return self._turn_window(self._turn_index(normalized, False), normalized, m, hindsight, False)
        except TemplateRejected:
            flat = self._flat_messages(raw)
            return self._turn_window(self._turn_index(flat, True), flat, m, hindsight, True)

    def _flat_messages(self, raw: Sequence[Mapping[str, Any]]) -> list[dict]:
        episode = self._episode
        if episode is None:
            return flatten_messages(raw)
        if episode.flat is None:
            episode.flat = flatten_messages(raw)
        return episode.flat

    def _turn_index(self, messages: Sequence[dict], flattened: bool) -> _TurnIndex:
        episode = self._episode
        if episode is not None and episode.turns.get(flattened) is not None:
            return episode.turns[flattened]
        index = _TurnIndex.of(messages, self.encoder)
        if episode is not None:
            episode.turns[flattened] = index
        return index

    def _turn_window(
        self, index: _TurnIndex, messages: Sequence[dict], m: int, hindsight: str | None, flattened: bool
    ) -> _Rendered:
        """Step ``m``'s texts over the head (through the first user message, the hindsight block
        in the first message) and the turns from the earliest start whose prompt, action
        included, fits ``max_context``: a rendering of a shorter conversation, never a cut
        through a turn. Turns leave whole (a tool result never starts a window) and their
        leaving is announced by the truncation marker at the end of the head.

        Exact and linear: every candidate is judged on its real render, and the first
        candidate tried is guessed from the turns' own token counts, so a step renders three
        windows of at most ``max_context`` (the guess, its neighbour, the full turn) instead
        of its whole history. A step's window depends on nothing but the step."""
        count = index.starts_until(m)
        starts = index.starts
        if not count:  # the step is inside the head: nothing to leave out
            return self._render_whole(inject_hindsight(messages[: m + 1], hindsight), flattened)
        head = inject_hindsight(messages[: index.head_end], hindsight)
        marked = [*head[:-1], dict(head[-1], content=(head[-1].get("content") or "") + TRUNCATION_MARKER.rstrip())]
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
        n = index.first_fit(count, m, budget - prefix_len(last), overhead)
        if prefix_len(n) <= budget:
            while n > 0 and prefix_len(n - 1) <= budget:
                n -= 1
        else:
            while n < last and prefix_len(n) > budget:
                n += 1
        full = shortest_full if n == last else self._render(window(n), generation=False)
        dropped = index.cum[starts[n]] - index.cum[index.head_end]
        return _Rendered(prefixes[n][0], full, window(n), flattened, dropped)

    # -- sliding/window over a long session: bounded renders, the history between counted

    def _breaks(self, raw: Sequence[Mapping[str, Any]]) -> list[int]:
        """``breaks[i]``: how many of ``raw[:i]`` are neither assistant turns nor tool results
        (as given: a flattened tool result is still one). A chain never reaches across one: a
        template may render earlier turns anew after a user turn (Qwen3 drops the reasoning of
        the turns before the last user query)."""
        memo = self._episode
        assert memo is not None
        if memo.breaks is None:
            memo.breaks = [0]
            for message in raw:
                memo.breaks.append(memo.breaks[-1] + (message.get("role") not in ("assistant", "tool")))
        return memo.breaks

    def _sizes(self, messages: Sequence[dict], flattened: bool, head_end: int) -> tuple[list[int], list[int]]:
        """The messages a window may start at (after the head, never a tool result) and the
        cumulative characters of the messages' own words: what window starts are guessed from."""
        memo = self._episode
        assert memo is not None
        if flattened not in memo.sizes:
            chars = [0]
            for message in messages:
                chars.append(chars[-1] + len(_own_text(message)))
            memo.sizes[flattened] = (_TurnIndex.starts_of(messages, head_end), chars)
        return memo.sizes[flattened]

    def _head_text(self, head: list[dict], hindsight: str | None, flattened: bool) -> str:
        memo = self._episode
        assert memo is not None
        key = (hindsight, flattened)
        if key not in memo.heads:
            memo.heads[key] = self._render(head, generation=False)
        return memo.heads[key]

    def _visible_from(self, text: str, head: list[dict], hindsight: str | None, flattened: bool, start: int) -> int:
        """How many of the window render's ids precede the first one a tail may start at: past
        the head's render and one added token clear of it, so from there on the window's ids
        are the whole history's (segments.py: settled_cut). Raises _NeedWhole when the window
        render does not begin with the head's own render (a template that renders the head
        according to what follows it: nothing can be counted then)."""
        memo = self._episode
        assert memo is not None
        key = (hindsight, flattened, start)
        known = memo.visible.get(key)
        if known is not None and text.startswith(known[0]):
            return known[1]
        head_text = self._head_text(head, hindsight, flattened)
        cut = self.encoder.settled_cut(text, len(head_text)) if text.startswith(head_text) else None
        if cut is None:
            memo.stop_bounding("the template renders the first messages differently when turns are left out")
            raise _NeedWhole
        memo.visible[key] = (text[:cut], len(self.encoder.encode_once(text[:cut])))
        return memo.visible[key][1]

    def _render_bounded(
        self, raw: Sequence[Mapping[str, Any]], messages: Sequence[dict], m: int, hindsight: str | None, flattened: bool
    ) -> _Rendered:
        """Step ``m`` on its chain: the whole history while the chain starts at the head's end,
        else the head (through the first user message, the hindsight block in the first) and the
        messages from the chain's start to the action. The ids between them are the chain's
        ``hidden`` count, so the prompt's tail and length are the whole history's without
        rendering it. A step after a user turn (or the first of a build) starts a new chain
        from the head's end."""
        memo = self._episode
        assert memo is not None
        breaks = self._breaks(raw)
        head_end = _TurnIndex.head_of(messages)
        chain = memo.chains.get(flattened)
        if chain is None or not chain.last < m or not chain.start < m or breaks[m] != breaks[chain.last]:
            chain = memo.chains[flattened] = _Chain(head_end, 0, m)
        chain.last = m
        step = _Bounded(messages, head_end, m, hindsight, flattened, chain)
        if chain.start <= head_end:
            rendered = self._render_whole(inject_hindsight(messages[: m + 1], hindsight), flattened)
        else:
            head = inject_hindsight(messages[:head_end], hindsight)
            rendered = self._render_whole([*head, *messages[chain.start : m + 1]], flattened)
            rendered.visible_from = self._visible_from(rendered.prefix_text, head, hindsight, flattened, chain.start)
            rendered.hidden = chain.hidden
        rendered.bounded = step
        return rendered

    def _advance(self, step: _Bounded, prefix_len: int) -> None:
        """Move the chain of a step whose prefix passed BOUND_START (a whole history) or
        BOUND_ADVANCE (a window) x max_context ids to the latest start that leaves about
        BOUND_TARGET x max_context ids of messages (guessed from their characters, then
        rendered: at least max_context ids must follow the head, so any tail fits). The ids
        between the old start and the new one are this step's two renders' difference: the
        whole history's length stays known."""
        memo, chain, m = self._episode, step.chain, step.m
        bound = BOUND_START if chain.start <= step.head_end else BOUND_ADVANCE
        if memo is None or not memo.bounded or prefix_len <= bound * self.max_context:
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
            except (TemplateRejected, _NeedWhole):
                return
            ids = len(self.encoder.encode(text, self._probe_state))
            if ids - visible >= self.max_context:
                chain.start, chain.hidden = start, chain.hidden + prefix_len - ids
                return
            if k == lo:
                return
            k = max(lo, k - (hi - k))  # too few ids: twice the messages

    def _check_bounded(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        outcome: Any,
        steps: Sequence[Any],
        results: list[StepPrompt | PromptFailure],
        bounded: list[int],
    ) -> str | None:
        """Compare the steps built on bounded renders with their whole-history build, at the
        last one and halving back to the first (cost: about four renders of the whole session,
        a prefix and a full one per build, the halving doubling the last one's).
        A count that went wrong stays wrong for the rest of its chain, so the last step sees
        it. Returns what differed, or None."""
        picks, n = set(), len(bounded) - 1
        while n > 0:
            picks.add(n)
            n //= 2
        picks.add(0)

        def encode(text: str) -> list[int]:  # through the episode's cached pieces
            return self.encoder.encode(text, self.encoder.new_state())

        for n in sorted(picks, reverse=True):
            position = bounded[n]
            exact = self._exact_step(messages, normalized, outcome, steps[position], encode)
            if exact != results[position]:
                return f"step {read_field(steps[position], 'step_index')} differs from its whole-history build"
        return None

    # -- public entry points

    def build_episode(
        self, messages: Sequence[Mapping[str, Any]], outcome: Any, steps: Sequence[Any]
    ) -> list[StepPrompt | PromptFailure]:
        normalized = normalize_messages(messages)
        # Each message is rendered again for every later step: whether it is plain JSON data
        # is checked once per episode (the normalized messages do not change meanwhile).
        self._known = {}
        try:
            self._episode = _EpisodeMemo(bounded=self._can_bound)
            results, bounded = self._build_steps(messages, normalized, outcome, steps)
            reason = self._episode.unbounded
            mismatch = self._check_bounded(messages, normalized, outcome, steps, results, bounded) if bounded else None
            if mismatch is not None:
                # Never store a prompt on trust: build every step on its whole history.
                reason = mismatch
                self._episode = _EpisodeMemo()
                results, bounded = self._build_steps(messages, normalized, outcome, steps)
            self.bounded_steps += len(bounded)
            if reason is not None:
                self.whole_history_episodes += 1
                log.info("a long session's steps render their whole history (%s)", reason)
        finally:
            self.encoder.pieces.clear()  # segments rarely repeat across episodes; keep memory flat
            self._known = None
            self._episode = None
        return results

    def _build_steps(
        self, messages: Sequence[Mapping[str, Any]], normalized: list[dict], outcome: Any, steps: Sequence[Any]
    ) -> tuple[list[StepPrompt | PromptFailure], list[int]]:
        """Every step's result, and the positions of those built on a bounded render."""
        states: dict[tuple[str | None, bool], tuple[RenderState, RenderState]] = {}
        anchors: dict[tuple[str, bool], list[int]] = {}
        results: list[StepPrompt | PromptFailure] = []
        bounded: list[int] = []
        for step in steps:
            args = (messages, normalized, step, self._hindsight(outcome, step), states, anchors)
            try:
                try:
                    result, hidden = self._episode_step(*args, whole=False)
                except _NeedWhole:
                    result, hidden = self._episode_step(*args, whole=True)
            except TemplateRejected as exc:
                result, hidden = PromptFailure(read_field(step, "step_index"), "template", str(exc)), 0
            if hidden:
                bounded.append(len(results))
            results.append(result)
        return results, bounded

    def _episode_step(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        step: Any,
        hindsight: str | None,
        states: dict[tuple[str | None, bool], tuple[RenderState, RenderState]],
        anchors: dict[tuple[str, bool], list[int]],
        *,
        whole: bool,
    ) -> tuple[StepPrompt | PromptFailure, int]:
        index, m = read_field(step, "step_index"), read_field(step, "message_index")
        rendered = self._render_step(messages, normalized, m, hindsight, whole=whole)
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
            self._advance(rendered.bounded, len(texts.prefix_ids))
        texts.own = self._own_span(rendered, texts)
        result = self._finish(index, texts, lambda key=key, first=first: self._anchor(anchors, key, first))
        return result, rendered.hidden

    def build_step(self, messages: Sequence[Mapping[str, Any]], outcome: Any, step: Any) -> StepPrompt | PromptFailure:
        return self.build_episode(messages, outcome, [step])[0]

    def build_step_reference(
        self, messages: Sequence[Mapping[str, Any]], outcome: Any, step: Any
    ) -> StepPrompt | PromptFailure:
        """The straightforward render + tokenize of everything, for tests and benchmarks."""
        return self._exact_step(messages, normalize_messages(messages), outcome, step, self.encoder.encode_whole)

    def _exact_step(
        self,
        messages: Sequence[Mapping[str, Any]],
        normalized: list[dict],
        outcome: Any,
        step: Any,
        encode: Callable[[str], list[int]],
    ) -> StepPrompt | PromptFailure:
        """A step built on its whole history's renders, each text tokenized on its own."""
        index, m = read_field(step, "step_index"), read_field(step, "message_index")
        hindsight = self._hindsight(outcome, step)
        try:
            rendered = self._render_step(messages, normalized, m, hindsight, whole=True)
        except TemplateRejected as exc:
            return PromptFailure(index, "template", str(exc))
        texts = _StepTexts(
            encode(rendered.prefix_text), encode(rendered.full_text), rendered.flattened, rendered.dropped
        )
        texts.own = self._own_span(rendered, texts)
        first = rendered.messages[0]
        return self._finish(index, texts, lambda: encode(self._render([first], generation=False)))

    def _hindsight(self, outcome: Any, step: Any) -> str | None:
        return hindsight_text(outcome, step, self.hindsight_template) if self.hindsight else None

    # -- span logic, shared by both paths

    def _own_span(self, rendered: _Rendered, texts: _StepTexts) -> tuple[int, int] | str | None:
        """action_span "policy": the policy's own tokens among the action ids (own_tokens.py)."""
        if self.action_span != "policy":
            return None
        messages, prefix_text, full_text = rendered.messages, rendered.prefix_text, rendered.full_text
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

    def _render_step(
        self, raw: Sequence[Mapping[str, Any]], normalized: list[dict], m: int, hindsight: str | None, *, whole: bool
    ) -> _Rendered:
        if not 0 < m < len(raw) or raw[m].get("role") != "assistant":
            raise TemplateRejected(f"message {m} is not an assistant message after the first message")
        return self._render_pair(raw, normalized, m, hindsight, whole)

    def _anchor(self, anchors: dict[tuple[str, bool], list[int]], key: tuple[str, bool], first: dict) -> list[int]:
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
            kept_prefix, kept_action = self._truncate(prefix_ids, action_ids, anchor, texts.hidden, texts.visible_from)
        except TemplateRejected as exc:
            return PromptFailure(index, "template", f"anchor: {exc}")
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
            truncated_prefix_tokens=prefix_len + texts.hidden - len(kept_prefix) + texts.dropped,
            flattened=texts.flattened,
        )

    def _truncate(
        self, prefix_ids: list[int], action_ids: list[int], anchor: Any, hidden: int = 0, visible_from: int = 0
    ) -> tuple[list[int], list[int]]:
        """The original's truncation, on ids: anchor + marker + recent prefix tail + action.

        ``window``: the tail starts at a multiple of a block instead, so consecutive steps
        keep the same start and their prompts stay prefixes of one another (one request).
        ``hidden``: the prefix is a bounded render, ``hidden`` ids of the whole history left
        out after its head; the tail must then start at ``visible_from`` or later."""
        total = len(prefix_ids) + hidden
        if total + len(action_ids) <= self.max_context:
            if hidden:
                raise _NeedWhole
            return prefix_ids, action_ids
        max_prefix = self.max_context - len(action_ids)
        if max_prefix <= 0:
            return [], action_ids[-self.max_context :]
        anchor_ids: list[int] = anchor()
        marker = self._marker_ids
        tail_budget = max_prefix - len(anchor_ids) - len(marker)
        if tail_budget > 0:
            start = total - tail_budget
            if self.truncation == "window":
                start = self._window_start(start, total, tail_budget, len(anchor_ids) + len(marker))
            if hidden and start - hidden < visible_from:
                raise _NeedWhole
            return anchor_ids + marker + prefix_ids[start - hidden :], action_ids
        kept = anchor_ids[: max(max_prefix - len(marker), 0)] + marker
        return kept[:max_prefix], action_ids

    def _window_start(self, sliding_start: int, prefix_len: int, tail_budget: int, head: int) -> int:
        """The smallest block boundary at or after the sliding start; the sliding start when
        that would leave less than half of this step's tail budget as recent context.

        The block depends only on ``max_context`` and the anchor (the same for every step of
        one hindsight block), never on the step, so steps share their window start."""
        block = max((self.max_context - head) // WINDOW_BLOCK_FRACTION, 1)
        start = -(-sliding_start // block) * block
        return start if prefix_len - start >= tail_budget / 2 else sliding_start
