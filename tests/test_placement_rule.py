"""The episode layout's placement equals its plain, slow rule (``placement.place_by_rule``).

``Placer.place`` (the linear walk over three renderings, pieces tokenized by the segment
encoder) must give, for every step, the same token span or the same kind of refusal as the
rule applied step by step with ``tokenizer.apply_chat_template`` and one plain tokenization.
On the shared samples (the two long ones included) and on synthetic long sessions.
"""

from __future__ import annotations

from typing import Any

import pytest
from _shared import SHARED
from _tokenizers import episode, real_tokenizer

from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.placement import Placement, Placer, place_by_rule
from hcapo_store.rendering.prompts import inject_hindsight, normalize_messages
from hcapo_store.rendering.segments import SegmentEncoder
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store

SAMPLE_DIRS = [SHARED / "samples" / "trajectories", SHARED / "samples" / "long"]


def _assistant_steps(msgs: list[dict]) -> list[tuple[int, int]]:
    return list(enumerate(m for m, msg in enumerate(msgs) if m and msg["role"] == "assistant"))


def _outcome(placement: Placement) -> dict[int, Any]:
    """Per step: its token span, or the kind of its refusal (the words before the colon)."""
    out: dict[int, Any] = {i: (s.start, s.end) for i, s in placement.spans.items()}
    out.update({i: reason.split(":")[0] for i, reason in placement.refused.items()})
    return out


def _assert_equal_to_rule(tok: Any, msgs: list[dict], steps: list[tuple[int, int]], required: bool) -> Placement:
    # As the episode layout builds it (rendering/episode_layout.py): with the segment encoder.
    fast = Placer(tok, reasoning_required=required, encoder=SegmentEncoder(tok)).place(msgs, steps)
    rule = place_by_rule(tok, msgs, steps, reasoning_required=required)
    assert fast.text == rule.text and fast.ids == rule.ids
    assert _outcome(fast) == _outcome(rule)
    return rule


# qwen2.5 in the slow tier (~7 s each): the same comparison as the qwen3 cases, another real template
@pytest.mark.parametrize("name", ["qwen3", pytest.param("qwen2.5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("required", [False, True])
def test_the_layouts_placement_equals_the_rule_on_the_samples(store: Store, name: str, required: bool) -> None:
    tok = real_tokenizer(name)
    dirs = [d for d in SAMPLE_DIRS if d.is_dir()]
    if not dirs:
        pytest.skip(f"the shared samples {SAMPLE_DIRS[0]} are absent")
    ingest(store, dirs)
    compared = placed = 0
    with store.engine.connect() as conn:
        for (episode_id,) in store.query("SELECT id FROM episodes ORDER BY id")[1]:
            msgs = inject_hindsight(normalize_messages(load_messages(conn, episode_id)), "HINDSIGHT")
            steps = _assistant_steps(msgs)
            rule = _assert_equal_to_rule(tok, msgs, steps, required)
            compared += len(steps)
            placed += len(rule.spans)
    assert compared > 250 and placed > 100  # the long samples alone have hundreds of steps


@pytest.mark.parametrize("seed", [0, 1])
def test_the_layouts_placement_equals_the_rule_on_long_synthetic_sessions(seed: int) -> None:
    tok = real_tokenizer("qwen3")
    messages, _, steps = episode(seed, steps=150, tool_chars=120)
    msgs = inject_hindsight(normalize_messages(messages), "HINDSIGHT")
    wanted = sorted(((s["step_index"], s["message_index"]) for s in steps), key=lambda p: p[1])
    rule = _assert_equal_to_rule(tok, msgs, wanted, required=False)
    assert len(rule.spans) == 150


def test_the_rule_catches_a_span_one_token_short() -> None:
    """The comparison can fail: a placement with one span cut by a token differs from the rule."""
    tok = real_tokenizer("qwen3")
    messages, _, steps = episode(2, steps=10, tool_chars=50)
    msgs = normalize_messages(messages)
    wanted = sorted(((s["step_index"], s["message_index"]) for s in steps), key=lambda p: p[1])
    fast = Placer(tok, reasoning_required=False).place(msgs, wanted)
    rule = place_by_rule(tok, msgs, wanted, reasoning_required=False)
    index, span = next(iter(fast.spans.items()))
    fast.spans[index] = type(span)(span.start, span.end - 1, span.char_start, span.char_end, span.end_of_turn)
    assert _outcome(fast) != _outcome(rule)
