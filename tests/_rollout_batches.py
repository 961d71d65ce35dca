"""A small GRPO batch as TRL hands it to an advantage source: one group of four completions of
demo-vocabulary signs (they re-tokenize to themselves), each ended by EOS, all trained."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # trl_grpo imports TRL: the tests that use this skip without it first
    from hcapo_store.training.trl_grpo import RolloutBatch

SIGNS = ["!#$", "#!", "$$!(", "(+"]


def sign_batch(tok: Any, model: Any, *, step: int = 0, prompt_text: str = "Write some signs.") -> RolloutBatch:
    from hcapo_store.training.trl_grpo import RolloutBatch

    # an earlier turn of the agent: each episode has two steps, so HCAPO's ratio has steps to compare
    # (one-step episodes are refused as plain GRPO: tests/test_trl_batches.py)
    prompt = [
        {"role": "user", "content": prompt_text},
        {"role": "assistant", "content": "!#"},
        {"role": "user", "content": "More."},
    ]
    prompt_ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
    completion_ids = [tok.encode(c, add_special_tokens=False) + [tok.eos_token_id] for c in SIGNS]
    return RolloutBatch(
        step=step,
        prompts=[prompt] * 4,
        completions=[[{"role": "assistant", "content": c}] for c in SIGNS],
        prompt_ids=[prompt_ids] * 4,
        completion_ids=completion_ids,
        loss_mask=[[1] * len(c) for c in completion_ids],
        rewards=[1.0, 0.0, 1.0, 0.0],
        groups=[0, 0, 0, 0],
        trl_advantages=[1.0, -1.0, 1.0, -1.0],
        inputs=[{}] * 4,
        model=model,
    )
