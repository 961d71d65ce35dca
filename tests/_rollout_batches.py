"""A small GRPO batch as TRL hands it to an advantage source: completions of demo-vocabulary signs
(they re-tokenize to themselves), each ended by EOS, all trained; by default one group of four."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # trl_grpo imports TRL: the tests that use this skip without it first
    from hcapo_store.training.trl_grpo import RolloutBatch

SIGNS = ["!#$", "#!", "$$!(", "(+"]


def sign_batch(
    tok: Any,
    model: Any,
    *,
    step: int = 0,
    prompt_text: str = "Write some signs.",
    signs: list[str] = SIGNS,
    rewards: list[float] | None = None,
    group_size: int | None = None,
    mode: str = "train",
    earlier_turn: bool = True,
) -> RolloutBatch:
    """``signs`` as one batch (``rewards`` default 1, 0, 1, 0, ...), in groups of ``group_size``
    (default: one group), after the user's prompt and, with ``earlier_turn``, an earlier turn of
    the agent: then each episode has two steps, so HCAPO's ratio has steps to compare (one-step
    episodes are refused as plain GRPO: tests/test_trl_batches.py)."""
    from hcapo_store.training.trl_grpo import RolloutBatch

    prompt = [{"role": "user", "content": prompt_text}]
    if earlier_turn:
        prompt += [{"role": "assistant", "content": "!#"}, {"role": "user", "content": "More."}]
    prompt_ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
    completion_ids = [tok.encode(c, add_special_tokens=False) + [tok.eos_token_id] for c in signs]
    n = len(signs)
    rewards = [float(k % 2 == 0) for k in range(n)] if rewards is None else [float(r) for r in rewards]
    return RolloutBatch(
        step=step,
        prompts=[prompt] * n,
        completions=[[{"role": "assistant", "content": c}] for c in signs],
        prompt_ids=[prompt_ids] * n,
        completion_ids=completion_ids,
        loss_mask=[[1] * len(c) for c in completion_ids],
        rewards=rewards,
        groups=[k // (group_size or n) for k in range(n)],
        trl_advantages=[1.0 if r > 0 else -1.0 for r in rewards],
        inputs=[{}] * n,
        model=model,
        mode=mode,
    )
