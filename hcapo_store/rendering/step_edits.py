"""A step's two renders made from the previous step's, by the edit a short window shows.

Per-step prompts render each step's window (bounded.py: the whole history, or the head and the
messages from a chain's start) twice, with a generation prompt before the action and whole with
it. Consecutive steps of a session render nearly the same text: the next step's window is the
previous one and a few more messages. So a step's texts are made by **editing** the previous
step's: a short window (the head, the last user message before it, and the messages from the one
before an earlier action on: the previous prefix's last message, which is last no more, is in it)
is rendered as the previous step and as this one; where those two texts part, the previous step's
long text is cut and the short window's new end put on. A template that renders each message from
its neighbours and the head alone (Qwen3, Qwen2.5, the demo's ChatML) gives the same text as the
long render, in time that does not grow with the window.

A **line** of edits starts with a step rendered whole and goes on while each next window is the
previous one and more assistant turns and tool results: any other message restarts it (a template
may render earlier turns anew after a user message: Qwen3 drops their reasoning), as does a window
that starts elsewhere (a bounded chain moved) or another head (another hindsight block).

For ``--action-span policy`` (``empty_turns``) an edited step carries a third text: its window
with the action an empty assistant turn (``own_tokens.EMPTY_TURN``), edited from its full text as
the short window's full render changes into the short window's empty-turn render (one short
render more per step, instead of the window's whole render). Each step's is made anew from its
own texts, so the checks below sample it (the steps they compare), not the whole line.

The rule is the window rendered whole (``prompt_rule.render_pair``, and the empty turn's render
of the window); the strategy is
:data:`verify.EDITED_RENDERS`. An error made at one step stays in every later text of its line
(each is the last one, cut at its end and extended), so the last edited step of every line is
rendered whole and compared (its texts are kept until the line ends), and the episode's first
edited step too. One difference sends the whole episode back to whole renders, counted
(``PromptBuilder.build_episode``). Other steps are held equal by tests
(tests/test_step_edits.py, property-based, and the shared samples), not proven.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from hcapo_store.rendering import verify
from hcapo_store.rendering.own_tokens import EMPTY_TURN
from hcapo_store.rendering.prompt_rule import Render, RenderedStep, render_pair
from hcapo_store.rendering.strings import common_prefix
from hcapo_store.rendering.template import TemplateRejected

# the short window serves this many steps from one start; then it moves up to the message before the
# previous action (two more short renders that step): about 2.5 short renders per step, of a few
# messages each
CONTEXT_ACTIONS = 4
_CONTINUING = ("assistant", "tool")


def edited(long_before: str, short_before: str, short_now: str) -> str | None:
    """``long_before`` changed as ``short_before`` changed into ``short_now``: the text from where
    the two short ones part is replaced. None when ``long_before`` does not end as ``short_before``
    does from there (the windows disagree: render whole)."""
    cut = common_prefix(short_before, short_now)
    tail = len(short_before) - cut
    if not long_before.endswith(short_before[cut:]):
        return None
    return long_before[: len(long_before) - tail] + short_now[cut:]


@dataclass
class _Line:
    """The last step of a line of edits: its window (the action last) and its two texts."""

    window: list[dict]
    head_end: int
    flattened: bool
    prefix_text: str
    full_text: str
    context: int  # where the short window starts (a position in ``window``)
    actions: int  # actions from ``context`` through this step's
    # the short window's renders as this step (prefix, full), for the next step's edit
    short: tuple[str, str] | None = None
    unchecked: bool = False  # edited and not yet compared with its whole render
    empty_text: str | None = None  # empty_turns: the window with the action an empty turn (edited)


class StepEdits:
    """The steps of one episode at a time (``start_episode``); ``pair`` gives a step's texts,
    ``finish`` ends the episode's lines and says whether a check found a difference.
    ``checks``: verify.UNCHECKED edits on trust (measuring only). ``empty_turns``: edited steps
    carry their empty-turn text too (``RenderedStep.empty_text``)."""

    def __init__(self, render: Render, checks: verify.Checks = verify.CHECKED, *, empty_turns: bool = False) -> None:
        self._render = render
        self._checks = checks
        self.empty_turns = empty_turns
        self.on = False
        self._lines: dict[bool, _Line] = {}  # the current line, by flattened
        self._first_checked = False
        self.mismatch: str | None = None  # what a check found this episode
        self.edited_steps = 0  # this episode's

    def start_episode(self, on: bool) -> None:
        self.on = on
        self._lines = {}
        self._first_checked = False
        self.mismatch = None
        self.edited_steps = 0

    def pair(self, window: list[dict], head_end: int, flattened: bool) -> RenderedStep:
        """``window`` (the action last) rendered without its last message (with a generation
        prompt) and whole: edited from the line's last step where it continues it."""
        line = self._lines.get(flattened)
        edited_line = self._edit(line, window, head_end) if self.on and line is not None else None
        if edited_line is None:
            self._end_line(flattened)
            rendered = render_pair(self._render, window, flattened)
            self._lines[flattened] = _Line(
                window, head_end, flattened, rendered.prefix_text, rendered.full_text, len(window) - 1, 1
            )
            return rendered
        self._lines[flattened] = edited_line
        self.edited_steps += 1
        if not self._first_checked:
            self._first_checked = True
            self._check(edited_line)
        return RenderedStep(
            edited_line.prefix_text, edited_line.full_text, window, flattened, empty_text=edited_line.empty_text
        )

    def finish(self) -> str | None:
        """End the episode's lines (their last steps checked); what a check found, or None."""
        for flattened in list(self._lines):
            self._end_line(flattened)
        return self.mismatch

    def _end_line(self, flattened: bool) -> None:
        line = self._lines.pop(flattened, None)
        if line is not None and line.unchecked:
            self._check(line)

    def _check(self, line: _Line) -> None:
        """The line's step against its window rendered whole (the rule): a difference is kept in
        ``mismatch`` and stops the edits (the episode is built again on whole renders). Checked
        as the line ends, so only the last step's texts are held."""
        line.unchecked = False
        if not self._checks.on or self.mismatch is not None:
            return
        whole = render_pair(self._render, line.window, line.flattened)
        differs = (whole.prefix_text, whole.full_text) != (line.prefix_text, line.full_text)
        if not differs and line.empty_text is not None:
            try:
                differs = self._render([*line.window[:-1], EMPTY_TURN], generation=False) != line.empty_text
            except TemplateRejected:  # the short window took the empty turn, the whole one does not
                differs = True
        if differs:
            self.mismatch = f"the step at message {len(line.window) - 1} of its window differs from its whole render"
            self.on = False

    def _edit(self, line: _Line, window: list[dict], head_end: int) -> _Line | None:
        """The line's next step: this step's texts edited from the line's last step's, or None where
        the window does not continue the line (or a short window is refused: the long one may not be)."""
        before = line.window
        p = len(before) - 1  # the previous action's position
        if head_end != line.head_end or len(window) <= len(before) or p < head_end:
            return None
        if window[:head_end] != before[:head_end]:
            return None
        for k in range(head_end, len(before)):
            if window[k] is not before[k]:
                return None
        m = len(window) - 1
        if any(window[k].get("role") not in _CONTINUING for k in range(p + 1, m)):
            return None
        context, short = line.context, line.short
        if short is None or line.actions >= CONTEXT_ACTIONS:
            # the short window starts before the previous action: the previous prefix's last message
            # is last no more (Qwen3 renders an empty think block on the last assistant turn only)
            context, short = max(p - 1, head_end), None
        actions = 1 if short is None else line.actions + 1
        base = [*window[:head_end], *_last_user(window, head_end, context)]
        try:
            if short is None:
                short = (
                    self._render([*base, *window[context:p]], generation=True),
                    self._render([*base, *window[context : p + 1]], generation=False),
                )
            now = (
                self._render([*base, *window[context:m]], generation=True),
                self._render([*base, *window[context : m + 1]], generation=False),
            )
        except TemplateRejected:
            return None
        prefix_text = edited(line.prefix_text, short[0], now[0])
        full_text = edited(line.full_text, short[1], now[1])
        if prefix_text is None or full_text is None:
            return None
        empty_text = None  # None (refused, or the windows disagree): the caller renders it whole
        if self.empty_turns:
            with contextlib.suppress(TemplateRejected):
                empty_text = edited(
                    full_text, now[1], self._render([*base, *window[context:m], EMPTY_TURN], generation=False)
                )
        return _Line(window, head_end, line.flattened, prefix_text, full_text, context, actions, now, True, empty_text)


def _last_user(window: list[dict], head_end: int, before: int) -> list[dict]:
    """The last user message of ``window[head_end:before]`` (a template may read where the last
    query was: Qwen3 renders reasoning only after it), as a one-message list, or none."""
    for k in range(before - 1, head_end - 1, -1):
        if window[k].get("role") == "user":
            return [window[k]]
    return []
