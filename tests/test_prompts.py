"""Prompt building: hindsight text, normalisation, exact spans, fast path == reference path."""

from __future__ import annotations

import json

import pytest
from _tokenizers import bos_tokenizer, episode, real_tokenizer

from hcapo_store.rendering.prompts import (
    HINDSIGHT_TEMPLATE,
    TRUNCATION_MARKER,
    PromptBuilder,
    flatten_messages,
    hindsight_text,
    normalize_messages,
    template_hash,
)
from hcapo_store.rendering.requests import PromptFailure, StepPrompt
from hcapo_store.rendering.segments import SegmentEncoder
from hcapo_store.rendering.template import render_chat
from hcapo_store.rendering.tokenizers import tokenizer_fingerprint

OUTCOME = {
    "reward": 0.4795,
    "phase": "executing",
    "plan_score": 0.72,
    "plan": [{"id": "S1"}, {"id": "S2"}],
    "frozen_scores": {"S1": 0.5845, "S2": 0.412},
}


def test_hindsight_text_is_the_original_block():
    step = {"phase": "executing", "subtask_id": "S2", "subtask_reward": 0.412}
    assert hindsight_text(OUTCOME, step) == (
        "[HINDSIGHT — This is post-hoc scoring context, not visible during generation]\n"
        "Trajectory outcome:\n"
        "- Final reward: 0.4795\n"
        "- Phase reached: executing\n"
        "- Plan score: 0.72\n"
        "- Subtask scores: S1=0.585, S2=0.412\n"
        "- Subtasks completed: 2/2\n"
        "- Current subtask: S2\n"
        "- Current subtask score: 0.412"
    )


def test_hindsight_text_nulls_and_defaults():
    outcome = {"reward": 1, "phase": None, "plan_score": None, "plan": None, "frozen_scores": {}}
    step = {"phase": "planning", "subtask_id": None, "subtask_reward": None}
    text = hindsight_text(outcome, step)
    assert "- Phase reached: ?\n- Plan score: 0\n- Subtask scores: none\n- Subtasks completed: 0/1\n" in text
    assert text.endswith("- Current subtask: planning\n- Current subtask score: n/a")
    assert hindsight_text(outcome, {**step, "subtask_reward": -1.0}).endswith("n/a")
    assert template_hash(HINDSIGHT_TEMPLATE) != template_hash(HINDSIGHT_TEMPLATE + " ")


def test_bad_hindsight_template_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match="hindsight template"):
        PromptBuilder(bos_tokenizer(tmp_path), hindsight_template="{unknown_field}")


def test_arguments_become_mappings_in_qwen25_render():
    tok = real_tokenizer("qwen2.5")
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}},
                {"id": "b", "type": "function", "function": {"name": "bash", "arguments": "not json"}},
            ],
        },
    ]
    rendered = tok.apply_chat_template(normalize_messages(messages), tokenize=False)
    assert '"arguments": {"command": "ls -la"}' in rendered
    assert '"arguments": "not json"' in rendered
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls -la"}'  # input untouched


def test_flattening_matches_the_original_text():
    messages = [
        {
            "role": "assistant",
            "content": "x",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "bash", "arguments": '{"c": 1}'}}],
        },
        {"role": "tool", "name": "bash", "tool_call_id": "a", "content": "out"},
    ]
    assert flatten_messages(messages) == [
        {"role": "assistant", "content": 'x\n[Tool Call: bash]\n{"c": 1}'},
        {"role": "user", "content": "[Tool Result: bash]\nout"},
    ]


