"""The pure math of credits, vectorised with numpy.

Eq. 5–7 (``episode_credits``): the original ``compute_ratios_and_qh`` of
``compute_hindsight_scores.py`` (docs/ORIGINAL.md §2), applied to many episodes at
once. Eq. 8 (``hcapo_weights``): the advantage path of ``build_hcapo_dataset.py``
(docs/ORIGINAL.md §3). Nothing here touches the database.

Episodes are passed as flat arrays in (episode, step) order plus the start offset of each
episode, so a batch of thousands of episodes costs a handful of numpy calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hcapo_store.canonical import content_hash
from hcapo_store.credits.params import VARIANTS, CreditParams  # noqa: F401 - re-exported

# A spread this small against the values' own size is rounding, not a difference: three rewards of
# 0.1 have numpy's mean 0.1 + 1.4e-17 and std 1.4e-17, and dividing one by the other made A = ±1
# where equal rewards mean A = 0. Such a spread is treated as none (std 0 → 1, as the original).
NOISE_SPREAD = 1e-12
SMALLEST_SPREAD = float(np.finfo(np.float64).tiny)  # the smallest normal float: below, no spread


def run_hash(scorer_id: str, params: CreditParams) -> str:
    """Identity of a credit run: same scorer + same hyperparameters → same hash."""
    return content_hash({"scorer_id": scorer_id, "params": params.as_dict()}, ascii_only=True)


@dataclass
class EpisodeBatch:
    """Flat per-step arrays of several episodes, in (episode, step) order.

    ``starts[i]`` is the offset of episode i's first step; ``group`` holds small integer
    codes of the group key ``subtask_id or phase`` (codes only need to be distinct within
    an episode); ``subtask_reward`` is NaN where the stored value is NULL.
    """

    starts: np.ndarray  # int64, one per episode
    mean_logprob: np.ndarray  # float64, one per step
    subtask_reward: np.ndarray  # float64, NaN = NULL
    group: np.ndarray  # int64
    episode_reward: np.ndarray  # float64, one per episode

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.append(self.starts, len(self.mean_logprob)))


@dataclass
class CreditArrays:
    pi_hind: np.ndarray
    rho_raw: np.ndarray
    rho: np.ndarray
    r_t: np.ndarray
    discount: np.ndarray
    q_h: np.ndarray
    q_h_smoothed: np.ndarray
    null_rewards: int = 0  # dense steps whose NULL subtask_reward was used as 0


def positions(batch: EpisodeBatch) -> tuple[np.ndarray, np.ndarray]:
    """(episode number of each step, position of each step inside its episode)."""
    lengths = batch.lengths
    ep = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(len(ep)) - batch.starts[ep]
    return ep, pos


def episode_credits(batch: EpisodeBatch, p: CreditParams) -> CreditArrays:
    """Eq. 5–7 for every step of every episode in ``batch``."""
    n = len(batch.mean_logprob)
    lengths = batch.lengths
    ep, pos = positions(batch)
    x = batch.mean_logprob / p.t_temp
    pi_hind = np.exp(x)
    # rho_raw = pi_hind / mean(pi_hind) over the episode, taken in log space (each exponent less
    # the episode's largest): exp(x) underflows to 0 below x ≈ -745 (a mean logprob of -3,725 at
    # T = 5, or vLLM's -9999 floor on a one-token step), and an episode whose every pi_hind was 0
    # got rho_raw 0, so c_min on every step and its order lost; the ratio itself is well defined
    top = np.maximum.reduceat(x, batch.starts) if n else np.zeros(0)
    shifted = np.exp(x - top[ep])  # the episode's largest is 1: the mean is at least 1/T
    rho_raw = shifted / (np.add.reduceat(shifted, batch.starts) / lengths)[ep] if n else np.zeros(0)
    rho = np.clip(rho_raw, p.c_min, p.c_max)
    null_rewards = 0
    if p.uses_dense:
        nulls = np.isnan(batch.subtask_reward)
        null_rewards = int(nulls.sum())
        r_t = np.where(nulls, 0.0, batch.subtask_reward)
        exponent = _group_last(ep, pos, batch.group) - pos
    else:
        r_t = batch.episode_reward[ep].astype(np.float64)
        exponent = lengths[ep] - 1 - pos
    discount = np.power(p.gamma, exponent.astype(np.float64))
    q_h = rho * discount * r_t
    q_s = smooth_backwards(q_h, lengths[ep] - 1 - pos, p.alpha) if p.smooth else q_h.copy()
    return CreditArrays(pi_hind, rho_raw, rho, r_t, discount, q_h, q_s, null_rewards)


def _group_last(ep: np.ndarray, pos: np.ndarray, group: np.ndarray) -> np.ndarray:
    """For each step, the last position in its episode having the same group key.

    The original takes the max index over ALL steps with that key, so a key that comes
    back later (S1, S2, S1) discounts towards its very last occurrence.
    """
    if len(ep) == 0:
        return np.zeros(0, dtype=np.int64)
    key = ep.astype(np.int64) * (int(group.max()) + 1) + group
    # First occurrence in the reversed array = last occurrence in the original.
    uniq, first_rev, inverse = np.unique(key[::-1], return_index=True, return_inverse=True)
    last_idx = len(key) - 1 - first_rev
    return pos[last_idx][inverse.reshape(-1)[::-1]]


def smooth_backwards(q: np.ndarray, dist_to_end: np.ndarray, alpha: float) -> np.ndarray:
    """s[T-1] = q[T-1]; s[t] = alpha·q[t] + (1-alpha)·s[t+1], for all episodes at once.

    Steps are processed by distance to their episode's end: one vector operation per
    distance value, so the Python loop runs max(T) times, not once per step.
    """
    out = q.copy()
    if len(q) == 0:
        return out
    order = np.argsort(dist_to_end, kind="stable")
    bounds = np.cumsum(np.bincount(dist_to_end))
    for d in range(1, len(bounds)):
        idx = order[bounds[d - 1] : bounds[d]]
        out[idx] = alpha * q[idx] + (1 - alpha) * out[idx + 1]
    return out


# ---- Eq. 8 ---------------------------------------------------------------------------


@dataclass
class Eq8Result:
    grpo: np.ndarray  # A_i per episode
    weights: list[np.ndarray]  # w per step, per episode
    mu: float
    sigma: float
    positive_mean: float
    micro: list[np.ndarray] = field(default_factory=list)  # per step, after do-no-harm, before ω


def grouped_zscore(x: np.ndarray, codes: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's mean and population std (like np.std) of ``x``, ``codes[i]`` the group of
    ``x[i]`` (0 ≤ code < ``n_groups``); the std 1 where the values do not spread: 0, rounding
    (``NOISE_SPREAD`` of the group's largest magnitude) or a subnormal std. Taken about each group's
    first value, so equal values deviate by exactly 0 and their mean is that value; squares
    of deviations scaled by the largest, so tiny spreads do not underflow. An empty group: 0, 1."""
    x = np.asarray(x, dtype=np.float64)
    count = np.bincount(codes, minlength=n_groups).astype(np.float64)
    first = np.zeros(n_groups)
    seen, first_at = np.unique(codes, return_index=True)
    first[seen] = x[first_at]
    d = x - first[codes]
    mean_d = np.divide(
        np.bincount(codes, weights=d, minlength=n_groups), count, where=count > 0, out=np.zeros(n_groups)
    )
    dev = d - mean_d[codes]
    scale = np.zeros(n_groups)
    np.maximum.at(scale, codes, np.abs(dev))
    unit = np.divide(dev, scale[codes], where=scale[codes] > 0, out=np.zeros(len(x)))
    var = np.divide(
        np.bincount(codes, weights=unit * unit, minlength=n_groups), count, where=count > 0, out=np.zeros(n_groups)
    )
    sigma = scale * np.sqrt(var)
    largest = np.zeros(n_groups)
    np.maximum.at(largest, codes, np.abs(x))
    # a subnormal std has lost its precision (and NOISE_SPREAD of a subnormal value is 0)
    sigma[(sigma <= NOISE_SPREAD * largest) | (sigma < SMALLEST_SPREAD)] = 1.0
    return first + mean_d, sigma


