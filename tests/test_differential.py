"""Issue 40: property-based differential tests, every fast strategy against its rule.

Hypothesis draws sessions (reasoning of any length, user turns at any position, tool results
from empty to long, non-ASCII and control characters) and a configuration (Qwen3 or Qwen2.5,
every truncation, both layouts, both action spans, ``max_context`` at a step's exact
whole-history length ±3 or well below it). The fast build must equal the rule's for every
step: ``build_episode`` against ``build_step_reference`` (per step), the episode layout
against the same layout in reference mode (``place_by_rule``, ``apply_chat_template``, the
backend tokenizer). No strategy may fall back to its rule at run time meanwhile (that would
be its check hiding a disagreement: verify.fallbacks() must not move). Derandomized, no example database, few examples: it stays cheap.
"""

from __future__ import annotations

import json

import pytest
from _hypothesis import session_settings
from _tokenizers import real_tokenizer
from hypothesis import example, given
from hypothesis import strategies as st

from hcapo_store.rendering import verify
from hcapo_store.rendering.episode_layout import EpisodeLayout
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import StepPrompt

WORDS = [
    "run",
    "test",
    "file",
    "path",
    "value",
    "data",
    "x",
    "42",
    "café",
    "東京",
    "✓",
    "\x07",
    "\t",
    " ",
    "  ",
    "\n",
    "{}",
]

words = st.lists(st.sampled_from(WORDS), min_size=0, max_size=60).map(" ".join)


@st.composite
def sessions(draw):
    messages = [{"role": "user", "content": "Task: " + draw(words)}]
    steps = []
    for s in range(draw(st.integers(1, 6))):
        if draw(st.booleans()) and draw(st.booleans()):
            messages.append({"role": "user", "content": "Continue. " + draw(words)})
        reasoning = draw(st.one_of(st.just(""), words, words.map(lambda w: (w + " ") * 4)))
        content = draw(words) or "ok"
        message = {
            "role": "assistant",
            "content": f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content,
        }
        call = draw(st.booleans())
        if call:
            arguments = json.dumps({"command": draw(words)}, ensure_ascii=False)
            message["tool_calls"] = [
                {"id": f"c{s}", "type": "function", "function": {"name": "bash", "arguments": arguments}}
            ]
        messages.append(message)
        steps.append(
            {
                "step_index": s,
                "message_index": len(messages) - 1,
                "phase": "executing",
                "subtask_id": None,
                "subtask_reward": 0.5,
            }
        )
        if call:
            body = draw(st.one_of(st.just(""), words, words.map(lambda w: w * 8)))
            messages.append({"role": "tool", "name": "bash", "tool_call_id": f"c{s}", "content": body})
    return messages, steps


def _issue_40_session():
    """Issue 40's case: long reasoning, a user turn at step 3 (Qwen3 then drops the earlier
    reasoning, so step 4's whole history fits exactly at its own length)."""
    import random

    rng = random.Random(0)
    vocabulary = "alpha beta gamma delta run test file path value data build step".split()

    def t(n: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(n))

    messages, steps = [{"role": "user", "content": "Task: " + t(20)}], []
    for s in range(10):
        if s == 3:
            messages.append({"role": "user", "content": "Continue. " + t(5)})
        messages.append({"role": "assistant", "content": f"<think>\n{t(150)}\n</think>\n\n{t(5)}"})
        steps.append(
            {
                "step_index": s,
                "message_index": len(messages) - 1,
                "phase": "executing",
                "subtask_id": None,
                "subtask_reward": 0.5,
            }
        )
    return messages, steps


OUTCOME = {"reward": 0.5, "phase": "executing", "plan_score": 0.5, "plan": [], "frozen_scores": {}}


@pytest.fixture(scope="module")
def tokenizers():
    return {name: real_tokenizer(name) for name in ("qwen3", "qwen2.5")}


@session_settings(30)
@given(
    session=sessions(),
    name=st.sampled_from(["qwen3", "qwen2.5"]),
    truncation=st.sampled_from(["sliding", "window", "turns"]),
    span=st.sampled_from(["rendered", "policy"]),
    layout=st.sampled_from(["per-step", "episode"]),
    at=st.integers(0, 5),
    delta=st.integers(-3, 3),
    far_below=st.booleans(),
)
@example(
    session=_issue_40_session(),
    name="qwen3",
    truncation="turns",
    span="rendered",
    layout="per-step",
    at=4,
    delta=0,
    far_below=False,
)
def test_the_fast_build_equals_the_rule(tokenizers, session, name, truncation, span, layout, at, delta, far_below):
    tok = tokenizers[name]
    messages, steps = session
    before = verify.fallbacks()
    whole = PromptBuilder(tok, max_context=1_000_000, max_logprob_tokens=0)
    lengths = [len(p.input_ids) for p in whole.build_episode(messages, OUTCOME, steps) if isinstance(p, StepPrompt)]
    if not lengths:
        return
    target = lengths[at % len(lengths)]
    max_context = max(target // 3 if far_below else target + delta, 8)
    if layout == "episode":
        fast = EpisodeLayout(PromptBuilder(tok, max_context=max_context, layout="episode"))
        rule = EpisodeLayout(PromptBuilder(tok, max_context=max_context, layout="episode", rendering="reference"))
        assert fast.requests(messages, OUTCOME, steps) == rule.requests(messages, OUTCOME, steps)
        assert verify.fallbacks() == before  # equal by the strategy itself, not by its run-time check
        return
    builder = PromptBuilder(tok, max_context=max_context, truncation=truncation, action_span=span, max_logprob_tokens=0)
    built = builder.build_episode(messages, OUTCOME, steps)
    for step, prompt in zip(steps, built, strict=True):
        assert prompt == builder.build_step_reference(messages, OUTCOME, step), step["step_index"]
    assert verify.fallbacks() == before  # equal by the strategy itself, not by its run-time check
