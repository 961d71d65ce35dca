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
  step's own tokens are in it, reasoning included.

A tokenizer without offsets (a slow, Python-only tokenizer) falls back to the scoring rule:
``render(messages[:m], add_generation_prompt=True)`` must be a prefix of
``render(messages[:m + 1])``, which must be a prefix of the whole episode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hcapo_store.errors import ExportError
from hcapo_store.rendering.own_tokens import EMPTY_TURN, NotOwn, OwnTokenLocator, own_char_range
from hcapo_store.rendering.placement import Placer
from hcapo_store.rendering.prompts import (
    flatten_messages,
    normalize_messages,
)
from hcapo_store.rendering.segments import SegmentEncoder
from hcapo_store.rendering.template import TemplateRejected, render_chat
from hcapo_store.rendering.tokenizers import (
    content_difference,
    load_tokenizer,
    tokenizer_content,
    tokenizer_fingerprint,
)
from hcapo_store.scoring.scorer import known_tokenizer_dirs, remember_tokenizer, scorer_spec
from hcapo_store.storage.store import Store

RENDERINGS = ("turns", "whole")


@dataclass
class Alignment:
    """Where each step's own tokens sit in the episode's ids, or why they cannot be placed."""

    input_ids: list[int]
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # step_index -> [start, end)
    refused: dict[int, str] = field(default_factory=dict)  # step_index -> reason
    flattened: bool = False


class EpisodeRenderer:
    """Renders a whole episode with a chat template and places each step's own tokens in it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.encoder = SegmentEncoder(tokenizer)
        self.locator = OwnTokenLocator(tokenizer, self.encoder)
        self.placer = Placer(tokenizer, encoder=self.encoder)

    def _render(self, messages: list[dict], generation: bool) -> str:
        return render_chat(self.tokenizer, messages, generation=generation)

    def align(
        self, messages: list[dict[str, Any]], steps: list[tuple[int, int]], rendering: str = "whole"
    ) -> Alignment:
        """``steps``: (step_index, message_index). Flattens tool traffic when the template rejects it
        (as scoring does), for the whole episode so every span lives in one rendering."""
        if rendering not in RENDERINGS:
            raise ExportError(f"unknown rendering {rendering!r}: use one of {', '.join(RENDERINGS)}")
        if not self.locator.available:
            place = self._align_prefix
        else:
            place = self._align_turns if rendering == "turns" else self._align_own
        try:
            return place(normalize_messages(messages), steps, flattened=False)
        except TemplateRejected:
            pass
        try:
            return place(flatten_messages(messages), steps, flattened=True)
        except TemplateRejected as exc:
            raise ExportError(f"the chat template cannot render this episode: {exc}") from exc

    def _align_own(self, msgs: list[dict], steps: list[tuple[int, int]], *, flattened: bool) -> Alignment:
        placement = self.placer.place(msgs, sorted(steps, key=lambda s: s[1]))  # linear; rendering/placement.py
        spans = {index: (span.start, span.end) for index, span in placement.spans.items()}
        return Alignment(placement.ids, spans, dict(placement.refused), flattened=flattened)

    def _align_turns(self, msgs: list[dict], steps: list[tuple[int, int]], *, flattened: bool) -> Alignment:
        ids: list[int] = []
        out = Alignment(ids, flattened=flattened)
        previous: int | None = None  # message index of the last turn in the row
        for index, m in sorted(steps, key=lambda s: s[1]):
            if not 0 < m < len(msgs) or msgs[m].get("role") != "assistant" or m == previous:
                out.refused[index] = f"message {m} is not an assistant message after the first message"
                continue
            prompt = self._render(msgs[:m], generation=True)
            if previous is None:
                context = prompt
            else:
                end = self._turn_end(msgs[:m], previous, prompt)
                if end is None:
                    out.refused[index] = "alignment: the end of the previous turn is not found in this step's prompt"
                    continue
                context = prompt[end:]
            turn = self._turn_text(msgs, m, prompt)
            if turn is None:
                out.refused[index] = "alignment: the turn's generation prompt is not found in its rendering"
                continue
            turn_text, turn_empty = turn
            turn_ids, turn_offsets = self.locator.offsets(turn_text)
            try:
                span = self.locator.span(turn_text, turn_empty, msgs[m], turn_ids, turn_offsets)
                self.locator.check_decodes(turn_text, turn_ids, turn_offsets, span)
            except NotOwn as exc:
                out.refused[index] = exc.reason
                continue
            context_ids, _ = self.locator.offsets(context)
            ids.extend(context_ids)
            out.spans[index] = (len(ids) + span.start, len(ids) + span.end)
            ids.extend(turn_ids[: span.end])  # the turn as the policy ended it: nothing after its end
            previous = m
        return out

    def _turn_text(self, msgs: list[dict], m: int, prompt: str) -> tuple[str, str] | None:
        """Turn ``m`` as rendered when it is the last message, from the end of its generation
        prompt, and the same for an empty turn. The turn starts at the last occurrence of the
        generation prompt before its own text (earlier turns may render differently here than in
        ``prompt``: Qwen3 wraps only the last assistant turn in an empty think block)."""
        base = self._render(msgs[:m], generation=False)
        if not prompt.startswith(base):
            return None
        generation = prompt[len(base) :]
        text = self._render(msgs[: m + 1], generation=False)
        empty = self._render([*msgs[:m], EMPTY_TURN], generation=False)
        own_start, _ = own_char_range(text, empty)
        begin = text.rfind(generation, 0, own_start + 1) if generation else len(base)
        if begin < 0 or not empty.startswith(text[:begin]):
            return None
        begin += len(generation)
        return text[begin:], empty[begin:]

    def _turn_end(self, msgs: list[dict], m: int, prompt: str) -> int | None:
        """Where turn ``m`` (own text + end-of-turn token) ends in ``prompt`` (a render of ``msgs``)."""
        try:
            empty = self._render([*msgs[:m], EMPTY_TURN, *msgs[m + 1 :]], generation=True)
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


def span_problem(prefix: list[int], step: list[int], full: list[int]) -> str | None:
    if step[: len(prefix)] != prefix:
        return "alignment: the prefix ids are not a prefix of the step's ids"
    if len(step) == len(prefix):
        return "empty_action: the action renders to no tokens"
    if full[: len(step)] != step:
        return "rendering: the whole episode renders this turn (or an earlier one) differently"
    return None


def scorer_tokenizer(
    store: Store,
    scorer_id: str,
    tokenizer_dir: str | Path | None = None,
    *,
    note: Callable[[str], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The tokenizer in ``tokenizer_dir`` and its fingerprint, refused unless it is the
    scorer's. Without a directory: the first of those the scorer's tokenizer was loaded from
    before (``score``, an earlier export: the store's ``tokenizer_locations``) whose files
    still hash exactly as the scorer's did: a directory the store names is anyone's choice who
    could write to it, so a copy equal by content only is not taken from it (pass it with
    ``--tokenizer``). ``note`` is told which directory was taken and why."""
    theirs = scorer_spec(store, scorer_id).get("tokenizer") or {}
    if tokenizer_dir is not None:
        return _checked_tokenizer(store, scorer_id, theirs, tokenizer_dir)
    tried = []
    for candidate in known_tokenizer_dirs(store, theirs.get("files_sha256") or ""):
        if not candidate.is_dir():
            tried.append(f"{candidate} (not there)")
            continue
        try:
            tokenizer = load_tokenizer(candidate)
        except (OSError, ValueError):
            tried.append(f"{candidate} (cannot be loaded)")
            continue
        mine = tokenizer_fingerprint(tokenizer, candidate)
        if any(theirs.get(key) != mine[key] for key in ("files_sha256", "chat_template_sha256")):
            tried.append(f"{candidate} (its files' hashes differ from the scorer's)")
            continue
        if note is not None:
            note(
                f"tokenizer: {candidate} (no --tokenizer: the store records it as where scorer {scorer_id[:12]}'s "
                f"tokenizer {theirs.get('name', '?')!r} was loaded from, and its files hash as the scorer's)"
            )
        remember_tokenizer(store, mine["files_sha256"], candidate)
        return tokenizer, mine
    where = f" (where the store says it was: {', '.join(tried)})" if tried else ""
    raise ExportError(
        f"this needs the tokenizer scorer {scorer_id[:12]} used ({theirs.get('name', '?')!r}){where}: "
        "pass its directory with --tokenizer DIR"
    )


