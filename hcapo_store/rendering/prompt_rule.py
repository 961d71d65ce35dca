"""The per-step prompt rule, stated plainly: what a step's two texts are (docs/SCORING.md).

For step ``m`` (an assistant message) a prompt mode gives two texts: the **prefix**, the
messages before the action rendered with a generation prompt, and the **full** text, the same
messages and the action rendered without one. The prompt builder tokenizes both and cuts the
prefix's ids to ``max_context`` (prompts.py, ``PromptBuilder._finish``).

- ``sliding`` and ``window``: :func:`whole_history`, the step's whole history.
- ``turns``: :func:`whole_turns`, the head and the most recent whole turns that fit.

These are the slow reference: every candidate is rendered with the chat template and
tokenized from scratch, and nothing is remembered between steps. The fast strategies
(bounded.py for long ``sliding``/``window`` sessions, step_edits.py for a step's renders made
from the previous step's, turn_windows.py for ``turns``, segments.py's cached pieces for
tokenizing) are meant to give the same ids: they are tested against these on sampled sessions
(tests/test_prompt_rule.py, tests/test_bounded_history.py, tests/test_step_edits.py,
tests/test_turns_truncation.py, tests/test_differential.py) and checked against them at run
time by verify.py's policies; ``HCAPO_RENDERING=reference`` uses these alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hcapo_store.rendering.hindsight import inject_hindsight
from hcapo_store.rendering.messages import flatten_messages, own_text
from hcapo_store.rendering.template import TemplateRejected

TRUNCATION_MARKER = "\n\n[... earlier trajectory context truncated; hindsight outcome preserved above ...]\n\n"


class Render(Protocol):
    """The chat template's text of ``messages``; raises TemplateRejected when it refuses them."""

    def __call__(self, messages: list[dict], *, generation: bool) -> str: ...


Encode = Callable[[str], list[int]]


@dataclass
class RenderedStep:
    """One step's two renders: ``messages`` is what was rendered, the action last."""

    prefix_text: str
    full_text: str
    messages: list[dict]
    flattened: bool
    dropped: int = 0  # --truncation turns: own-text ids of the turns left out
    # a bounded render (bounded.py): the whole history's prefix ids between the head and the
    # window, counted and not rendered; a tail may start no earlier than visible_from
    hidden: int = 0
    visible_from: int = 0
    bounded: Any = None  # bounded.BoundedStep: what moves its chain on once the ids are known
    # the messages rendered with the action an empty assistant turn (own_tokens.EMPTY_TURN), when a
    # fast path made it beside the two texts (step_edits.py); None: the caller renders it
    empty_text: str | None = None


def render_pair(render: Render, messages: list[dict], flattened: bool) -> RenderedStep:
    """``messages`` rendered without their last one (with a generation prompt) and whole."""
    return RenderedStep(render(messages[:-1], generation=True), render(messages, generation=False), messages, flattened)


# How a fast path makes a step's two renders of its window (the action last, its head
# ``head_end`` messages long): equal to render_pair's (step_edits.py edits the previous step's)
Pair = Callable[[list[dict], int, bool], RenderedStep]


def whole_pair(render: Render) -> Pair:
    """The rule as a :data:`Pair`: every window rendered whole (render_pair)."""
    return lambda window, head_end, flattened: render_pair(render, window, flattened)


def check_step(raw: Sequence[Mapping[str, Any]], m: int) -> None:
    if not 0 < m < len(raw) or raw[m].get("role") != "assistant":
        raise TemplateRejected(f"message {m} is not an assistant message after the first message")


# --------------------------------------------------------------------------- sliding, window


def whole_history(
    render: Render,
    raw: Sequence[Mapping[str, Any]],
    normalized: Sequence[dict],
    m: int,
    hindsight: str | None,
    pair: Pair | None = None,
) -> RenderedStep:
    """The rule of ``sliding`` and ``window``: the step's whole history, the hindsight block in
    the first message; flattened (tool traffic as text) when the template rejects it. ``pair``:
    a fast path's two renders of it (None: render_pair)."""
    check_step(raw, m)
    pair = pair or whole_pair(render)
    try:
        return pair(inject_hindsight(normalized[: m + 1], hindsight), head_end_of(normalized), False)
    except TemplateRejected:
        flat = flatten_messages(inject_hindsight(raw[: m + 1], hindsight))
        return pair(flat, head_end_of(flat), True)


# --------------------------------------------------------------------------- turns


def head_end_of(messages: Sequence[Mapping[str, Any]]) -> int:
    """Where the head ends: after the first user message (the first message without one)."""
    return next((i + 1 for i, m in enumerate(messages) if m.get("role") == "user"), 1)


def window_starts(messages: Sequence[Mapping[str, Any]], head_end: int) -> list[int]:
    """The messages a window may start at: after the head, never a tool result."""
    return [i for i in range(head_end, len(messages)) if messages[i].get("role") != "tool"]


def marked_head(head: list[dict]) -> list[dict]:
    """The head announcing that turns were left out: the marker ends its last message."""
    return [*head[:-1], dict(head[-1], content=(head[-1].get("content") or "") + TRUNCATION_MARKER.rstrip())]


def whole_turns(
    render: Render,
    encode: Encode,
    raw: Sequence[Mapping[str, Any]],
    normalized: Sequence[dict],
    m: int,
    hindsight: str | None,
    max_context: int,
) -> RenderedStep:
    """The rule of ``turns``: flattened when the template rejects the messages as they are."""
    check_step(raw, m)
    try:
        return _turns(render, encode, normalized, m, hindsight, max_context, False)
    except TemplateRejected:
        return _turns(render, encode, flatten_messages(raw), m, hindsight, max_context, True)


def _turns(
    render: Render,
    encode: Encode,
    messages: Sequence[dict],
    m: int,
    hindsight: str | None,
    max_context: int,
    flattened: bool,
) -> RenderedStep:
    """Step ``m`` over the head (through the first user message, the hindsight block in the
    first message) and the turns from the **earliest** start whose prefix, with the action's
    ids, fits ``max_context``; the latest start (the head and the action) when none does. The
    action's ids are those of that shortest window (its full render's ids past its prefix's).
    A window that leaves turns out ends the head with the truncation marker; ``dropped``
    counts the left-out turns' own words in ids."""
    head_end = head_end_of(messages)
    starts = [s for s in window_starts(messages, head_end) if s <= m]
    if not starts:  # the step is inside the head: nothing to leave out
        return render_pair(render, inject_hindsight(messages[: m + 1], hindsight), flattened)
    head = inject_hindsight(messages[:head_end], hindsight)
    marked = marked_head(head)

    def window(n: int) -> list[dict]:
        return [*(head if n == 0 else marked), *messages[starts[n] : m + 1]]

    last = len(starts) - 1
    action = len(encode(render(window(last), generation=False))) - len(
        encode(render(window(last)[:-1], generation=True))
    )
    budget = max_context - action
    n = 0
    while n < last and len(encode(render(window(n)[:-1], generation=True))) > budget:
        n += 1
    dropped = sum(len(encode(own_text(message))) for message in messages[head_end : starts[n]])
    return RenderedStep(
        render(window(n)[:-1], generation=True), render(window(n), generation=False), window(n), flattened, dropped
    )
