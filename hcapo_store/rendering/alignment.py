"""Where each step's own tokens sit in the trainer's whole-conversation rendering.

The row a trainer sees is one rendering of the whole episode. For the step at message
``m``, the policy's own tokens are found in that rendering by ``rendering/own_tokens.py``: the
whole episode is rendered again with message ``m`` replaced by an empty assistant turn, and
the characters that differ are the step's own (reasoning, text, tool calls), plus the
end-of-turn token; role headers and inserted wrappers (Qwen3's empty think block on the last
turn) are the template's and never weighted. The characters become token positions through
the tokenizer's offsets, and every span is checked: its tokens decode to exactly the text
they cover, and that text holds each piece of the message. (``whole``: placed in time linear
in the episode by ``rendering/placement.py``, the rule applied step by step only where a
template needs it.) A step whose own text is not in
the rendering (Qwen3 leaves out the reasoning of turns before the last user message) is
refused with a reason, never moved or weighted in part.

Two renderings (``RENDERINGS``):

* ``whole``: the chat template renders the whole conversation once, as an SFT trainer's
  ``apply_chat_template`` does. Templates that render a turn differently once more follow
  (Qwen3 drops the reasoning of turns before the last user message) leave those steps out.
* ``turns``: the conversation as the policy produced it, turn by turn, as multi-turn RL
  trainers hold it (token in, token out): the first step's prompt
  ``render(messages[:m], add_generation_prompt=True)``, then each turn as rendered when it
  was the last one, then the text the template adds between that turn's end-of-turn token
  and the next step's generation prompt (tool results, user messages), and so on. Every
  step's own tokens are in it, reasoning included. A renderer keeps each step's piece of it
  (the ids from the previous turn's end to this turn's end, and its span) by a digest of the
  messages up to that step: episodes that share a history (a GRPO group's rows share their
  prompt) render the shared steps once. The pieces are kept per tokenizer object (and its chat
  template), across renderers: a trainer makes a hand-off per step over the one tokenizer it
  keeps, and its steps' prompts share their history too.

Both renderings render through the tokenizer object's kept renders (``kept_renders.py``: by a
digest of the messages), so a row that differs from the rows before it only in its last turn
renders its history's four renders of that turn, the skeleton and the per-step local renders
once for the group; the kept pieces and renders are checked against fresh ones at run time
(``verify.KEPT_RENDERS``). An episode's new ``turns`` pieces after its first are made on a window
of their history (:class:`HistoryWindows`: the head, the last user message and the turns from
the previous one on), in time linear in the episode; the first, the last and halving back are
made again on the whole history and compared (``verify.WINDOWED_TURNS``).

A tokenizer without offsets (a slow, Python-only tokenizer) falls back to the scoring rule:
``render(messages[:m], add_generation_prompt=True)`` must be a prefix of
``render(messages[:m + 1])``, which must be a prefix of the whole episode.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

from hcapo_store.errors import ExportError
from hcapo_store.rendering import verify
from hcapo_store.rendering.kept_renders import (
    Digests,
    KeptRenders,
    kept_renders,
    message_digests,
    pick,
    prefix_digests,
    render_kept,
)
from hcapo_store.rendering.own_tokens import NotOwn, OwnTokenLocator, own_char_range
from hcapo_store.rendering.placement import Placement, Placer, UserTurns
from hcapo_store.rendering.prompts import (
    flatten_messages,
    normalize_messages,
)
from hcapo_store.rendering.segments import SegmentEncoder
from hcapo_store.rendering.template import TemplateRejected

RENDERINGS = ("turns", "whole")


# a step's piece of a ``turns`` alignment: (context ids, turn ids up to its end, span start, end),
# or why it cannot be placed
Piece = tuple[list[int], list[int], int, int] | str


@dataclass
class Alignment:
    """Where each step's own tokens sit in the episode's ids, or why they cannot be placed."""

    input_ids: list[int]
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # step_index -> [start, end)
    refused: dict[int, str] = field(default_factory=dict)  # step_index -> reason
    flattened: bool = False


class EpisodeRenderer:
    """Renders a whole episode with a chat template and places each step's own tokens in it.

    ``fast`` (default; off in reference mode): keep renders and ``turns`` pieces across episodes
    and renderers of this tokenizer object (``kept_renders.py``) and make a ``turns`` piece on a
    window of its history (:class:`HistoryWindows`); False: the rules only, every render made
    anew on the whole history."""

    def __init__(self, tokenizer: Any, *, fast: bool = True) -> None:
        self.tokenizer = tokenizer
        self.encoder = SegmentEncoder(tokenizer)
        self.locator = OwnTokenLocator(tokenizer, self.encoder)
        # the renders and pieces shared by the renderers of this tokenizer object
        self.kept: KeptRenders | None = kept_renders(tokenizer) if fast else None
        self.placer = Placer(tokenizer, encoder=self.encoder, renders=self.kept)

    def _render(self, messages: list[dict], generation: bool, digests: Digests | None = None) -> str:
        return render_kept(self.kept, self.tokenizer, messages, digests, generation=generation)

    def align(
        self,
        messages: list[dict[str, Any]],
        steps: list[tuple[int, int]],
        rendering: str = "whole",
        *,
        known: Placement | None = None,
    ) -> Alignment:
        """``steps``: (step_index, message_index). Flattens tool traffic when the template rejects it
        (as scoring does), for the whole episode so every span lives in one rendering.
        ``known``: the episode's :meth:`whole_rendering`, made earlier (``whole`` only)."""
        if rendering not in RENDERINGS:
            raise ExportError(f"unknown rendering {rendering!r}: use one of {', '.join(RENDERINGS)}")
        if not self.locator.available:
            place = self._align_prefix
        elif rendering == "turns":
            place = self._align_turns
        else:
            place = functools.partial(self._align_own, known=known)
        try:
            return place(normalize_messages(messages), steps, flattened=False)
        except TemplateRejected:
            pass
        try:
            return place(flatten_messages(messages), steps, flattened=True)
        except TemplateRejected as exc:
            raise ExportError(f"the chat template cannot render this episode: {exc}") from exc

    def whole_rendering(self, messages: list[dict[str, Any]]) -> Placement | None:
        """The rendering ``align(messages, steps, "whole")`` places the steps in, without placing
        any (~a third of its cost; its ids are that alignment's): of the normalized messages, or
        of the flattened ones where the template rejects those, as ``align`` chooses (only that
        rendering raises ``TemplateRejected`` in ``Placer.place``). Given back to ``align``
        (``known``), it is not tokenized again. None where ``align`` goes another way: no
        own-token locator (the prefix alignment), or no rendering at all (its ExportError is
        ``align``'s to raise)."""
        if not self.locator.available:
            return None
        for make in (normalize_messages, flatten_messages):
            msgs = make(messages)
            try:
                return self.placer.rendering(msgs, digests=self._digests(msgs))
            except TemplateRejected:
                continue
        return None

    def _digests(self, msgs: list[dict]) -> list[bytes | None] | None:
        return message_digests(msgs) if self.kept is not None else None

    def _align_own(
        self, msgs: list[dict], steps: list[tuple[int, int]], *, flattened: bool, known: Placement | None = None
    ) -> Alignment:
        ordered = sorted(steps, key=lambda s: s[1])
        placement = self.placer.place(msgs, ordered, digests=self._digests(msgs), known=known)  # linear; placement.py
        spans = {index: (span.start, span.end) for index, span in placement.spans.items()}
        return Alignment(placement.ids, spans, dict(placement.refused), flattened=flattened)

    def _align_turns(self, msgs: list[dict], steps: list[tuple[int, int]], *, flattened: bool) -> Alignment:
        digests = self._digests(msgs)
        out, made = self._turns(msgs, steps, digests, flattened=flattened, windowed=self.kept is not None)
        windowed = [i for i, (_, _, _, _, w) in enumerate(made) if w]
        for i in checked_pieces(len(windowed)):
            _, m, previous, piece, _ = made[windowed[i]]
            try:
                rule = self._turn_piece(msgs, m, previous, digests)
            except TemplateRejected:
                rule = "template"  # the whole history is rejected where the window was not: not equal
            if rule != piece:
                verify.disagreed(verify.WINDOWED_TURNS, f"the piece of message {m} differs from its whole history's")
                out, made = self._turns(msgs, steps, digests, flattened=flattened, windowed=False)
                break
        if self.kept is not None:
            for key, _, _, piece, _ in made:
                if key is not None:
                    self.kept.put_piece(key, piece)
        return out

    def _turns(
        self,
        msgs: list[dict],
        steps: list[tuple[int, int]],
        digests: Digests | None,
        *,
        flattened: bool,
        windowed: bool,
    ) -> tuple[Alignment, list[tuple[Any, int, int | None, Piece, bool]]]:
        """The ``turns`` alignment and the pieces it made (key, message, previous turn, piece,
        whether made on a window), not yet kept: a windowed piece is kept once the episode's
        checks passed."""
        ids: list[int] = []
        out = Alignment(ids, flattened=flattened)
        made: list[tuple[Any, int, int | None, Piece, bool]] = []
        previous: int | None = None  # message index of the last turn in the row
        # a step's piece reads msgs[: m + 1] only (every render below is of a prefix of it): kept by
        # that prefix's digest, it is rendered once for all the episodes that share the prefix
        prefixes = prefix_digests(digests) if digests is not None else None
        windows = HistoryWindows(msgs) if windowed else None
        for index, m in sorted(steps, key=lambda s: s[1]):
            if not 0 < m < len(msgs) or msgs[m].get("role") != "assistant" or m == previous:
                out.refused[index] = f"message {m} is not an assistant message after the first message"
                continue
            digest = prefixes[m] if prefixes is not None else None
            key = None if digest is None else (flattened, previous, m, digest)
            piece = self._kept_piece(key, msgs, m, previous)
            if piece is None:
                # the episode's first new piece is made on its whole history: a row that adds one
                # turn to a kept history (a GRPO group's next row) would check its one window anyway
                piece = windows.piece(self, digests, m, previous) if windows is not None and made else None
                on_window = piece is not None
                if piece is None:
                    piece = self._turn_piece(msgs, m, previous, digests)
                made.append((key, m, previous, piece, on_window))
            if isinstance(piece, str):
                out.refused[index] = piece
                continue
            context_ids, turn_ids, start, end = piece
            ids.extend(context_ids)
            out.spans[index] = (len(ids) + start, len(ids) + end)
            ids.extend(turn_ids)  # the turn as the policy ended it: nothing after its end
            previous = m
        return out, made

    def _kept_piece(self, key: Any, msgs: list[dict], m: int, previous: int | None) -> Piece | None:
        """The piece kept under ``key``, made again (no kept render) and compared when the
        strategy's policy checks this hit (verify.KEPT_PIECES); None when none is kept."""
        if key is None or self.kept is None:
            return None
        piece = self.kept.piece(key)
        if piece is not None and verify.due(verify.KEPT_PIECES):
            fresh = self._turn_piece(msgs, m, previous, None)
            if fresh != piece:
                self.kept.switch_off(verify.KEPT_PIECES, f"the kept piece of message {m} differs from the one made now")
                return fresh
        return piece

    def _turn_piece(self, msgs: list[dict], m: int, previous: int | None, digests: Digests | None) -> Piece:
        """Step ``m``'s piece of a ``turns`` alignment after the turn at ``previous``: the ids
        between the previous turn's end and this turn's own tokens, the turn's ids up to its end
        and its own tokens' span in them; or why it cannot be placed. ``digests``: the messages'
        (their renders kept by them; None: rendered anew)."""
        history = None if digests is None else digests[:m]
        prompt = self._render(msgs[:m], True, history)
        if previous is None:
            context = prompt
        else:
            end = self._turn_end(msgs[:m], history, previous, prompt)
            if end is None:
                return "alignment: the end of the previous turn is not found in this step's prompt"
            context = prompt[end:]
        turn = self._turn_text(msgs, digests, m, prompt)
        if turn is None:
            return "alignment: the turn's generation prompt is not found in its rendering"
        turn_text, turn_empty = turn
        turn_ids, turn_offsets = self.locator.offsets(turn_text)
        try:
            span = self.locator.span(turn_text, turn_empty, msgs[m], turn_ids, turn_offsets)
            self.locator.check_decodes(turn_text, turn_ids, turn_offsets, span)
        except NotOwn as exc:
            return exc.reason
        context_ids, _ = self.locator.offsets(context)
        return list(context_ids), list(turn_ids[: span.end]), span.start, span.end

    def _turn_text(self, msgs: list[dict], digests: Digests | None, m: int, prompt: str) -> tuple[str, str] | None:
        """Turn ``m`` as rendered when it is the last message, from the end of its generation
        prompt, and the same for an empty turn. The turn starts at the last occurrence of the
        generation prompt before its own text (earlier turns may render differently here than in
        ``prompt``: Qwen3 wraps only the last assistant turn in an empty think block)."""
        history = None if digests is None else digests[:m]
        base = self._render(msgs[:m], False, history)
        if not prompt.startswith(base):
            return None
        generation = prompt[len(base) :]
        text = self._render(msgs[: m + 1], False, None if digests is None else digests[: m + 1])
        emptied, emptied_digests = pick(msgs, digests, [*range(m), None])
        empty = self._render(emptied, False, emptied_digests)
        own_start, _ = own_char_range(text, empty)
        begin = text.rfind(generation, 0, own_start + 1) if generation else len(base)
        if begin < 0 or not empty.startswith(text[:begin]):
            return None
        begin += len(generation)
        return text[begin:], empty[begin:]

    def _turn_end(self, msgs: list[dict], digests: Digests | None, m: int, prompt: str) -> int | None:
        """Where turn ``m`` (own text + end-of-turn token) ends in ``prompt`` (a render of ``msgs``)."""
        emptied, emptied_digests = pick(msgs, digests, (None if i == m else i for i in range(len(msgs))))
        try:
            empty = self._render(emptied, True, emptied_digests)
        except TemplateRejected:
            return None
        _, own_end = own_char_range(prompt, empty)
        return self.locator.end_after_turn(prompt, own_end)

    def _align_prefix(self, msgs: list[dict], steps: list[tuple[int, int]], *, flattened: bool) -> Alignment:
        full = self.encoder.encode_whole(self._render(msgs, generation=False))
        out = Alignment(full, flattened=flattened)
        prefix_state, step_state = self.encoder.new_state(), self.encoder.new_state()
        for index, m in steps:
            if not 0 < m < len(msgs) or msgs[m].get("role") != "assistant":
                out.refused[index] = f"message {m} is not an assistant message after the first message"
                continue
            prefix = self.encoder.encode(self._render(msgs[:m], generation=True), prefix_state)
            step = self.encoder.encode(self._render(msgs[: m + 1], generation=False), step_state)
            reason = span_problem(prefix, step, full)
            if reason:
                out.refused[index] = reason
            else:
                out.spans[index] = (len(prefix), len(step))
        return out


