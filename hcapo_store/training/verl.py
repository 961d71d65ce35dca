"""``algorithm.adv_estimator=hcapo`` in verl 0.9.1: the store's credits as verl's advantages.

Import it in the driver process (verl's registries are per process: a custom entry point
that imports this module, then calls verl's ``main``), then point it at the store::

    import hcapo_store.training.verl as hcapo_verl
    hcapo_verl.configure("rollouts.db", tokenizer="/models/Qwen3-8B", wait=600)

    # verl config:  algorithm.adv_estimator=hcapo  algorithm.use_kl_in_reward=False
    #               reward.reward_manager.source=register  reward.reward_manager.name=hcapo

It registers two things, because verl's estimators see a sample's ``uid`` (its GRPO group)
and never its turns or tokens:

- the reward manager ``hcapo`` (``HcapoRewardManager``): ``run_single`` is verl's naive one
  (the scalar reward still reaches verl's metrics), and ``assemble_rm_scores``, which sees
  the whole batch, writes each sample's per-token advantages from the store into
  ``rm_scores`` (``verl_batch.VerlHandoff``: the group's batch by uid, the sample by its own
  ids within it, the weight version checked);
- the estimator ``hcapo`` (``@register_adv_est``) for the legacy ``compute_advantage`` and the
  v1 ``compute_advantage_for_multi_trajectories`` alike: it passes those values on as
  ``advantages`` and ``returns``, after checking that they are exactly what the reward
  manager wrote (a KL penalty folded into the rewards, or another reward manager's scalar,
  is refused by sample) and finite.

Without ``configure`` the environment names the store: ``HCAPO_STORE``, ``HCAPO_TOKENIZER``,
``HCAPO_WEIGHT_VERSION``, ``HCAPO_WAIT`` (seconds), ``HCAPO_EXACT`` (1: ids must be a rendering),
``HCAPO_ALLOW_ZERO_HINDSIGHT`` (1: train groups without a hindsight term, plain GRPO).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hcapo_store.errors import HandoffError
from hcapo_store.storage.store import Store
from hcapo_store.training.verl_batch import VerlBatchError, VerlHandoff

SUPPORTED_VERL = "0.9.1"
NAME = "hcapo"

try:
    import torch
    import verl
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager import register
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.core_algos import register_adv_est
except Exception as exc:  # ImportError, or an AttributeError of a moved name: version drift
    installed = None
    try:
        from importlib.metadata import version

        installed = version("verl")
    except Exception:
        pass
    raise ImportError(
        f"hcapo_store.training.verl supports verl {SUPPORTED_VERL} (installed: {installed or 'none'}); "
        f"importing it failed: {exc}. Install `pip install verl=={SUPPORTED_VERL} cachetools uvicorn fastapi` "
        "(TransferQueue too for the v1 trainer) in the trainer's environment"
    ) from exc

if getattr(verl, "__version__", None) != SUPPORTED_VERL:
    warnings.warn(
        f"hcapo_store.training.verl is tested with verl {SUPPORTED_VERL}, this is verl {verl.__version__}",
        stacklevel=2,
    )

_handoff: VerlHandoff | None = None
_written: OrderedDict[bytes, None] = OrderedDict()  # fingerprints of the rows assemble_rm_scores wrote
_KEEP = 1 << 16  # rows remembered (several steps in flight in an async trainer)


def configure(
    store: Store | str | Path,
    *,
    tokenizer: str | Path,
    weight_version: str | Callable[[], str | None] | None = None,
    wait: float = 0.0,
    allow_stale: bool = False,
    exact: bool = False,
    allow_zero_hindsight: bool = False,
) -> VerlHandoff:
    """Point the plug at a store (a ``Store`` or its path / URL) and the policy's tokenizer.
    ``weight_version``: the version this step's rollouts came from (a callable is asked each
    step); ``wait``: seconds to wait for a group's batch to be published; ``exact``: a sample's
    ids must be its episode's rendering token for token; ``allow_zero_hindsight``: train a group
    whose hindsight term is zero on every step (plain GRPO; refused by default) (``VerlHandoff``)."""
    global _handoff
    opened = store if isinstance(store, Store) else Store.open(str(store), create=False)
    _handoff = VerlHandoff(
        opened,
        tokenizer,
        weight_version=weight_version,
        wait=wait,
        allow_stale=allow_stale,
        exact=exact,
        allow_zero_hindsight=allow_zero_hindsight,
    )
    return _handoff


def handoff() -> VerlHandoff:
    """The configured hand-off (from the environment when ``configure`` was not called)."""
    if _handoff is None:
        location, tok = os.environ.get("HCAPO_STORE"), os.environ.get("HCAPO_TOKENIZER")
        if not location or not tok:
            raise HandoffError(
                "hcapo for verl is not configured: call hcapo_store.training.verl.configure(store, tokenizer=...) "
                "in the driver, or set HCAPO_STORE and HCAPO_TOKENIZER"
            )
        configure(
            location,
            tokenizer=tok,
            weight_version=os.environ.get("HCAPO_WEIGHT_VERSION") or None,
            wait=float(os.environ.get("HCAPO_WAIT", "0")),
            exact=os.environ.get("HCAPO_EXACT", "") not in ("", "0"),
            allow_zero_hindsight=os.environ.get("HCAPO_ALLOW_ZERO_HINDSIGHT", "") not in ("", "0"),
        )
    assert _handoff is not None
    return _handoff


def _fingerprint(values: np.ndarray) -> bytes:
    """A row's values without its right padding (the two trainers pad rows to other widths)."""
    nz = np.flatnonzero(values)
    trimmed = values[: int(nz.max()) + 1] if len(nz) else values[:0]
    return hashlib.blake2b(np.ascontiguousarray(trimmed, dtype=np.float32).tobytes(), digest_size=16).digest()