def _compare(builder: PromptBuilder, seed: int, **kwargs) -> list[StepPrompt | PromptFailure]:
    messages, outcome, steps = episode(seed, **kwargs)
    fast = builder.build_episode(messages, outcome, steps)
    reference = [builder.build_step_reference(messages, outcome, s) for s in steps]
    assert fast == reference
    return fast


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
@pytest.mark.parametrize("max_context", [32768, 700])
def test_fast_path_equals_reference_on_real_tokenizers(name, max_context):
    builder = PromptBuilder(real_tokenizer(name), max_context=max_context, max_logprob_tokens=64)
    assert builder.encoder.fast_path_off_reason is None
    results = [r for seed in range(3) for r in _compare(builder, seed, tool_chars=1500 if seed == 2 else 400)]
    prompts = [r for r in results if isinstance(r, StepPrompt)]
    assert len(prompts) > len(results) // 2
    for p in prompts:
        assert 0 < p.first_scored < len(p.input_ids) <= max_context
        assert p.scored_tokens + p.skipped_action_tokens == p.total_action_tokens
    if max_context < 1000:
        assert any(p.truncated_prefix_tokens for p in prompts)


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_segment_offsets_equal_the_tokenizer_offsets(name, tmp_path):
    """Long renderings are tokenized piece by piece: ids and offsets equal the tokenizer's own."""
    tok = real_tokenizer(name)
    encoder = SegmentEncoder(tok)
    assert encoder.fast_path_off_reason is None
    texts = ["", "plain text, no added token", "<|im_end|>", "<|im_start|><|im_end|>x"]
    for seed in range(3):
        messages, _, _ = episode(seed, steps=10, tool_chars=600)
        texts.append(render_chat(tok, normalize_messages(messages), generation=False))
    texts.append(texts[-1] + " caf\u00e9 \U0001f600 \u4e2d\u6587 <|im_start|>\n\n  trailing ")
    for text in texts:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoder.offsets(text)
        expected = [tuple(o) for o in enc["offset_mapping"]]
        assert ids == enc["input_ids"] and len(offsets) == len(expected), text[:80]
        # read as the placement does (scattered, backwards, sliced), then whole
        assert [offsets[i] for i in range(len(expected) - 1, -1, -7)] == expected[::-7]
        assert offsets[-1:] == expected[-1:] and offsets[3:40:5] == expected[3:40:5]
        assert list(offsets) == expected, text[:80]
        with pytest.raises(IndexError):
            offsets[len(expected)]
        assert encoder.encode_once(text) == tok.encode(text, add_special_tokens=False)

    bos = bos_tokenizer(tmp_path)  # a tokenizer whose fast path is off answers through the tokenizer
    from tokenizers import pre_tokenizers

    bos.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    slow = SegmentEncoder(bos)
    assert slow.fast_path_off_reason is not None
    enc = bos("a b <|im_end|> c", add_special_tokens=False, return_offsets_mapping=True)
    assert slow.offsets("a b <|im_end|> c") == (enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]])


def test_qwen3_history_rewrite_is_an_alignment_failure():
    # Qwen3 renders the last assistant message with an empty think block and drops it once
    # the message is no longer last: two assistant messages in a row misalign the prefix.
    builder = PromptBuilder(real_tokenizer("qwen3"))
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "first"},
        {"role": "assistant", "content": "second"},
    ]
    step = {"step_index": 1, "message_index": 2, "phase": "planning", "subtask_id": None, "subtask_reward": 0.5}
    result = builder.build_step(messages, OUTCOME, step)
    assert isinstance(result, PromptFailure) and result.reason == "alignment"
    assert builder.build_step_reference(messages, OUTCOME, step) == result


def test_bos_emitting_template_keeps_exact_spans(tmp_path):
    tok = bos_tokenizer(tmp_path)
    assert tok("a")["input_ids"][0] == tok.bos_token_id  # the tokenizer adds BOS on plain encode
    # (room for the anchor, its hindsight block 300 ids of this tiny vocabulary, and some steps cut)
    builder = PromptBuilder(tok, max_context=700, max_logprob_tokens=0)
    assert builder.encoder.fast_path_off_reason is None
    truncated = 0
    for seed in range(3):
        for p in _compare(builder, seed, thinking=False):
            assert isinstance(p, StepPrompt)
            truncated += bool(p.truncated_prefix_tokens)
            if not p.truncated_prefix_tokens:
                assert p.input_ids.count(tok.bos_token_id) == 1 and p.input_ids[0] == tok.bos_token_id
    assert truncated
    fingerprint = tokenizer_fingerprint(tok, tmp_path)
    assert fingerprint["adds_bos"] is True and fingerprint["chat_template_sha256"]


def test_template_without_special_tokens_and_metaspace_fallback(tmp_path):
    plain = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    builder = PromptBuilder(bos_tokenizer(tmp_path / "plain", template=plain))
    results = _compare(builder, 4, thinking=False)
    assert any(isinstance(r, StepPrompt) for r in results)

    from tokenizers import pre_tokenizers

    tok = bos_tokenizer(tmp_path / "meta")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    builder = PromptBuilder(tok)
    assert builder.encoder.fast_path_off_reason is not None
    _compare(builder, 5, thinking=False)


def test_generation_prompt_that_is_not_a_prefix_fails_alignment(tmp_path):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant (draft)\n{% endif %}"
    )
    builder = PromptBuilder(bos_tokenizer(tmp_path, template=template))
    results = _compare(builder, 6, thinking=False)
    assert {r.reason for r in results} == {"alignment"}


