"""Per-step sliding/window prompts over long sessions: bounded renders whose prompts are the
whole history's, at a cost linear in the session (rendering/prompts.py, docs/SCORING.md)."""

from __future__ import annotations

import pytest
from _tokenizers import CHATML_WITH_BOS, bos_tokenizer, episode, named_tokenizer

from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import StepPrompt


def _equal_to_whole_history(builder: PromptBuilder, seeds=range(3), **shape) -> list:
    results = []
    for seed in seeds:
        messages, outcome, steps = episode(seed, **shape)
        fast = builder.build_episode(messages, outcome, steps)
        whole = [builder.build_step_reference(messages, outcome, s) for s in steps]
        assert fast == whole, seed
        results += fast
    return results


@pytest.mark.parametrize(
    ("name", "truncation", "max_context"),
    [
        *[(name, truncation, 700) for name in ("demo", "qwen3", "qwen2.5") for truncation in ("sliding", "window")],
        ("qwen3", "sliding", 2000),
        ("qwen2.5", "window", 2000),
    ],
)
def test_bounded_renders_give_the_whole_histories_prompts(name, truncation, max_context, tmp_path, demo_tokenizer_dir):
    """Every step of 36-step sessions (reasoning, tool calls, a user turn every five steps,
    which makes Qwen3 drop earlier reasoning) equals its build on the whole history: ids,
    span, and the count of history ids left out. Most steps were built bounded."""
    builder = PromptBuilder(
        named_tokenizer(name, tmp_path, demo_tokenizer_dir),
        max_context=max_context,
        max_logprob_tokens=64,
        truncation=truncation,
    )
    results = _equal_to_whole_history(builder, seeds=[0], steps=36, tool_chars=600)
    results += _equal_to_whole_history(builder, seeds=[7], steps=36, tool_chars=600, extra_user_turns=False)
    prompts = [r for r in results if isinstance(r, StepPrompt)]
    assert builder.whole_history_episodes == 0
    assert builder.bounded_steps > len(results) // 3
    assert sum(1 for p in prompts if p.truncated_prefix_tokens) >= builder.bounded_steps


@pytest.mark.parametrize("name", ["demo", "qwen3"])
def test_the_policy_span_on_bounded_renders(name, tmp_path, demo_tokenizer_dir):
    builder = PromptBuilder(named_tokenizer(name, tmp_path, demo_tokenizer_dir), max_context=900, action_span="policy")
    _equal_to_whole_history(builder, seeds=[1], steps=36, tool_chars=600)
    assert builder.bounded_steps > 0 and builder.whole_history_episodes == 0


def _rendered_messages(builder: PromptBuilder, steps: int) -> int:
    """How many messages the chat template renders to build one session's steps."""
    counted = []
    render = builder._render

    def counting(messages, *, generation):
        counted.append(len(messages))
        return render(messages, generation=generation)

    builder._render = counting  # type: ignore[method-assign]
    messages, outcome, rows = episode(3, steps=steps, tool_chars=600, extra_user_turns=False)
    builder.build_episode(messages, outcome, rows)
    return sum(counted)


@pytest.mark.parametrize("truncation", ["sliding", "window"])
def test_the_cost_grows_linearly_with_the_session(truncation, tmp_path, demo_tokenizer_dir):
    """Counted in rendered messages, not in seconds: doubling a session (long past
    --max-context) doubles the work, where rendering each step's whole history quadruples it."""
    tok = named_tokenizer("demo", tmp_path, demo_tokenizer_dir)
    work = {n: _rendered_messages(PromptBuilder(tok, max_context=1000, truncation=truncation), n) for n in (80, 160)}
    assert 1.6 < work[160] / work[80] < 2.5, work
    whole = {n: n * n for n in (80, 160)}  # about what whole histories cost: ~2n messages per step
    assert work[160] < whole[160] / 4


NUMBERED = CHATML_WITH_BOS.replace(
    "\n{{ m.content }}", "\n{% if m.role == 'tool' %}#{{ loop.index }} {% endif %}{{ m.content }}"
)
COUNTED_HEAD = CHATML_WITH_BOS.replace(
    "{{ bos_token }}",
    "{{ bos_token }}[{{ messages | selectattr('role', 'equalto', 'tool') | list | length }} tool results]",
)


@pytest.mark.parametrize("template", [NUMBERED, COUNTED_HEAD], ids=["numbered-turns", "length-in-the-head"])
def test_a_template_a_window_cannot_stand_for_renders_whole_histories(template, tmp_path):
    """A template that numbers its tool results, or counts them in its head,
    renders a window unlike the same messages in the whole history: the check against
    whole-history builds (or the head's own render) catches it, and the episode is built on
    whole histories, correct and counted as such."""
    builder = PromptBuilder(bos_tokenizer(tmp_path, template=template), max_context=500, max_logprob_tokens=0)
    results = _equal_to_whole_history(builder, seeds=[0, 1], steps=30, tool_chars=600, extra_user_turns=False)
    assert any(isinstance(r, StepPrompt) and r.truncated_prefix_tokens for r in results)
    assert builder.whole_history_episodes == 2 and builder.bounded_steps == 0


def test_some_steps_in_any_order(tmp_path, demo_tokenizer_dir):
    """A run resumes with some steps of a session, or gets them out of order: each still
    equals its whole-history build (a step before its chain's last starts a new chain)."""
    builder = PromptBuilder(named_tokenizer("demo", tmp_path, demo_tokenizer_dir), max_context=700)
    messages, outcome, steps = episode(4, steps=32, tool_chars=600)
    for subset in (steps[::3], steps[20:], list(reversed(steps[16:])), [steps[-1]], steps[24:] + steps[:24]):
        built = builder.build_episode(messages, outcome, subset)
        assert built == [builder.build_step_reference(messages, outcome, s) for s in subset]
    assert builder.bounded_steps > 0 and builder.whole_history_episodes == 0


def test_a_template_that_rejects_tool_messages_flattens_and_stays_bounded(tmp_path):
    """Flattened, a tool result is a user message to the template, but it is not a user turn
    of the session: the chain reaches across it, and the check still holds the prompts to
    their whole-history builds."""
    template = (
        "{% for m in messages %}{% if m.role == 'tool' or m.tool_calls %}"
        "{{ raise_exception('no tools') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    builder = PromptBuilder(bos_tokenizer(tmp_path, template=template), max_context=500, max_logprob_tokens=0)
    results = _equal_to_whole_history(builder, seeds=[0, 1], steps=30, tool_chars=600, extra_user_turns=False)
    assert any(isinstance(r, StepPrompt) and r.flattened and r.truncated_prefix_tokens for r in results)
    assert builder.bounded_steps > 0 and builder.whole_history_episodes == 0
