"""slime and prime-rl take HCAPO's advantages in their own shapes (training/adapters.py).

Neither is installable here (PyPI's `slime` is an unrelated package, prime-rl is not on PyPI),
so the shapes are those of their published source, read at THUDM/slime @624b824a and
PrimeIntellect-ai/prime-rl @559b4477 (each test names the file). The expected values come from
the tokenized export, a separate path from the Handoff the adapters use."""

from __future__ import annotations

import importlib
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_handoff import _pieces

from hcapo_store.errors import HandoffError
from hcapo_store.storage.store import Store
from hcapo_store.training.adapters import (
    prime_rl_advantages,
    prime_rl_sampled_advantages,
    slime_advantage_function,
)


@pytest.fixture
def pieces(store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path):
    handoff, rows = _pieces(store, samples, demo_tokenizer_dir, tmp_path)
    return handoff, rows[:3]


def _policy_tokens(row: dict) -> list[bool]:
    """The export's step spans: the policy's own tokens (what a trainer's sampled mask marks)."""
    own = [False] * len(row["token_ids"])
    for a, b in row["step_spans"]:
        own[a:b] = [True] * (b - a)
    return own


def _slime_rollout_data(rows: list[dict]) -> dict:
    """rollout_data as slime's actor holds it (slime/ray/rollout.py _convert_samples_to_train_data,
    backends/megatron_utils/actor.py _get_rollout_data): per sample its prompt + response
    ``tokens`` (long tensor), ``response_lengths``, ``loss_masks`` (int tensor over the response:
    1 on the policy's tokens, 0 on tool results) and ``sample_indices`` (Sample.index)."""
    data: dict = {"tokens": [], "response_lengths": [], "loss_masks": [], "sample_indices": [], "rewards": []}
    for k, row in enumerate(rows):
        cut = row["step_spans"][0][0]  # the prompt: everything before the first action
        data["tokens"].append(torch.tensor(row["token_ids"], dtype=torch.long))
        data["response_lengths"].append(len(row["token_ids"]) - cut)
        data["loss_masks"].append(torch.tensor(_policy_tokens(row)[cut:], dtype=torch.int))
        data["sample_indices"].append(100 + k)
        data["rewards"].append(0.0)
    return data


def _load_function(path: str):
    """slime/utils/misc.py load_function @624b824a: the module is what comes before the last dot."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def test_slimes_hook_sets_advantages_over_each_response(pieces, tmp_path: Path, monkeypatch) -> None:
    handoff, rows = pieces
    episodes = {100 + k: row["episode"] for k, row in enumerate(rows)}
    # the hook as slime loads it: a module of the user's, named by a dotted path
    (tmp_path / "hcapo_slime_hook.py").write_text(
        "from hcapo_store.training.adapters import slime_advantage_function\n"
        "HANDOFF = EPISODES = None\n"
        "advantages = slime_advantage_function(lambda args, data: HANDOFF, lambda index: EPISODES[index])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("hcapo_slime_hook")
    module.HANDOFF, module.EPISODES = handoff, episodes
    hook = _load_function("hcapo_slime_hook.advantages")
    data = _slime_rollout_data(rows)
    hook(Namespace(context_parallel_size=1, normalize_advantages=False), data)
    assert data["returns"] is data["advantages"] and len(data["advantages"]) == len(rows)
    for k, row in enumerate(rows):
        adv = data["advantages"][k]
        n = data["response_lengths"][k]
        # one float32 per response token (slime's log_probs: tokens[-n:], not shifted), 0 off the loss mask
        assert adv.dtype == torch.float32 and adv.shape == (n,)
        want = np.array(row["advantages"][-n:], dtype=np.float32) * data["loss_masks"][k].numpy()
        np.testing.assert_allclose(adv.numpy(), want, atol=1e-6)
    assert any(adv.numpy().any() for adv in data["advantages"])
    sys.modules.pop("hcapo_slime_hook", None)


def test_slimes_hook_refuses_what_would_misplace_or_rescale(pieces) -> None:
    handoff, rows = pieces
    hook = slime_advantage_function(handoff, {100 + k: row["episode"] for k, row in enumerate(rows)})
    with pytest.raises(HandoffError, match="context parallelism"):
        hook(Namespace(context_parallel_size=2, normalize_advantages=False), _slime_rollout_data(rows))
    with pytest.raises(HandoffError, match="--normalize-advantages"):
        hook(Namespace(context_parallel_size=1, normalize_advantages=True), _slime_rollout_data(rows))
    lenient = slime_advantage_function(
        handoff, {100 + k: row["episode"] for k, row in enumerate(rows)}, allow_whitening=True
    )
    data = _slime_rollout_data(rows)
    lenient(Namespace(context_parallel_size=1, normalize_advantages=True), data)
    assert len(data["advantages"]) == len(rows)
    # a loss mask that leaves out one of the policy's tokens: refused, naming the sample
    data = _slime_rollout_data(rows)
    first = int(np.flatnonzero(data["loss_masks"][1].numpy())[0])
    data["loss_masks"][1][first] = 0
    with pytest.raises(HandoffError, match=r"slime sample 1 \(index 101\): .*mask leaves it out"):
        hook(Namespace(context_parallel_size=1, normalize_advantages=False), data)


def test_prime_rl_training_sample_and_assign_advantages(pieces) -> None:
    """transports/rollouts/types.py TrainingSample: flat token_ids, bool mask of sampled tokens,
    advantages one per token (trainer/batch.py prepare_sample asserts the equal lengths);
    orchestrator/algo/routing.py assign_advantages: one value per sampled token, in order."""
    handoff, rows = pieces
    for row in rows:
        ids = row["token_ids"]
        mask = _policy_tokens(row)
        full = prime_rl_advantages(handoff, row["episode"], ids, mask)
        assert len(full) == len(ids)
        np.testing.assert_allclose(full, row["advantages"], atol=1e-6)
        sampled = prime_rl_sampled_advantages(handoff, row["episode"], ids, mask)
        assert len(sampled) == sum(mask)
        assert sampled == [a for a, m in zip(full, mask) if m]
    row = rows[0]
    mask = _policy_tokens(row)
    mask[mask.index(True)] = False
    with pytest.raises(HandoffError, match="sample mask leaves it out"):
        prime_rl_advantages(handoff, row["episode"], row["token_ids"], mask)
    with pytest.raises(HandoffError, match="mask has"):
        prime_rl_advantages(handoff, row["episode"], row["token_ids"], mask[:-1])
