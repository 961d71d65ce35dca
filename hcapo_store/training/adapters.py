"""The shapes three RL frameworks take per-token advantages in (../shared TRAINERS.md), filled
from a ``Handoff``. Plain lists and numpy arrays: no framework is imported here.

- verl: a custom estimator (``@register_adv_est``) returns ``advantages`` shaped like
  ``response_mask`` (batch, response_length); the rows are found by uid, so the caller maps
  each row's uid to its episode. ``verl_advantages`` fills that array.
- slime: ``--custom-advantage-function-path`` sets each sample's ``advantages`` over its
  ``response_length`` tokens, masked by ``loss_mask``. ``slime_advantages`` gives one sample's.
- prime-rl: ``TrainingSample.advantages`` has one float per token over prompt + completion.
  ``prime_rl_advantages`` gives that list.

Every function refuses (``HandoffError``) when an action lands on a token the framework's mask
says it does not train: the advantages and the trainer's tokens would disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def prime_rl_advantages(
    handoff: Handoff,
    episode: str | int,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    completion_mask: Sequence[int] | None = None,
) -> list[float]:
    """prime-rl's ``TrainingSample.advantages``: one float per token of prompt + completion."""
    ids = [*prompt_ids, *completion_ids]
    credit = handoff.advantages(episode, ids)
    if completion_mask is not None:
        if len(completion_mask) != len(completion_ids):
            raise HandoffError(f"completion_mask has {len(completion_mask)} values for {len(completion_ids)} tokens")
        _check_mask(credit, len(prompt_ids), np.asarray(completion_mask, dtype=bool), "completion")
    return credit.advantages.astype(float).tolist()
