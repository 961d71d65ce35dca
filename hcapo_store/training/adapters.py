"""The shapes three RL frameworks take per-token advantages in (docs/TRAINERS.md), filled
from a ``Handoff``. Plain lists and numpy arrays: no framework is imported here (slime's hook
makes torch tensors, importing torch when slime calls it).

- verl: ``advantages`` shaped like ``response_mask`` (batch, response_length).
  ``verl_advantages`` fills that array for rows whose episodes the caller already knows; inside
  verl itself (``algorithm.adv_estimator=hcapo``) use ``training/verl.py``, which finds each
  row's group by its uid and the row by its own ids (``training/verl_batch.py``).
- slime (checked against THUDM/slime @624b824a, ``slime/backends/megatron_utils/loss.py``
  ``compute_advantages_and_returns`` and ``get_responses``): ``--custom-advantage-function-path
  my_module.fn`` (a dotted path: ``slime/utils/misc.py load_function`` splits at the last dot, so
  the ``file.py:fn`` form its help text shows does not load) calls ``fn(args, rollout_data)``, which sets ``rollout_data["advantages"]`` and
  ``["returns"]``: one float32 tensor per sample of its ``response_lengths[i]`` tokens, the last
  ones of ``rollout_data["tokens"][i]``, not shifted (entry j is the log-probability of response
  token j), masked by ``loss_masks[i]``. ``slime_advantages`` gives one sample's list,
  ``slime_advantage_function`` the whole hook (samples found by ``sample_indices``, the
  ``Sample.index``: slime does not forward ``Sample.metadata`` to the training ranks).
- prime-rl (checked against PrimeIntellect-ai/prime-rl @559b4477,
  ``transports/rollouts/types.py``, ``trainer/batch.py prepare_sample``, ``orchestrator/algo/
  routing.py assign_advantages``): a ``TrainingSample`` is one flat branch, ``token_ids`` with a
  bool ``mask`` of the model-sampled tokens (no prompt/completion split), and ``advantages`` one
  float per token of ``token_ids``, not shifted (the trainer shifts its log-probabilities back
  onto the tokens). ``prime_rl_advantages`` gives that list; ``prime_rl_sampled_advantages``
  gives the compact values an ``Algorithm.score_group`` passes to ``assign_advantages(trace,
  values)`` (the sampled tokens only, in order).

Every function refuses (``HandoffError``) when an action lands on a token the framework's mask
says it does not train: the advantages and the trainer's tokens would disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hcapo_store.errors import HandoffError
from hcapo_store.training.handoff import Handoff, TokenCredit


def _check_mask(credit: TokenCredit, start: int, mask: np.ndarray, what: str) -> None:
    """The episode's action tokens inside [start, start + len(mask)) must all be trained."""
    own = credit.mask[start : start + len(mask)]
    untrained = own & ~mask.astype(bool)
    if untrained.any():
        at = int(np.flatnonzero(untrained)[0])
        step = next((i for i, (a, b) in credit.spans.items() if a <= start + at < b), None)
        raise HandoffError(
            f"episode {credit.episode}: step {step}'s token at {what} position {at} is an action token "
            f"but the {what} mask leaves it out: the trainer's mask and the store's spans disagree"
        )


def verl_advantages(
    handoff: Handoff,
    episodes: Sequence[str | int],
    prompt_ids: Sequence[Sequence[int]],
    response_ids: np.ndarray | Sequence[Sequence[int]],
    response_mask: np.ndarray | Sequence[Sequence[int]],
) -> np.ndarray:
    """(batch, response_length) float32 advantages for a verl batch: row i is episode
    ``episodes[i]`` with its unpadded prompt ids and right-padded response ids; 0 where
    ``response_mask`` is 0 and on actions that sit in the prompt (another row trains them)."""
    responses = np.asarray(response_ids)
    masks = np.asarray(response_mask)
    if responses.shape != masks.shape or responses.ndim != 2:
        raise HandoffError(f"response_ids {responses.shape} and response_mask {masks.shape} must be one (B, T) shape")
    if not len(episodes) == len(prompt_ids) == len(responses):
        raise HandoffError(f"{len(episodes)} episodes, {len(prompt_ids)} prompts, {len(responses)} responses")
    out = np.zeros(responses.shape, dtype=np.float32)
    for i, (episode, prompt) in enumerate(zip(episodes, prompt_ids)):
        valid = int(masks[i].nonzero()[0].max()) + 1 if masks[i].any() else 0
        ids = [int(t) for t in prompt] + [int(t) for t in responses[i, :valid]]
        credit = handoff.advantages(episode, ids)
        start = len(prompt)
        _check_mask(credit, start, masks[i, :valid], "response")
        out[i, :valid] = credit.advantages[start:] * masks[i, :valid]
    return out