def group_codes(keys: Sequence[Any]) -> tuple[np.ndarray, int]:
    """Each key's group number, in order of first appearance, and the number of groups."""
    numbers: dict[Any, int] = {}
    codes = np.asarray([numbers.setdefault(k, len(numbers)) for k in keys], dtype=np.int64)
    return codes, len(numbers)


def _zscore_stats(x: np.ndarray) -> tuple[float, float]:
    """:func:`grouped_zscore` of one group."""
    if not len(x):
        return 0.0, 1.0
    mu, sigma = grouped_zscore(x, np.zeros(len(x), dtype=np.int64), 1)
    return float(mu[0]), float(sigma[0])


def grpo_advantages(rewards: np.ndarray, groups: Sequence[Any] | None = None) -> np.ndarray:
    """A_i = (R_i − mean R) / std R (population; std 0 → 1), over all or per group."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if groups is None:
        mu, sd = _zscore_stats(rewards)
        return (rewards - mu) / sd
    codes, n_groups = group_codes([str(g) if g is not None else "\0none" for g in groups])
    mu_g, sd_g = grouped_zscore(rewards, codes, n_groups)
    return (rewards - mu_g[codes]) / sd_g[codes]


def hcapo_weights(
    rewards: np.ndarray, q: Sequence[np.ndarray], omega: float = 1.0, groups: Sequence[Any] | None = None
) -> Eq8Result:
    """Eq. 8 as ``build_hcapo_dataset.py`` implements it (docs/ORIGINAL.md §3)."""
    grpo = grpo_advantages(rewards, groups)
    flat = np.concatenate(q) if len(q) else np.zeros(0)
    mu, sigma = _zscore_stats(flat)
    clamped, micros = [], []
    for a_i, qe in zip(grpo, q):
        micro = (qe - mu) / sigma
        if a_i > 0:  # do-no-harm: a good episode never gets negative step credit
            micro = np.maximum(micro, 0.0)
        micros.append(micro)
        clamped.append(np.maximum(a_i + omega * micro, 0.0))
    all_clamped = np.concatenate(clamped) if clamped else np.zeros(0)
    positive = all_clamped[all_clamped > 0]
    pos_mean = float(positive.mean()) if len(positive) else 1.0
    return Eq8Result(grpo, [c / pos_mean for c in clamped], mu, sigma, pos_mean, micros)