class HistoryWindows:
    """A ``turns`` piece made on a window of its history: the piece of turn ``m`` after turn
    ``p`` is what the template renders between and around them, so it is made on the head (the
    messages through the first user message), the last user message before ``p`` and the messages
    from ``p`` to ``m``: a few renders of a few messages instead of five of the whole history, so
    an episode's pieces take time linear in its length (not its square).

    The rule is the piece made on the whole history (``EpisodeRenderer._turn_piece``). A template
    that reads messages outside the window (numbers its turns, say) makes other pieces: so each
    episode's windowed pieces are checked (:func:`checked_pieces`: the first, the last and
    halving back from it, made again on their whole history), and one difference makes every
    piece of the episode on its whole history (``verify.WINDOWED_TURNS``, counted). The pieces
    not checked are held equal by tests (tests/test_kept_renders.py, property-based), not proven."""

    def __init__(self, msgs: list[dict]) -> None:
        self.msgs = msgs
        first_user = next((i for i, x in enumerate(msgs) if x.get("role") == "user"), None)
        self.head_end = 1 if first_user is None else first_user + 1
        self.last_user = UserTurns(msgs).before  # per message, the last user message before it

    def piece(self, renderer: EpisodeRenderer, digests: Digests | None, m: int, previous: int | None) -> Piece | None:
        """Turn ``m``'s piece made on its window, or None where there is no shorter window (or
        the template rejects it: then the whole history's piece is made)."""
        if previous is None or previous < self.head_end:
            return None
        u = self.last_user[previous]
        keep = [*range(self.head_end), *([u] if u is not None and u >= self.head_end else []), *range(previous, m + 1)]
        if 2 * len(keep) > m + 1:  # hardly shorter than the history: the rule's piece
            return None
        window, window_digests = pick(self.msgs, digests, keep)
        at = len(keep) - 1 - (m - previous)  # where turn ``previous`` is in the window
        try:
            return renderer._turn_piece(window, len(keep) - 1, at, window_digests)
        except TemplateRejected:
            return None