def test_template_rejection_flattens_and_records_it(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'tool' or m.tool_calls %}"
        "{{ raise_exception('no tools') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    builder = PromptBuilder(bos_tokenizer(tmp_path, template=template))
    results = _compare(builder, 7, thinking=False)
    assert any(isinstance(r, StepPrompt) and r.flattened for r in results)


def test_empty_action_fails(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    )
    builder = PromptBuilder(bos_tokenizer(tmp_path, template=template))
    results = _compare(builder, 8, thinking=False)
    assert {r.reason for r in results} == {"empty_action"}


def _single_step(prefix_words: int, action_words: int):
    messages = [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "data " * prefix_words},
        {"role": "assistant", "content": "step " * action_words},
    ]
    step = {"step_index": 1, "message_index": 3, "phase": "planning", "subtask_id": None, "subtask_reward": 0.5}
    return messages, step


def test_truncation_keeps_anchor_marker_tail_and_whole_action(tmp_path):
    tok = bos_tokenizer(tmp_path)
    messages, step = _single_step(900, 50)
    full = PromptBuilder(tok, max_logprob_tokens=0).build_step(messages, OUTCOME, step)
    builder = PromptBuilder(tok, max_context=600, max_logprob_tokens=0)
    cut = builder.build_step(messages, OUTCOME, step)
    assert cut == builder.build_step_reference(messages, OUTCOME, step)
    action = full.input_ids[full.first_scored :]
    assert len(cut.input_ids) == 600 and cut.input_ids[-len(action) :] == action
    anchor_text = tok.apply_chat_template(
        [{"role": "user", "content": messages[0]["content"] + "\n\n" + hindsight_text(OUTCOME, step)}], tokenize=False
    )
    anchor = tok.encode(anchor_text, add_special_tokens=False)
    marker = tok.encode(TRUNCATION_MARKER, add_special_tokens=False)
    prefix_budget = 600 - len(action)
    assert prefix_budget > len(anchor) + len(marker)
    tail = full.input_ids[: full.first_scored][-(prefix_budget - len(anchor) - len(marker)) :]
    assert cut.input_ids[: cut.first_scored] == anchor + marker + tail
    # the history's ids left out: the marker is none of it
    assert cut.truncated_prefix_tokens == full.first_scored - (prefix_budget - len(marker))
    assert (cut.total_action_tokens, cut.skipped_action_tokens) == (len(action), 0)


def _anchor_and_marker(tok, first_content: str, step) -> tuple[list[int], list[int]]:
    """The anchor (the first message with the hindsight block) and the marker, tokenized here."""
    content = first_content + ("\n\n" + hindsight_text(OUTCOME, step) if step is not None else "")
    anchor_text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    return tok.encode(anchor_text, add_special_tokens=False), tok.encode(TRUNCATION_MARKER, add_special_tokens=False)


