"""Checks that HCAPO's hindsight signal is in a trainer path's advantages, not only that two
paths agree: shared by the tests of examples/online_loop.py, the verl driver and the TRL example."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.lookup import get_run
from hcapo_store.storage.store import Store

RUN_CREDITS = """
SELECT s.episode_id, s.id AS step_id, s.step_index, e.reward, c.rho_raw, c.rho, c.q_h_smoothed, c.micro, c.advantage
FROM credits c JOIN steps s ON s.id = c.step_id JOIN episodes e ON e.id = s.episode_id JOIN credit_runs r ON r.id = c.run_id
WHERE r.name = :run ORDER BY s.episode_id, s.step_index
"""


def run_credits(store: Store, run: str) -> dict[int, list[dict[str, Any]]]:
    cols, rows = store.query(RUN_CREDITS, {"run": run}, read_only=True)
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        d = dict(zip(cols, row))
        out[int(d["episode_id"])].append(d)
    return out


def assert_advantages_follow_hindsight(store: Store, runs: list[str]) -> None:
    """Within every episode the step advantages are ordered as the steps' Q_H (the hindsight
    logprobs' ratio times the return): one macro term plus ω times a z-score of Q_H."""
    for run in runs:
        for steps in run_credits(store, run).values():
            ordered = sorted(steps, key=lambda s: s["q_h_smoothed"])
            advantages = [s["advantage"] for s in ordered]
            assert advantages == sorted(advantages), (run, ordered)


def assert_advantage_moves_with_logprob(store: Store, runs: list[str], delta: float = 0.05) -> None:
    """Raise one step's stored hindsight logprob, recompute its run: that step's Q_H and its
    advantage move up together (a step inside the clip range, of an episode whose reward is
    not a success, so do-no-harm does not clear its term, with siblings in its episode)."""
    for run in runs:
        info = get_run(store, run)
        params = info.credit_params
        for steps in run_credits(store, run).values():
            if len(steps) < 2 or not 0 < steps[0]["reward"] < params.success_threshold:
                continue
            inside = [s for s in steps if params.c_min + 0.05 < s["rho_raw"] < params.c_max - 0.05]
            if not inside:
                continue
            step = min(inside, key=lambda s: abs(s["rho_raw"] - 1.0))
            store.query(  # the store's scores are the hindsight logprobs
                "UPDATE scores SET mean_logprob = mean_logprob + :d WHERE step_id = :s AND scorer_id = :sc",
                {"d": delta, "s": step["step_id"], "sc": info.scorer_id},
                read_only=False,
            )
            compute_credits(store, params, scorer=info.scorer_id, episodes=info.episode_scope, replace=True)
            after = {s["step_id"]: s for ss in run_credits(store, info.name).values() for s in ss}[step["step_id"]]
            assert after["q_h_smoothed"] > step["q_h_smoothed"], (step, after)
            assert after["advantage"] > step["advantage"], (step, after)
            assert after["advantage"] == pytest.approx(
                step["advantage"] + (after["micro"] - step["micro"]) * params.omega
            )
            return
    pytest.fail(f"no step of runs {runs} is inside the clip range in an episode that is not a success")
