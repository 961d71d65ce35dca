"""A ``whole`` rendering without its steps placed (``EpisodeRenderer.whole_rendering``, whose
ids ``Handoff.rendered_ids(ep, "whole")`` answers until a step is placed): the hand-off compares
a row's ids with every member's renderings, and placing each member's steps only to compare ids
was ~a quarter of verl's hand-off call (bench/verl_handoff.py --ids turns).

Its ids must be those ``align(messages, steps, "whole")`` gives, token for token: on real
templates and synthetic sessions, where the template rejects tool messages (the flattened
rendering), and where it renders nothing (None: ``align``'s error stays ``align``'s); handed
back to ``align`` (``known``), the alignment is the one made without it, and a rendering of
other messages is not taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _tokenizers import CHATML_WITH_BOS, bos_tokenizer, episode, real_tokenizer

from hcapo_store.errors import ExportError
from hcapo_store.rendering.alignment import EpisodeRenderer

REJECTS_TOOLS = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REJECTS_ALL = "{{ raise_exception('this template renders nothing') }}"


def _sessions() -> list[tuple[list[dict[str, Any]], list[tuple[int, int]]]]:
    out = []
    for seed, kwargs in enumerate(
        [{}, {"thinking": False}, {"steps": 30, "tool_chars": 900}, {"extra_user_turns": False}, {"steps": 3}]
    ):
        messages, _, steps = episode(seed, **kwargs)
        out.append((messages, [(s["step_index"], s["message_index"]) for s in steps]))
    return out


def _assert_whole_ids(tok: Any) -> list[bool]:
    """whole_ids against the whole alignment, for each session, in the fast renderer and the
    rules-only one; which sessions were flattened."""
    flattened = []
    for fast in (True, False):
        sessions = _sessions()
        for k, (messages, steps) in enumerate(sessions):
            known = EpisodeRenderer(tok, fast=fast).whole_rendering(messages)
            aligned = EpisodeRenderer(tok, fast=fast).align(messages, steps, "whole")
            assert known is not None and known.ids == aligned.input_ids
            assert EpisodeRenderer(tok, fast=fast).align(messages, steps, "whole", known=known) == aligned
            other = EpisodeRenderer(tok, fast=fast).whole_rendering(sessions[k - 1][0])  # another session's
            assert EpisodeRenderer(tok, fast=fast).align(messages, steps, "whole", known=other) == aligned
            flattened.append(aligned.flattened)
    return flattened


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_the_ids_are_the_whole_alignments_on_real_templates(name: str) -> None:
    assert not any(_assert_whole_ids(real_tokenizer(name)))


def test_the_ids_are_the_whole_alignments_where_tool_messages_are_flattened(tmp_path: Path) -> None:
    tok = bos_tokenizer(tmp_path / "tok", template=REJECTS_TOOLS)
    flattened = _assert_whole_ids(tok)
    assert any(flattened)  # the sessions with tool calls went the flattened way
    assert not any(_assert_whole_ids(bos_tokenizer(tmp_path / "plain", template=CHATML_WITH_BOS)))  # the plain way


def test_no_rendering_at_all_is_aligns_error_to_give(tmp_path: Path) -> None:
    tok = bos_tokenizer(tmp_path / "tok", template=REJECTS_ALL)
    messages, steps = _sessions()[0]
    assert EpisodeRenderer(tok).whole_rendering(messages) is None
    with pytest.raises(ExportError, match="cannot render this episode"):
        EpisodeRenderer(tok).align(messages, steps, "whole")