def slime_advantages(
    handoff: Handoff, episode: str | int, tokens: Sequence[int], response_length: int, loss_mask: Sequence[int]
) -> list[float]:
    """One slime sample's ``advantages`` (``response_length`` floats) from its ``tokens``
    (prompt + response) and ``loss_mask`` (over the response)."""
    if len(loss_mask) != response_length or response_length > len(tokens):
        raise HandoffError(
            f"loss_mask has {len(loss_mask)} values, response_length is {response_length}, tokens {len(tokens)}"
        )
    credit = handoff.advantages(episode, tokens)
    start = len(tokens) - response_length
    mask = np.asarray(loss_mask, dtype=bool)
    _check_mask(credit, start, mask, "response")
    return (credit.advantages[start:] * mask).astype(float).tolist()


def slime_advantage_function(
    handoff: Handoff | Callable[[Any, dict[str, Any]], Handoff],
    episodes: Mapping[int, str | int] | Callable[[int], str | int],
    *,
    allow_whitening: bool = False,
) -> Callable[[Any, dict[str, Any]], None]:
    """slime's ``--custom-advantage-function-path`` hook: ``fn(args, rollout_data)`` setting
    ``advantages`` and ``returns`` (the same tensors, as slime's GRPO does) of every sample.

    ``handoff``: a ``Handoff``, or ``(args, rollout_data) -> Handoff`` for the rollout's batch.
    ``episodes``: each sample's episode by its ``Sample.index`` (``rollout_data["sample_indices"]``).
    Refused: context parallelism (each rank holds a slice of the response then, not all of it),
    and ``--normalize-advantages`` unless ``allow_whitening`` (slime whitens the custom
    advantages too: HCAPO's are already normalised per group, and a shifted mean flips signs).
    """

    def hcapo_advantages(args: Any, rollout_data: dict[str, Any]) -> None:
        import torch

        if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
            raise HandoffError(
                "slime_advantage_function does not support context parallelism (--context-parallel-size > 1): "
                "each rank then holds a slice of each response"
            )
        if getattr(args, "normalize_advantages", False) and not allow_whitening:
            raise HandoffError(
                "slime would whiten HCAPO's advantages (--normalize-advantages): drop the flag, or pass "
                "allow_whitening=True to slime_advantage_function"
            )
        source = handoff if isinstance(handoff, Handoff) else handoff(args, rollout_data)
        which = episodes.__getitem__ if isinstance(episodes, Mapping) else episodes
        out = []
        for i, (tokens, n, mask, index) in enumerate(
            zip(
                rollout_data["tokens"],
                rollout_data["response_lengths"],
                rollout_data["loss_masks"],
                rollout_data["sample_indices"],
            )
        ):
            ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
            loss_mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
            try:
                values = slime_advantages(source, which(int(index)), ids, int(n), loss_mask)
            except HandoffError as exc:
                raise HandoffError(f"slime sample {i} (index {int(index)}): {exc}") from exc
            device = tokens.device if hasattr(tokens, "device") else None
            out.append(torch.tensor(values, dtype=torch.float32, device=device))
        rollout_data["advantages"] = out
        rollout_data["returns"] = out

    return hcapo_advantages


def prime_rl_advantages(
    handoff: Handoff, episode: str | int, token_ids: Sequence[int], mask: Sequence[bool | int]
) -> list[float]:
    """prime-rl's ``TrainingSample.advantages``: one float per token of the sample's flat
    ``token_ids``; 0 where ``mask`` (its model-sampled tokens) is False, refused when an action
    token has mask False."""
    if len(mask) != len(token_ids):
        raise HandoffError(f"mask has {len(mask)} values for {len(token_ids)} token_ids")
    credit = handoff.advantages(episode, token_ids)
    sampled = np.asarray(mask, dtype=bool)
    _check_mask(credit, 0, sampled, "sample")
    return (credit.advantages * sampled).astype(float).tolist()


def prime_rl_sampled_advantages(
    handoff: Handoff, episode: str | int, token_ids: Sequence[int], mask: Sequence[bool | int]
) -> list[float]:
    """The same advantages on the sampled tokens only, in order: the ``values`` of prime-rl's
    ``assign_advantages(trace, values)`` (one per token whose mask is True)."""
    full = prime_rl_advantages(handoff, episode, token_ids, mask)
    return [a for a, m in zip(full, mask) if m]
