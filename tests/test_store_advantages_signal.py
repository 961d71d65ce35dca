"""StoreAdvantages on one hand-made GRPO batch the way TRL hands it over with
``mask_truncated_completions=True``: the hindsight signal reaches the trained tokens. Completions
that ended, with rewards that differ, get non-zero advantages on every token the loss trains; a
truncated completion (no end token, loss mask 0) is stored but gets 0, as TRL's loss ignores it;
a completion holding ids past the tokenizer (a policy whose embedding has more rows than the
tokenizer has ids, as Qwen3's 151,936 over 151,669) decodes to text whose tokens are not the
policy's ids: under ``strict=False`` it is refused and listed, never silently given a value; an
ended completion with no text holds no step of its episode: its 0 is listed in ``skipped``.
bench/gpu_trl.py's first H100 run trained only such rows and placed all zeros."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")
from _tiny_qwen3 import tiny_qwen3
from transformers import AutoTokenizer

from hcapo_store.storage.store import Store
from hcapo_store.training.trl_grpo import RolloutBatch, StoreAdvantages, place

GHOSTS = 16  # embedding rows past the tokenizer's ids


def test_ended_rows_carry_the_signal_truncated_rows_none_and_unknown_ids_are_refused(
    tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    tok = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))
    model = tiny_qwen3(len(tok) + GHOSTS, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompt = [
        {"role": "user", "content": "Write some signs."},
        {"role": "assistant", "content": "!!#"},
        {"role": "user", "content": "More."},
    ]
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    eos, ghost = tok.eos_token_id, len(tok) + 3

    def ids(s: str) -> list[int]:
        return tok(s, add_special_tokens=False)["input_ids"]

    # (text TRL decoded, the policy's ids, loss mask, reward): ended, ended, truncated, ended with an
    # unknown id, ended with no text
    rows = [
        ("!!#", [*ids("!!#"), eos], 1, 2.0),
        ("#", [*ids("#"), eos], 1, 0.0),
        ("!", ids("!"), 0, 1.0),
        ("!", [ghost, *ids("!"), eos], 1, 1.0),
        ("", [eos], 1, 0.5),
    ]
    n = len(rows)
    batch = RolloutBatch(
        step=0,
        prompts=[prompt] * n,
        completions=[[{"role": "assistant", "content": t}] for t, *_ in rows],
        prompt_ids=[prompt_ids] * n,
        completion_ids=[c for _, c, _, _ in rows],
        loss_mask=[[m] * len(c) for _, c, m, _ in rows],
        rewards=[r for *_, r in rows],
        groups=[0] * n,
        trl_advantages=[0.0] * n,
        inputs=[{}] * n,
        model=model,
    )
    with Store.open(str(tmp_path / "grpo.db")) as store:
        source = StoreAdvantages(
            store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "rollouts", run_id="s", strict=False
        )
        values = source(batch)
        placed = place(batch, values, max(len(c) for c in batch.completion_ids)).numpy()
        assert None not in source.episodes[0]  # every row stored, the truncated one too
        for i in (0, 1):  # ended, rewards differ: the signal on every trained token
            width = len(batch.completion_ids[i])
            assert np.isfinite(placed[i, :width]).all() and (placed[i, :width] != 0).all(), (i, placed[i])
        assert placed[0, 0] > placed[1, 0]  # the higher reward, the higher advantage
        assert not placed[2].any() and (0, 2) not in source.refused  # truncated, masked: nothing, and no refusal
        assert not placed[3].any() and list(source.refused) == [(0, 3)]  # unknown id: refused by name, listed
        assert "are not in the given ids" in next(iter(source.refused[(0, 3)].values()))
        assert not placed[4].any() and list(source.skipped) == [(0, 4)]  # no text, no step: its 0 is listed
        assert "holds no step" in source.skipped[(0, 4)]
        signal = source.signals[0]
        assert signal.hindsight_nonzero_steps > 0 and signal.advantage_nonzero_steps > 0
