"""Where each step's action sits in the trainer's whole-conversation rendering.

Spans are found the way scoring finds them (``scoring/prompts.py``), never guessed: for the
step at message ``m``, ``prefix = render(messages[:m], add_generation_prompt=True)`` and
``step = render(messages[:m + 1])``; the prefix ids must be a prefix of the step ids, and the
action is the rest. A step is placed only when ``prefix ids + action ids`` are also a prefix
of the whole episode's ids; otherwise it is refused with a reason, never moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hcapo_store.errors import ExportError
from hcapo_store.scoring.prompts import SegmentEncoder, flatten_messages, normalize_messages
from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.scoring.tokens import load_tokenizer, tokenizer_fingerprint
from hcapo_store.storage.store import Store


class RenderRejected(Exception):
    pass


@dataclass
class Alignment:
    """Where each step's action sits in the episode's ids, or why it cannot be placed."""

    input_ids: list[int]
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # step_index -> [start, end)
    refused: dict[int, str] = field(default_factory=dict)  # step_index -> reason
    flattened: bool = False


class EpisodeRenderer:
    """Renders a whole episode with a chat template and places each step's action in it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.encoder = SegmentEncoder(tokenizer)

    def _render(self, messages: list[dict], generation: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception as exc:  # templates raise anything (TypeError, TemplateError, ...)
            raise RenderRejected(f"{type(exc).__name__}: {exc}") from exc

    def align(self, messages: list[dict[str, Any]], steps: list[tuple[int, int]]) -> Alignment:
        """``steps``: (step_index, message_index). Flattens tool traffic when the template rejects it
        (as scoring does), for the whole episode so every span lives in one rendering."""
        try:
            return self._align(normalize_messages(messages), steps, flattened=False)
        except RenderRejected:
            pass
        try:
            return self._align(flatten_messages(messages), steps, flattened=True)
        except RenderRejected as exc:
            raise ExportError(f"the chat template cannot render this episode: {exc}") from exc

    def _align(self, msgs: list[dict], steps: list[tuple[int, int]], *, flattened: bool) -> Alignment:
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


def scorer_tokenizer(store: Store, scorer_id: str, tokenizer_dir: str | Path) -> tuple[Any, dict[str, Any]]:
    """The tokenizer in ``tokenizer_dir`` and its fingerprint, refused unless it is the scorer's."""
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load tokenizer {tokenizer_dir}: {exc}") from exc
    mine = tokenizer_fingerprint(tokenizer, tokenizer_dir)
    theirs = scorer_spec(store, scorer_id).get("tokenizer") or {}
    for key in ("files_sha256", "chat_template_sha256"):
        if theirs.get(key) != mine[key]:
            raise ExportError(
                f"tokenizer {tokenizer_dir} is not the one scorer {scorer_id[:12]} used "
                f"({key} differs; the scorer used {theirs.get('name', '?')!r}): pass that tokenizer directory"
            )
    return tokenizer, mine