def test_a_long_action_keeps_the_whole_hindsight_anchor_and_its_own_tail(tmp_path):
    """No room for the anchor beside the whole action: the anchor stays whole (the outcome is
    at its end) and the action keeps its tail, down to the last id that fits."""
    tok = bos_tokenizer(tmp_path)
    messages, step = _single_step(900, 50)
    action_len = PromptBuilder(tok).build_step(messages, OUTCOME, step).total_action_tokens
    anchor, marker = _anchor_and_marker(tok, "task", step)
    head = len(anchor) + len(marker)
    whole = PromptBuilder(tok, max_context=head + action_len, max_logprob_tokens=0)
    fits = whole.build_step(messages, OUTCOME, step)
    assert fits == whole.build_step_reference(messages, OUTCOME, step)
    assert fits.input_ids[:head] == anchor + marker and fits.skipped_action_tokens == 0
    for ctx in (head + action_len - 1, head + action_len // 2, head + 1):
        builder = PromptBuilder(tok, max_context=ctx, max_logprob_tokens=0)
        cut = builder.build_step(messages, OUTCOME, step)
        assert cut == builder.build_step_reference(messages, OUTCOME, step)
        assert len(cut.input_ids) == ctx and cut.input_ids[:head] == anchor + marker
        assert cut.first_scored == head and cut.input_ids[head:] == fits.input_ids[-(ctx - head) :]
        assert cut.skipped_action_tokens == action_len - (ctx - head)


def test_no_room_for_the_hindsight_anchor_fails_the_step_by_name(tmp_path):
    """An anchor and marker that fill --max-context: a `context` failure naming the sizes and
    the way out, never a prompt whose cut anchor lost the outcome (stored as hindsight's)."""
    tok = bos_tokenizer(tmp_path)
    messages, step = _single_step(900, 50)
    anchor, marker = _anchor_and_marker(tok, "task", step)
    head = len(anchor) + len(marker)
    for ctx in (head, head - 1, 40):
        builder = PromptBuilder(tok, max_context=ctx, max_logprob_tokens=0)
        failed = builder.build_step(messages, OUTCOME, step)
        assert failed == builder.build_step_reference(messages, OUTCOME, step)
        assert isinstance(failed, PromptFailure) and failed.reason == "context"
        assert f"--max-context {ctx}" in failed.message and f"above {head}" in failed.message
        assert f"hindsight block ({len(anchor)} ids)" in failed.message and len(f"context: {failed.message}") < 300


def test_a_baseline_scorer_cuts_its_anchor_as_the_original(tmp_path):
    """Without a hindsight block nothing can be lost but the task's end: the original's cut."""
    tok = bos_tokenizer(tmp_path)
    messages, step = _single_step(900, 50)
    action_len = PromptBuilder(tok, hindsight=False).build_step(messages, OUTCOME, step).total_action_tokens
    builder = PromptBuilder(tok, max_context=action_len + 4, max_logprob_tokens=0, hindsight=False)
    cut = builder.build_step(messages, OUTCOME, step)
    assert cut == builder.build_step_reference(messages, OUTCOME, step)
    anchor, marker = _anchor_and_marker(tok, "task", None)
    assert len(marker) > 4 and cut.first_scored == 4 and cut.input_ids[:4] == marker[:4]
    assert len(cut.input_ids) == action_len + 4


def test_action_alone_over_budget_keeps_its_tail_and_never_scores_position_zero(tmp_path):
    """Without a hindsight block (a baseline scorer), the original's rule: the action's tail alone."""
    tok = bos_tokenizer(tmp_path)
    messages, step = _single_step(20, 400)
    action_len = PromptBuilder(tok, hindsight=False).build_step(messages, OUTCOME, step).total_action_tokens
    cut = PromptBuilder(tok, max_context=100, max_logprob_tokens=0, hindsight=False).build_step(messages, OUTCOME, step)
    assert len(cut.input_ids) == 100 and cut.first_scored == 1  # SGLang starts one earlier: position 0
    assert cut.skipped_action_tokens == action_len - 99
    capped = PromptBuilder(tok, max_context=100, max_logprob_tokens=30, hindsight=False)
    capped_step = capped.build_step(messages, OUTCOME, step)
    assert capped_step.first_scored == 70 and capped_step.scored_tokens == 30


def test_action_alone_over_budget_with_hindsight_keeps_the_anchor(tmp_path):
    tok = bos_tokenizer(tmp_path)
    messages, step = _single_step(20, 400)
    anchor, marker = _anchor_and_marker(tok, "task", step)
    head = len(anchor) + len(marker)
    builder = PromptBuilder(tok, max_context=head + 60, max_logprob_tokens=30)
    cut = builder.build_step(messages, OUTCOME, step)
    assert cut == builder.build_step_reference(messages, OUTCOME, step)
    assert cut.input_ids[:head] == anchor + marker and len(cut.input_ids) == head + 60
    assert cut.first_scored == head + 30 and cut.scored_tokens == 30
    # the prefix past the anchor is left out (the task's message is the anchor, the rest is not there)
    whole = PromptBuilder(tok, max_logprob_tokens=0).build_step(messages, OUTCOME, step)
    assert cut.truncated_prefix_tokens == max(whole.first_scored - len(anchor), 0) > 0


def test_max_logprob_tokens_scores_the_suffix(tmp_path):
    tok = bos_tokenizer(tmp_path)
    messages, step = _single_step(20, 100)
    every = PromptBuilder(tok, max_logprob_tokens=-1).build_step(messages, OUTCOME, step)
    last = PromptBuilder(tok, max_logprob_tokens=10).build_step(messages, OUTCOME, step)
    assert every.input_ids == last.input_ids and every.skipped_action_tokens == 0
    assert last.scored_tokens == 10 and last.first_scored == len(last.input_ids) - 10
    assert last.skipped_action_tokens == every.total_action_tokens - 10


def test_fingerprint_of_real_tokenizer():
    tok = real_tokenizer("qwen3")
    from _tokenizers import SHARED_TOKENIZERS

    fp = tokenizer_fingerprint(tok, SHARED_TOKENIZERS / "qwen3")
    assert fp["files"] == ["tokenizer.json", "tokenizer_config.json"] and fp["adds_bos"] is False
    assert fp == tokenizer_fingerprint(tok, SHARED_TOKENIZERS / "qwen3")
    assert json.dumps(fp)
