"""Which tokens of a rendered assistant turn are the policy's own (docs/SCORING.md "Action span").

A chat template wraps what the policy generated in tokens it inserts itself: the role
header, Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` on the last assistant turn, the newline
after the end-of-turn token. The rule, for any template: render the conversation twice,
once as it is and once with the assistant message at ``m`` replaced by an empty assistant
message (:data:`EMPTY_TURN`). Everything the two texts share at the start and at the end is
the template's; the characters in between are the policy's own text (reasoning, text, tool
calls). The end-of-turn token right after them (``<|im_end|>``, ``<|eot_id|>``) is the
policy's too: it generated it to stop.

Characters become tokens through the fast tokenizer's offsets: a token belongs to the span
when its characters overlap the own text. A token that straddles the boundary (a merge of a
header newline with the text's first characters) is included, never split.

The opening ``<think>`` of a message with reasoning is the policy's too (see
:data:`REASONING_OPEN`). The own text must hold every piece of the message (its reasoning, its text, each tool
call's name); a template that leaves a piece out of this rendering (Qwen3 drops the
reasoning of turns before the last user message) makes the step unplaceable, with a
reason, rather than a span over part of the action.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from hcapo_store.rendering.segments import PieceOffsets, SegmentEncoder
from hcapo_store.rendering.strings import common_prefix, common_suffix

EMPTY_TURN: dict[str, Any] = {"role": "assistant", "content": ""}

# How the store keeps thinking in a message's content (ingest --include-thinking). The opening
# tag is the policy's own even where the template also writes it for an empty turn (Qwen3's
# last turn), so the own text is widened back over it.
REASONING_OPEN = "<think>"


@dataclass(frozen=True)
class OwnSpan:
    """Token span ``[start, end)`` of the policy's own tokens, and of its own characters."""

    start: int
    end: int
    char_start: int
    char_end: int
    end_of_turn: bool  # the span ends with the template's end-of-turn token