def _checked_tokenizer(
    store: Store, scorer_id: str, theirs: dict[str, Any], tokenizer_dir: str | Path
) -> tuple[Any, dict[str, Any]]:
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load tokenizer {tokenizer_dir}: {exc}") from exc
    mine = tokenizer_fingerprint(tokenizer, tokenizer_dir)
    same_bytes = all(theirs.get(key) == mine[key] for key in ("files_sha256", "chat_template_sha256"))
    if not same_bytes:  # the fast path failed: compare by content with the scorer's own copy
        _check_content(store, scorer_id, theirs, tokenizer, tokenizer_dir)
    remember_tokenizer(store, mine["files_sha256"], tokenizer_dir)
    return tokenizer, mine


def _check_content(
    store: Store, scorer_id: str, theirs: dict[str, Any], tokenizer: Any, tokenizer_dir: str | Path
) -> None:
    """Accept ``tokenizer`` when its content (vocabulary, merges, added tokens, pipeline, chat
    template) equals that of the scorer's tokenizer, found where it was loaded before with its
    bytes unchanged (stored fingerprints hold file hashes only, so the content is computed on load).
    A trainer's ``save_pretrained`` copy passes; one changed merge does not."""
    used = f"the scorer used {theirs.get('name', '?')!r}"
    for candidate in known_tokenizer_dirs(store, theirs.get("files_sha256") or ""):
        if not candidate.is_dir():
            continue
        try:
            reference = load_tokenizer(candidate)
        except (OSError, ValueError):
            continue
        ref_print = tokenizer_fingerprint(reference, candidate)
        if any(theirs.get(key) != ref_print[key] for key in ("files_sha256", "chat_template_sha256")):
            continue  # changed since it was remembered
        differs = content_difference(tokenizer_content(tokenizer), tokenizer_content(reference))
        if not differs:
            return
        raise ExportError(
            f"tokenizer {tokenizer_dir} is not the one scorer {scorer_id[:12]} used: its "
            f"{', '.join(d.replace('_', ' ') for d in differs)} differ from {candidate} ({used}): "
            "pass that tokenizer directory"
        )
    raise ExportError(
        f"tokenizer {tokenizer_dir} is not the one scorer {scorer_id[:12]} used (files_sha256 differs; {used}), "
        "and that tokenizer is not where it was loaded before, so the two cannot be compared by content: "
        "pass the scorer's tokenizer directory once (then re-saved copies of it are recognised)"
    )