def _remember(rows: np.ndarray) -> None:
    for row in rows:
        _written[_fingerprint(row)] = None
        _written.move_to_end(_fingerprint(row))
    while len(_written) > _KEEP:
        _written.popitem(last=False)


def batch_advantages(data: DataProto) -> torch.Tensor:
    """(batch, response_length) advantages of a verl batch from the store: ``prompts``
    (left-padded), ``responses``, ``attention_mask`` and ``response_mask`` (else the
    response's attention mask) in ``data.batch``, ``uid`` in ``data.non_tensor_batch`` (without
    it, each row is found by its ids among the batches of the configured weight version)."""
    prompts = data.batch["prompts"].cpu().numpy()
    responses = data.batch["responses"]
    width = prompts.shape[1]
    attention = data.batch["attention_mask"].cpu().numpy()
    if "response_mask" in data.batch.keys():
        mask = data.batch["response_mask"].cpu().numpy()
    else:
        mask = attention[:, width:]
    prompt_ids = [row[attention[i, :width].astype(bool)].tolist() for i, row in enumerate(prompts)]
    lengths = attention[:, width:].sum(axis=1).tolist()
    # v1's colocated reward path drops the uid: such rows are found among the step's batches
    uids = list(data.non_tensor_batch["uid"]) if "uid" in data.non_tensor_batch else [None] * len(data)
    values = handoff().advantages(uids, prompt_ids, responses.cpu().numpy(), mask, lengths)
    _remember(values)
    return torch.as_tensor(values, dtype=torch.float32, device=responses.device)


@register(NAME)
class HcapoRewardManager(NaiveRewardManager):
    """verl's naive reward manager whose ``rm_scores`` are the store's per-token advantages."""

    @classmethod
    def assemble_rm_scores(cls, data: DataProto, scores: list[float]) -> torch.Tensor:
        return batch_advantages(data)


@register_adv_est(NAME)
def hcapo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    index: np.ndarray | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's advantages, as ``HcapoRewardManager`` wrote them into ``rm_scores``."""
    values = token_level_rewards.detach().float().cpu().numpy()
    mask = response_mask.detach().cpu().numpy().astype(bool)
    problems = []
    for i, row in enumerate(values):
        uid = f" (uid {index[i]})" if index is not None else ""
        if not np.isfinite(row).all():
            problems.append(f"sample {i}{uid}: a token-level reward is {row[~np.isfinite(row)][0]}: refused")
        elif (row[~mask[i]] != 0).any():
            problems.append(f"sample {i}{uid}: a value falls on a token the response mask does not train")
        elif _fingerprint(row) not in _written:
            problems.append(
                f"sample {i}{uid}: its token_level_rewards are not the advantages the hcapo reward manager wrote "
                "(set reward.reward_manager.name=hcapo and algorithm.use_kl_in_reward=False; rewards computed in "
                "verl's agent loop, its streaming reward path, never reach assemble_rm_scores)"
            )
    if problems:
        raise VerlBatchError(problems)
    advantages = token_level_rewards * response_mask
    return advantages, advantages.clone()


def setup() -> None:
    """Ray's ``worker_process_setup_hook``: every Ray process of the run (verl's TaskRunner, its
    reward workers) imports this module, so ``hcapo`` is registered there (verl looks both names
    up in the process that uses them); the store is named by ``HCAPO_STORE`` / ``HCAPO_TOKENIZER``."""