class NotOwn(Exception):
    """The step's own tokens cannot be placed in this rendering; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def own_char_range(text: str, empty: str) -> tuple[int, int]:
    """``[start, end)`` of ``text`` that differs from ``empty`` (the same turn rendered empty).

    The shared prefix is taken first and the shared suffix may not overlap it, so a text
    that ends like the template's tail ("ok\\n" before "<|im_end|>") keeps its own characters.
    """
    p = common_prefix(text, empty)
    s = common_suffix(text, empty, min(len(text), len(empty)) - p)
    return p, len(text) - s


def own_pieces(message: Mapping[str, Any], *, reasoning: bool = True) -> list[str]:
    """The message's own text pieces a rendering must contain: reasoning (unless ``reasoning``
    is False), text, tool names."""
    content = message.get("content") or ""
    if not isinstance(content, str):  # multimodal parts: the text parts are the pieces
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    pieces: list[str] = []
    thought = message.get("reasoning_content")
    if isinstance(thought, str) and reasoning:
        pieces.append(thought.strip())
    if "</think>" in content:
        head, _, content = content.rpartition("</think>")
        if reasoning:
            pieces.append(head.split("<think>")[-1].strip())
    pieces.append(content.strip())
    for call in message.get("tool_calls") or []:
        name = (call.get("function") or {}).get("name") if isinstance(call, Mapping) else None
        if isinstance(name, str):
            pieces.append(name)
    return [p for p in pieces if p]


class OwnTokenLocator:
    """Maps the own characters of a turn to token positions with a fast tokenizer's offsets."""

    def __init__(self, tokenizer: Any, encoder: SegmentEncoder | None = None) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder  # when given, long renderings are tokenized piece by piece
        specials = _special_tokens(tokenizer)
        self.end_of_turn_ids = frozenset(specials.values())
        # Longest first, so a token that starts like a shorter one is matched whole.
        self._end_of_turn_texts = sorted((t for t in specials if t), key=len, reverse=True)

    @property
    def available(self) -> bool:
        return bool(getattr(self.tokenizer, "is_fast", False))

    def end_of_turn_length(self, text: str, at: int) -> int:
        """Length of the end-of-turn (special) token text starting at ``at``, or 0."""
        for token in self._end_of_turn_texts:
            if text.startswith(token, at):
                return len(token)
        return 0

    def end_after_turn(self, text: str, own_end: int) -> int:
        """Where the end-of-turn token that closes the own text ``[.., own_end)`` ends.

        A character diff can end inside that token: an empty turn renders ``<|im_end|>``
        right after the header's ``<``-free text while the own text starts with ``<think>``,
        so the shared prefix takes the ``<`` and the own range ends one character into
        ``<|im_end|>``. The token is whole or not at all: back off to its start first."""
        for token in self._end_of_turn_texts:
            for k in range(1, len(token)):
                if own_end - k >= 0 and text.startswith(token, own_end - k):
                    return own_end - k + len(token)
        return own_end + self.end_of_turn_length(text, own_end)

    def offsets(self, text: str) -> tuple[list[int], Sequence[tuple[int, int]]]:
        if self.encoder is not None:
            return self.encoder.offsets(text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def span(
        self,
        text: str,
        empty: str,
        message: Mapping[str, Any],
        ids: list[int],
        offsets: Sequence[tuple[int, int]],
        *,
        search_from: int = 0,
    ) -> OwnSpan:
        """The own span of the turn whose rendering differs between ``text`` and ``empty``.

        ``ids``/``offsets``: the tokenization of ``text`` (offsets are character positions
        in ``text``). Raises :class:`NotOwn` when the own text misses a piece or is empty.
        """
        cs, ce = own_chars(text, empty, message)
        return self.token_span(text, cs, ce, message, ids, offsets, search_from=search_from)

    def token_span(
        self,
        text: str,
        cs: int,
        ce: int,
        message: Mapping[str, Any],
        ids: list[int],
        offsets: Sequence[tuple[int, int]],
        *,
        search_from: int = 0,
        reasoning_required: bool = True,
    ) -> OwnSpan:
        """The tokens of the own characters ``text[cs:ce]`` (plus the end-of-turn token right
        after them); :class:`NotOwn` when they miss a piece of the message (its reasoning only
        when ``reasoning_required``) or are empty."""
        if ce <= cs:
            raise NotOwn("empty_action: the action renders to no tokens of its own")
        own = text[cs:ce]
        missing = [p for p in own_pieces(message, reasoning=reasoning_required) if p not in own]
        if missing:
            raise NotOwn(
                "rendering: the whole conversation leaves out part of this step's own text "
                f"({_preview(missing[0])}); the template renders this turn without it"
            )
        start = _first_overlapping(offsets, cs, search_from)
        end = _first_starting_from(offsets, ce, start)
        if start >= end:
            raise NotOwn("alignment: no token covers the action's own characters")
        eot = False
        if end < len(ids) and ids[end] in self.end_of_turn_ids and offsets[end][0] == ce:
            end += 1
            eot = True
        return OwnSpan(start, end, cs, ce, eot)

    def check_decodes(self, text: str, ids: list[int], offsets: Sequence[tuple[int, int]], span: OwnSpan) -> None:
        """:class:`NotOwn` unless the span's tokens decode to exactly the text they cover."""
        covered = text[offsets[span.start][0] : offsets[span.end - 1][1]]
        decode = self.encoder.decode if self.encoder is not None else self.tokenizer.decode
        if decode(ids[span.start : span.end]) != covered:
            raise NotOwn("alignment: the span's tokens do not decode to the text they cover")


def _special_tokens(tokenizer: Any) -> dict[str, int]:
    """Text -> id of every special token: those named in the special-tokens map, and every added
    token marked special (Llama-3's ``<|eot_id|>`` is only the latter)."""
    out = {str(t): int(i) for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids)}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out.update({str(t.content): int(i) for i, t in decoder.items() if getattr(t, "special", False)})
    return out


def own_chars(text: str, empty: str, message: Mapping[str, Any]) -> tuple[int, int]:
    """``[start, end)`` of the turn's own characters in ``text``: where it differs from ``empty``,
    widened back over the opening ``<think>`` of a message with reasoning."""
    cs, ce = own_char_range(text, empty)
    if ce > cs and _has_reasoning(message):
        head = text[:cs].rstrip()
        if head.endswith(REASONING_OPEN):
            cs = len(head) - len(REASONING_OPEN)
    return cs, ce


def _has_reasoning(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    return bool(message.get("reasoning_content")) or (
        isinstance(content, str) and content.lstrip().startswith(REASONING_OPEN)
    )


_token_start, _token_end = itemgetter(0), itemgetter(1)


def _first_starting_from(offsets: Sequence[tuple[int, int]], char: int, lo: int) -> int:
    """The first token (from ``lo``) whose characters start at or after ``char``; offsets ascend."""
    if isinstance(offsets, PieceOffsets):  # found by piece, without reading every piece's ranges
        return max(lo, offsets.first_starting_from(char))
    return bisect_left(offsets, char, lo=lo, key=_token_start)


def _first_overlapping(offsets: Sequence[tuple[int, int]], char: int, lo: int) -> int:
    """The first token (from ``lo``) whose characters end after ``char``; offsets ascend."""
    if isinstance(offsets, PieceOffsets):
        return max(lo, offsets.first_ending_after(char))
    return bisect_right(offsets, char, lo=lo, key=_token_end)


def _preview(text: str, limit: int = 40) -> str:
    one_line = " ".join(text.split())
    return repr(one_line if len(one_line) <= limit else one_line[: limit - 1] + "…")