def checked_pieces(n: int) -> list[int]:
    """Which of an episode's ``n`` windowed pieces (in order) are made again on their whole history:
    the first, the last, and halving back from the last (a template that reads far back shows it
    latest), about log2(n) of them; descending."""
    picks = {0} if n else set()
    k = n - 1
    while k > 0:
        picks.add(k)
        k //= 2
    return sorted(picks, reverse=True)


def span_problem(prefix: list[int], step: list[int], full: list[int]) -> str | None:
    if step[: len(prefix)] != prefix:
        return "alignment: the prefix ids are not a prefix of the step's ids"
    if len(step) == len(prefix):
        return "empty_action: the action renders to no tokens"
    if full[: len(step)] != step:
        return "rendering: the whole episode renders this turn (or an earlier one) differently"
    return None


def span_mismatch(values: Sized, start: int, end: int) -> str | None:
    """Why per-token values cannot go on the span [start, end), or None."""
    if len(values) == end - start:
        return None
    return (
        f"token_span: the run's scorers scored {len(values)} token(s) of this step, its own tokens here are "
        f"{end - start}: per-token credits are placed only where they are the same tokens (score both "
        "scorers with --action-span policy and no --max-logprob-tokens)"
    )


def place_values(values: Mapping[int, Sized], spans: dict[int, tuple[int, int]], refused: dict[int, str]) -> None:
    """Per-token values by step index on the steps of ``spans``: a step whose values are not as
    many as its own tokens moves, in place, from ``spans`` to ``refused`` with the reason, never
    placed shifted."""
    for index, (start, end) in list(spans.items()):
        if index not in values:
            continue
        why = span_mismatch(values[index], start, end)
        if why is not None:
            del spans[index]
            refused[index] = why
