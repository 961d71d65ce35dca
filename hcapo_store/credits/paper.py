"""The paper's estimator (HCAPO Algorithm 1; docs/PAPER.md §1), vectorised.

Where it departs from the original scripts (``equations.py``; docs/CREDITS.md "Two estimators"):

* the return is terminal, G_t = γ^(T−1−t)·R, unless ``dense`` keeps the scripts' subtask return;
* smoothing is one step with the raw next value: Q̃_t = α·Q_t + (1−α)·Q_{t+1}; the last step
  keeps Q_T (the scripts recurse over the smoothed values);
* the macro term A_i and the micro statistics μ_H, σ_H are taken over the trajectories of the
  trajectory's own group (population std; 0, or a spread of rounding's size, → 1), not over
  everything exported;
* do-no-harm clears negative micro terms of *successful* trajectories (reward ≥ threshold),
  not of those with A_i > 0;
* the advantage A_i + ω·micro is signed: no clamp at 0, no division by the positive mean.

Eq. 6–7 (π_hind and the clipped ratio ρ over the same trajectory) are the scripts' own, so
they come from ``episode_credits``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hcapo_store.credits.equations import (
    CreditParams,
    EpisodeBatch,
    episode_credits,
    group_codes,
    grouped_zscore,
    grpo_advantages,
    positions,
)
from hcapo_store.errors import InvalidCreditParams


@dataclass
class PaperResult:
    """Per step unless noted; ``mu_h``/``sigma_h`` per group, in order of first appearance."""

    pi_hind: np.ndarray
    rho_raw: np.ndarray
    rho: np.ndarray
    r_t: np.ndarray  # the return G_t's reward factor (R, or the subtask score when dense)
    discount: np.ndarray
    q_h: np.ndarray
    q_h_smoothed: np.ndarray
    a_macro: np.ndarray
    micro: np.ndarray  # after do-no-harm, before ω
    advantage: np.ndarray
    mu_h: np.ndarray
    sigma_h: np.ndarray
    null_rewards: int = 0


def one_step_smoothing(q: np.ndarray, dist_to_end: np.ndarray, alpha: float) -> np.ndarray:
    """Q̃_t = α·Q_t + (1−α)·Q_{t+1} with the raw next value; the last step of a trajectory is kept."""
    out = q.copy()
    inner = np.flatnonzero(dist_to_end > 0)
    out[inner] = alpha * q[inner] + (1 - alpha) * q[inner + 1]
    return out


def paper_advantages(
    batch: EpisodeBatch,
    p: CreditParams,
    *,
    groups: Sequence[Any] | None = None,
    success_threshold: float = 1.0,
    omega: float = 1.0,
    dense: bool = False,
) -> PaperResult:
    """Algorithm 1 for every step of every trajectory in ``batch``.

    ``groups``: one key per trajectory (None: all trajectories form one group; a None key is
    a group of its own, like any other value).
    """
    for name, value in (("success_threshold", success_threshold), ("omega", omega)):
        if not math.isfinite(value):
            raise InvalidCreditParams(f"{name} (--{name.replace('_', '-')}) must be a finite number, got {value!r}")
    n = len(batch.mean_logprob)
    ep, pos = positions(batch)
    lengths = batch.lengths
    # Eq. 5-7 with the chosen return and no smoothing; the smoothing here is the paper's.
    raw = episode_credits(batch, replace(p, dense=dense, smooth=False))
    q_s = one_step_smoothing(raw.q_h, lengths[ep] - 1 - pos, p.alpha) if p.smooth else raw.q_h.copy()

    rewards = batch.episode_reward.astype(np.float64)
    a_ep = grpo_advantages(rewards, None if groups is None else [str(g) if g is not None else None for g in groups])
    # μ_H, σ_H per group of trajectories (one group when ``groups`` is None)
    codes, n_groups = group_codes([0] * len(rewards) if groups is None else groups)
    step_group = codes[ep] if n else np.zeros(0, dtype=np.int64)
    mu, sigma = grouped_zscore(q_s, step_group, n_groups)
    micro = (q_s - mu[step_group]) / sigma[step_group]
    success = (rewards >= success_threshold)[ep] if n else np.zeros(0, dtype=bool)
    micro = np.where(success, np.maximum(micro, 0.0), micro)
    a_macro = a_ep[ep] if n else np.zeros(0)
    return PaperResult(
        pi_hind=raw.pi_hind,
        rho_raw=raw.rho_raw,
        rho=raw.rho,
        r_t=raw.r_t,
        discount=raw.discount,
        q_h=raw.q_h,
        q_h_smoothed=q_s,
        a_macro=a_macro,
        micro=micro,
        advantage=a_macro + omega * micro,
        mu_h=mu,
        sigma_h=sigma,
        null_rewards=raw.null_rewards,
    )
