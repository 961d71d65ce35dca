"""``algorithm.adv_estimator=hcapo`` in verl 0.9.1: the store's credits as verl's advantages.

Import it in the driver process (verl's registries are per process: a custom entry point
that imports this module, then calls verl's ``main``), then point it at the store::

    import hcapo_store.training.verl as hcapo_verl
    hcapo_verl.configure("rollouts.db", tokenizer="/models/Qwen3-8B", wait=600)

    # verl config:  algorithm.adv_estimator=hcapo  algorithm.use_kl_in_reward=False
    #               reward.reward_manager.source=register  reward.reward_manager.name=hcapo
    #               trainer.v1.sampler.custom_sampler.path=pkg://hcapo_store.training.verl
    #               trainer.v1.sampler.custom_sampler.name=replay_buffer

verl's estimators see a sample's ``uid`` (its GRPO group), never its turns or tokens, so the
store's per-token advantages reach verl as the batch's rewards (``rm_scores``), written where
verl holds the whole batch with its ids:

- **v1 trainer** (verl's default): rollouts stream into TransferQueue, each with its scalar
  reward, and no reward manager sees the batch (``assemble_rm_scores`` runs only with a
  colocated reward model). The replay buffer ``replay_buffer`` (v1's custom sampler: the sync
  or async one of the trainer's mode) writes them into each sampled training batch
  (``write_tq_advantages``); validation batches keep their scalar rewards;
- **legacy trainer**, with a colocated reward model (``reward.reward_model.enable=True``): the
  reward manager ``hcapo`` (``HcapoRewardManager``, verl's naive one otherwise) writes them in
  ``assemble_rm_scores``, which sees the whole batch. Without a reward model the legacy
  trainer's streaming reward path never calls it, and the estimator refuses the batch;

both through ``verl_batch.VerlHandoff`` (the group's batch by uid, the sample by its own ids
within it, the weight version checked). The estimator ``hcapo`` (``@register_adv_est``), for
the legacy ``compute_advantage`` and the v1 ``compute_advantage_for_multi_trajectories`` alike,
passes those values on as ``advantages`` and ``returns`` after checking that they are exactly
what the plug wrote (a KL penalty folded into the rewards, or another reward manager's scalar,
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
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
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


# What v1 holds of a trajectory (TransferQueue fields, one ragged row per key)
TQ_FIELDS = ["uid", "prompts", "responses", "response_mask"]


def _rows(value: Any) -> list[list[int]]:
    """A TransferQueue field's rows (a jagged nested tensor, or one tensor of equal rows)."""
    return [row.tolist() for row in (value.unbind() if getattr(value, "is_nested", False) else value)]


def write_tq_advantages(keys: list[str], partition_id: str) -> np.ndarray:
    """verl v1: each trajectory ``keys`` names in TransferQueue gets the store's per-token
    advantages as its ``rm_scores`` (what v1's ``_compute_advantage`` reads as the rewards),
    found as ``assemble_rm_scores`` finds them (``VerlHandoff``: its group by uid, the sample by
    its own ids). Returns the (batch, response_length) values written."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=TQ_FIELDS)
    uids = [str(u) for u in _leaves(data["uid"])]
    if len(uids) != len(keys):
        raise HandoffError(f"TransferQueue gave {len(uids)} uids for {len(keys)} trajectories of {partition_id!r}")
    prompts, responses, masks = (_rows(data[name]) for name in ("prompts", "responses", "response_mask"))
    lengths = [len(r) for r in responses]
    width = max(lengths, default=0)
    padded = np.zeros((len(keys), width), dtype=np.int64)
    mask = np.zeros((len(keys), width), dtype=np.int64)
    for i, (r, m) in enumerate(zip(responses, masks)):
        padded[i, : len(r)], mask[i, : len(m)] = r, m
    values = handoff().advantages(uids, prompts, padded, mask, lengths)
    _remember(values)
    rows = [torch.as_tensor(values[i, :n], dtype=torch.float32) for i, n in enumerate(lengths)]
    scores = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    fields = type(data)({"rm_scores": scores}, batch_size=len(keys))  # the TensorDict class TransferQueue answers with
    tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=fields)
    return values


def _leaves(value: Any) -> list[Any]:
    """A non-tensor field's values in row order: TransferQueue returns a NonTensorStack, a numpy
    array or tensordict's LinkedList (a list subclass), nested once or not, by backend."""
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


class _StoreAdvantages:
    """verl v1's replay buffer whose training batches leave it with the store's advantages in
    ``rm_scores``: v1 streams each trajectory's scalar reward into TransferQueue as it finishes,
    and no reward manager sees the whole batch (``assemble_rm_scores`` runs only with a colocated
    reward model), so the batch is completed here, once sampled: its groups are whole then.
    Validation batches keep their scalar rewards (they are scored, not trained)."""

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict]:
        batch, metrics = super().sample(global_steps, partition_id, batch_size)  # type: ignore[misc]
        if partition_id != "val" and batch.keys:
            write_tq_advantages(list(batch.keys), batch.partition_id)
        return batch, metrics


class HcapoReplayBuffer(_StoreAdvantages, ReplayBuffer):
    """The sync trainer's replay buffer with the store's advantages."""


class HcapoReplayBufferAsync(_StoreAdvantages, ReplayBufferAsync):
    """The async trainers' replay buffer with the store's advantages."""


def replay_buffer(**kwargs: Any) -> ReplayBuffer:
    """``trainer.v1.sampler.custom_sampler`` (``path=pkg://hcapo_store.training.verl``,
    ``name=replay_buffer``): the replay buffer of the trainer's mode, with the store's advantages."""
    cls = HcapoReplayBuffer if kwargs.get("trainer_mode") == "sync" else HcapoReplayBufferAsync
    return cls(**kwargs)


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
    problems = []
    for i, row in enumerate(values):
        uid = f" (uid {index[i]})" if index is not None else ""
        if not np.isfinite(row).all():
            problems.append(f"sample {i}{uid}: a token-level reward is {row[~np.isfinite(row)][0]}: refused")
        elif _fingerprint(row) not in _written:
            problems.append(
                f"sample {i}{uid}: its token_level_rewards are not the advantages the hcapo plug wrote: the v1 "
                "trainer needs trainer.v1.sampler.custom_sampler.path=pkg://hcapo_store.training.verl and "
                ".name=replay_buffer (examples/verl_hcapo.py sets both), and algorithm.use_kl_in_reward=False; the "
                "legacy trainer (trainer.use_v1=False) hands the batch to reward manager hcapo only with a colocated "
                "reward model (its streaming reward path never reaches assemble_rm_scores)"
            )
    if problems:
        raise VerlBatchError(problems)
    # Every value was checked to fall on a token the response mask trained when it was written
    # (VerlHandoff._place); a mask narrowed since (verl's rollout-correction rejection sampling)
    # trains fewer, as verl's own estimators do: the mask multiplies.
    advantages = token_level_rewards * response_mask
    return advantages, advantages.clone()


def setup() -> None:
    """Ray's ``worker_process_setup_hook``: every Ray process of the run (verl's TaskRunner, its
    reward workers) imports this module, so ``hcapo`` is registered there (verl looks both names
    up in the process that uses them); the store is named by ``HCAPO_STORE`` / ``HCAPO_TOKENIZER``."""
