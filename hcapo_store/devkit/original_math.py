"""An independent plain-Python reference of the original HCAPO scripts' math.

Written straight from docs/ORIGINAL.md §2 (``compute_ratios_and_qh``) and §3
(``build_hcapo_dataset.py``): lists, dicts and loops, no numpy, no code shared with
``hcapo_store.credits.equations``. Tests and ``bench/credits.py`` compare against it; it
ships in the toolkit so that a benchmark or a user can check the store's numbers against
the original's math without a checkout's tests.
"""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any


def compute_ratios_and_qh(
    steps: list[dict[str, Any]],
    episode_reward: float,
    t_temp: float = 5.0,
    gamma: float = 0.95,
    c_min: float = 0.8,
    c_max: float = 1.2,
    alpha: float = 0.5,
    smooth: bool = True,
    dense_rewards: bool = True,
) -> list[dict[str, Any]]:
    """Adds pi_hind, rho, q_h, q_h_smoothed to each step dict (the original's procedure).

    Each step needs ``mean_logprob``, ``subtask_id``, ``phase``, ``subtask_reward``
    (None is used as 0, the store's documented fix for quirk Q11).
    """
    T = len(steps)
    if T == 0:
        return steps
    xs = [s["mean_logprob"] / t_temp for s in steps]
    pi_hinds = [math.exp(x) for x in xs]
    # the ratio pi_hind / mean(pi_hind), with each exponent less the largest: exp underflows to 0
    # below about -745, where the original's floor (a zero mean -> 1e-12) made every ratio 0
    top = max(xs)
    shifted = [math.exp(x - top) for x in xs]
    shifted_mean = sum(shifted) / T
    rhos = []
    for e in shifted:
        ratio = e / shifted_mean
        rhos.append(max(c_min, min(c_max, ratio)))

    group_last: dict[Any, int] = {}
    for t, s in enumerate(steps):
        key = s.get("subtask_id") or s.get("phase")
        if key not in group_last or t > group_last[key]:
            group_last[key] = t

    q_h = []
    for t, s in enumerate(steps):
        if dense_rewards:
            r_t = s.get("subtask_reward")
            if r_t is None:
                r_t = 0.0
            key = s.get("subtask_id") or s.get("phase")
            discount = gamma ** (group_last[key] - t)
        else:
            r_t = episode_reward
            discount = gamma ** (T - 1 - t)
        q_h.append(rhos[t] * discount * r_t)

    if smooth:
        smoothed = [0.0] * T
        smoothed[T - 1] = q_h[T - 1]
        for t in range(T - 2, -1, -1):
            smoothed[t] = alpha * q_h[t] + (1 - alpha) * smoothed[t + 1]
    else:
        smoothed = list(q_h)

    for t, s in enumerate(steps):
        s["pi_hind"] = pi_hinds[t]
        s["rho"] = rhos[t]
        s["q_h"] = q_h[t]
        s["q_h_smoothed"] = smoothed[t]
    return steps


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs)  # exact, then rounded once: equal values have themselves as mean


def _pstd(xs: list[float]) -> float:
    """The population std, exact then rounded (``statistics``), 0 where it is at rounding's size
    against the values or subnormal (the store's rule, equations.NOISE_SPREAD, SMALLEST_SPREAD)."""
    sd = statistics.pstdev(xs)
    return 0.0 if sd <= 1e-12 * max(abs(x) for x in xs) or sd < sys.float_info.min else sd


def build_hcapo_rows(
    episodes: list[dict[str, Any]],
    omega: float = 1.0,
    min_reward: float = 0.2,
    use_smoothed: bool = True,
    group_of: dict[Any, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The Eq. 8 path of ``build_hcapo_dataset.py``.

    ``episodes``: dicts with ``episode_id``, ``reward``, ``messages``, ``steps`` (each a dict
    with ``q_h``/``q_h_smoothed``). ``group_of``: episode_id → group (GRPO per group), the
    store's extension; None = one group. Returns (rows, summary).
    """
    key = "q_h_smoothed" if use_smoothed else "q_h"
    loaded = [e for e in episodes if e["reward"] >= min_reward]
    if not loaded:
        return [], {"total_episodes_loaded": 0, "episodes_in_dataset": 0}

    grpo: dict[Any, float] = {}
    groups: dict[Any, list[dict[str, Any]]] = {}
    for e in loaded:
        g = group_of.get(e["episode_id"]) if group_of is not None else None
        groups.setdefault(g, []).append(e)
    for members in groups.values():
        rs = [e["reward"] for e in members]
        mean_r = _mean(rs)
        std_r = _pstd(rs)
        if std_r == 0:
            std_r = 1.0
        for e in members:
            grpo[e["episode_id"]] = (e["reward"] - mean_r) / std_r

    all_q = [s.get(key, s.get("q_h", 0.0)) for e in loaded for s in e["steps"]]
    mu_h = _mean(all_q) if all_q else 0.0
    sigma_h = _pstd(all_q) if all_q else 0.0
    if sigma_h == 0:
        sigma_h = 1.0

    raw: list[tuple[dict[str, Any], list[float]]] = []
    for e in loaded:
        a_i = grpo[e["episode_id"]]
        advs = []
        for s in e["steps"]:
            a_micro = (s.get(key, s.get("q_h", 0.0)) - mu_h) / sigma_h
            if a_i > 0:
                a_micro = max(a_micro, 0.0)
            advs.append(max(a_i + omega * a_micro, 0.0))
        raw.append((e, advs))

    positives = [a for _, advs in raw for a in advs if a > 0]
    pos_mean = _mean(positives) if positives else 1.0

    rows = []
    for e, advs in raw:
        weights = [a / pos_mean for a in advs]
        if not any(w > 0 for w in weights):
            continue
        indices = [i for i, m in enumerate(e["messages"]) if m["role"] == "assistant"]
        rows.append(
            {
                "messages": e["messages"],
                "step_advantages": [round(w, 6) for w in weights],
                "step_message_indices": indices,
                "_episode_id": e["episode_id"],
                "_reward": e["reward"],
                "_grpo_advantage": round(grpo[e["episode_id"]], 6),
                "_num_steps": len(weights),
            }
        )
    all_w = [w for r in rows for w in r["step_advantages"]]
    nonzero = [w for w in all_w if w > 0]
    summary = {
        "total_episodes_loaded": len(loaded),
        "episodes_in_dataset": len(rows),
        "total_steps": len(all_w),
        "nonzero_steps": len(nonzero),
        "advantage_stats": {
            "min": min(all_w) if all_w else 0.0,
            "max": max(all_w) if all_w else 0.0,
            "mean": _mean(all_w) if all_w else 0.0,
            "nonzero_mean": _mean(nonzero) if nonzero else 0.0,
        },
    }
    return rows, summary
