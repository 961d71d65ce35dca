"""The per-step rule (rendering/prompt_rule.py) and the fast strategies proven against it.

- ``turns``: ``build_episode`` (turn_windows.TurnWindows: a guessed window, walked to its
  neighbour) equals ``build_step_reference`` (prompt_rule.whole_turns: every start scanned
  from the earliest, each window rendered and tokenized whole) on every step.
- ``sliding``/``window`` over long sessions (bounded.BoundedRenders): the check after each
  episode rebuilds the last step of **every** chain on its whole history. A template built
  to differ only inside a middle chain is caught (the episode falls back to whole-history
  builds, the rule's ids), where the former check (the last step, halving back) lets the
  wrong prompts through: shown here by putting that check back.
"""

from __future__ import annotations

import pytest
from _tokenizers import CHATML_WITH_BOS, bos_tokenizer, episode, named_tokenizer

from hcapo_store.rendering import prompts
from hcapo_store.rendering.bounded import checked_positions
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import StepPrompt


# qwen2.5 is in the slow tier (~30 s loaded): the same rule, and tests/test_differential.py
# sweeps it on both real templates in the fast tier.
@pytest.mark.parametrize("name", ["demo", "chatml-bos", "qwen3", pytest.param("qwen2.5", marks=pytest.mark.slow)])
def test_turn_windows_give_the_whole_turns_rule(name, tmp_path, demo_tokenizer_dir):
    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    for span in ("rendered", "policy"):
        builder = PromptBuilder(tok, max_context=900, truncation="turns", max_logprob_tokens=256, action_span=span)
        cut = 0
        for seed in range(2):
            messages, outcome, steps = episode(seed, steps=18, tool_chars=500)
            fast = builder.build_episode(messages, outcome, steps)
            assert fast == [builder.build_step_reference(messages, outcome, s) for s in steps], (span, seed)
            cut += sum(1 for p in fast if isinstance(p, StepPrompt) and p.truncated_prefix_tokens)
        assert cut > 5  # windows left turns out: the rule was exercised past the budget


def test_every_chains_last_step_is_checked():
    # 100 bounded steps in three chains: the former picks were {99, 49, 24, 12, 6, 3, 1, 0}
    chains = [0] * 40 + [1] * 40 + [2] * 20
    picks = checked_positions(chains)
    assert {39, 79, 99} <= set(picks)  # the last of each chain
    assert {99, 49, 24, 12, 6, 3, 1, 0} <= set(picks)  # and the halving from the last, as before
    assert picks == sorted(picks, reverse=True)
    assert checked_positions([]) == [] and checked_positions([5]) == [0]
    # a chain of one step among many: still its own pick
    assert 57 in checked_positions([0] * 57 + [1] + [2] * 42)


# Tool results numbered by their place in the rendered conversation, but only while the last
# user message says MIDDLE: a window renders them unlike the whole history there, and only there.
MIDDLE_ONLY = CHATML_WITH_BOS.replace(
    "{{ bos_token }}",
    "{{ bos_token }}{% set ns = namespace(last='') %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = m.content %}{% endif %}{% endfor %}",
).replace(
    "\n{{ m.content }}",
    "\n{% if m.role == 'tool' and 'MIDDLE' in ns.last %}#{{ loop.index }} {% endif %}{{ m.content }}",
)


def _with_user_turns(steps: int, turns: dict[int, str]):
    """A 70-step session with user turns before the given steps (three chains)."""
    messages, outcome, rows = episode(0, steps=steps, tool_chars=600, extra_user_turns=False)
    by_message = {r["message_index"]: r for r in rows}
    out: list[dict] = []
    for i, message in enumerate(messages):
        row = by_message.get(i)
        if row is not None:
            if row["step_index"] in turns:
                out.append({"role": "user", "content": turns[row["step_index"]]})
            row["message_index"] = len(out)
        out.append(message)
    return out, outcome, rows


def _former_check(chains):
    """The check before: the episode's last bounded step, halving back (no per-chain picks)."""
    picks, n = set(), len(chains) - 1
    while n > 0:
        picks.add(n)
        n //= 2
    return sorted(picks | ({0} if chains else set()), reverse=True)


# ~17 s (the rule on 70 steps, twice): slow; test_every_chains_last_step_is_checked keeps the
# per-chain picks in the fast tier, tests/test_bounded_history.py the bounded renders.
@pytest.mark.slow
def test_a_template_that_differs_only_inside_a_middle_chain_is_caught(tmp_path, monkeypatch):
    tok = bos_tokenizer(tmp_path, template=MIDDLE_ONLY)
    # chains: steps 0-11, 12-19 (after "MIDDLE"), 20-69; the middle chain's bounded steps sit
    # between the former check's picks
    messages, outcome, steps = _with_user_turns(70, {12: "Continue. MIDDLE", 20: "Continue."})

    def build() -> tuple[PromptBuilder, list]:
        builder = PromptBuilder(tok, max_context=500, max_logprob_tokens=0)
        return builder, builder.build_episode(messages, outcome, steps)

    rule = [
        PromptBuilder(tok, max_context=500, max_logprob_tokens=0).build_step_reference(messages, outcome, s)
        for s in steps
    ]
    builder, built = build()
    assert built == rule  # the rule's ids, every step
    assert builder.whole_history_episodes == 1 and builder.bounded_steps == 0  # caught: built whole

    # The former check does not see it: the wrong prompts of the middle chain would be kept.
    monkeypatch.setattr(prompts, "checked_positions", _former_check)
    former, built = build()
    assert former.whole_history_episodes == 0 and former.bounded_steps > 40
    wrong = [s["step_index"] for s, b, r in zip(steps, built, rule, strict=True) if b != r]
    assert wrong and all(12 <= w < 20 for w in wrong)  # only inside the middle chain
    monkeypatch.undo()

    # Without MIDDLE the same template renders windows as whole histories: bounded, unchanged.
    plain, outcome, steps = _with_user_turns(70, {12: "Continue.", 20: "Continue."})
    builder = PromptBuilder(tok, max_context=500, max_logprob_tokens=0)
    assert builder.build_episode(plain, outcome, steps) == [
        builder.build_step_reference(plain, outcome, s) for s in steps
    ]
    assert builder.whole_history_episodes == 0 and builder.bounded_steps > 40
