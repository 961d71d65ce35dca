"""Look at credit runs: ``show_run`` (a run's per-subtask summary and clip counts),
``diff_runs`` (how run B's credits differ from run A's on the steps both credit) and
``iter_step_deltas`` (every common step, for ``credits diff --steps``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sqlalchemy import text

from hcapo_store.credits.lookup import RunInfo, get_run
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

FETCH_ROWS = 50_000  # rows per fetch of the step-delta stream

SUBTASK_SUMMARY_SQL = """
SELECT COALESCE(s.subtask_id, s.phase) AS subtask, COUNT(*) AS steps,
       COUNT(DISTINCT s.episode_id) AS episodes, AVG(s.subtask_reward) AS subtask_reward,
       AVG(c.mean_logprob) AS mean_logprob, AVG(c.pi_hind) AS pi_hind, AVG(c.rho) AS rho,
       SUM(CASE WHEN c.rho_raw < c.rho THEN 1 ELSE 0 END) AS clipped_low,
       SUM(CASE WHEN c.rho_raw > c.rho THEN 1 ELSE 0 END) AS clipped_high,
       AVG(c.q_h) AS q_h, AVG(c.q_h_smoothed) AS q_h_smoothed
FROM credits c JOIN steps s ON s.id = c.step_id
WHERE c.run_id = :run
GROUP BY COALESCE(s.subtask_id, s.phase)
"""


@dataclass(frozen=True)
class SubtaskSummary:
    """One subtask's (or planning's) steps in a credit run: counts and means of its credits."""

    subtask: str  # subtask id, or the phase of a step outside every subtask ("planning")
    steps: int
    episodes: int
    subtask_reward: float | None  # None: no step of it has a reward
    mean_logprob: float
    pi_hind: float
    rho: float
    clipped_low: int  # steps whose rho_raw was raised to c_min
    clipped_high: int  # steps whose rho_raw was lowered to c_max
    q_h: float
    q_h_smoothed: float


@dataclass(frozen=True)
class RunDetails:
    """``show_run``: one credit run, its clipped steps and a per-subtask summary.

    ``as_dict()`` is ``credits show --json``: the run's own fields (``RunInfo.as_dict``)
    flat at the top, then the clip counts and the subtasks.
    """

    run: RunInfo
    clipped_low: int  # all steps of the run raised to c_min
    clipped_high: int  # all steps of the run lowered to c_max
    subtasks: list[SubtaskSummary]  # planning first, then by subtask id

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.run.as_dict(),
            "clipped_low": self.clipped_low,
            "clipped_high": self.clipped_high,
            "subtasks": [asdict(s) for s in self.subtasks],
        }


def show_run(store: Store, name: str | None = None) -> RunDetails:
    """Parameters, counts and a per-subtask summary (planning first, then by subtask id)."""
    run = get_run(store, name)
    with db.read(store.engine) as conn:
        rows = [SubtaskSummary(**r) for r in conn.execute(text(SUBTASK_SUMMARY_SQL), {"run": run.id}).mappings()]
    rows.sort(key=lambda r: (r.subtask != "planning", str(r.subtask)))
    clipped_low = sum(r.clipped_low for r in rows)
    clipped_high = sum(r.clipped_high for r in rows)
    return RunDetails(run, clipped_low, clipped_high, rows)


DIFF_SQL = """
SELECT a.step_id, a.rho AS rho_a, b.rho AS rho_b, a.q_h_smoothed AS q_a, b.q_h_smoothed AS q_b
FROM credits a JOIN credits b ON b.step_id = a.step_id AND b.run_id = :b
WHERE a.run_id = :a
ORDER BY a.step_id
"""

STEP_DETAILS_SQL = """
SELECT s.id, e.name, s.step_index, COALESCE(s.subtask_id, s.phase) AS subtask
FROM steps s JOIN episodes e ON e.id = s.episode_id
WHERE s.id IN ({ids})
"""


STEP_DELTAS_SQL = """
SELECT a.step_id, e.name, s.step_index, COALESCE(s.subtask_id, s.phase),
       a.rho, b.rho, a.q_h_smoothed, b.q_h_smoothed
FROM credits a
JOIN credits b ON b.step_id = a.step_id AND b.run_id = :b
JOIN steps s ON s.id = a.step_id
JOIN episodes e ON e.id = s.episode_id
WHERE a.run_id = :a
ORDER BY e.id, s.step_index
"""


def iter_step_deltas(store: Store, a: str, b: str) -> Iterator[dict[str, Any]]:
    """Every common step's rho and q_h_smoothed in runs A and B and the delta B − A."""
    ra, rb = get_run(store, a), get_run(store, b)
    with db.read(store.engine) as conn:
        result = conn.execution_options(yield_per=FETCH_ROWS).execute(text(STEP_DELTAS_SQL), {"a": ra.id, "b": rb.id})
        for step_id, episode, step_index, subtask, rho_a, rho_b, q_a, q_b in result:
            yield {
                "step_id": step_id,
                "episode": episode,
                "step_index": step_index,
                "subtask": subtask,
                "rho_a": rho_a,
                "rho_b": rho_b,
                "delta_rho": rho_b - rho_a,
                "q_h_smoothed_a": q_a,
                "q_h_smoothed_b": q_b,
                "delta_q_h_smoothed": q_b - q_a,
            }


def _quantiles(x: np.ndarray) -> dict[str, float | None]:
    keys = ("min", "p10", "p50", "p90", "max")
    if len(x) == 0:
        return dict.fromkeys(keys)
    values = np.percentile(x, [0, 10, 50, 90, 100])
    return {k: float(v) for k, v in zip(keys, values)}


@dataclass(frozen=True)
class MovedStep:
    """One step's rho and q_h_smoothed in runs A and B, and the deltas B − A."""

    episode: str
    step_index: int
    subtask: str  # subtask id, or the step's phase outside every subtask
    rho_a: float
    rho_b: float
    delta_rho: float
    q_h_smoothed_a: float
    q_h_smoothed_b: float
    delta_q_h_smoothed: float


@dataclass(frozen=True)
class RunDiff:
    """``diff_runs``: how run B's credits differ from run A's on the steps both credit.

    The deltas' quantiles are keyed ``min``, ``p10``, ``p50``, ``p90``, ``max`` (all None when
    no step is common). ``as_dict()`` is ``credits diff --json``.
    """

    a: str
    b: str
    common_steps: int
    only_a: int  # steps run A credits and run B does not
    only_b: int
    params_a: dict[str, Any]
    params_b: dict[str, Any]
    delta_rho: dict[str, float | None]
    delta_q_h_smoothed: dict[str, float | None]
    top_moved: list[MovedStep]  # by |delta q_h_smoothed|, largest first

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def diff_runs(store: Store, a: str, b: str, *, top: int = 10) -> RunDiff:
    """Deltas B − A of rho and q_h_smoothed on the steps both runs credit: quantiles + top movers."""
    ra, rb = get_run(store, a), get_run(store, b)
    with db.read(store.engine) as conn:
        data = conn.execute(text(DIFF_SQL), {"a": ra.id, "b": rb.id}).all()
        step_ids = np.asarray([r.step_id for r in data], dtype=np.int64)
        arr = np.asarray([(r.rho_a, r.rho_b, r.q_a, r.q_b) for r in data], dtype=np.float64).reshape(-1, 4)
        d_rho, d_q = arr[:, 1] - arr[:, 0], arr[:, 3] - arr[:, 2]
        order = np.argsort(-np.abs(d_q), kind="stable")[:top]
        details = {}
        if len(order):
            ids = ", ".join(str(int(i)) for i in step_ids[order])
            details = {r.id: r for r in conn.execute(text(STEP_DETAILS_SQL.format(ids=ids)))}
    movers = []
    for i in order:
        d = details[int(step_ids[i])]
        episode, step_index, subtask = d.name, d.step_index, d.subtask
        rho_a, rho_b, q_a, q_b = (float(v) for v in arr[i])
        movers.append(MovedStep(episode, step_index, subtask, rho_a, rho_b, float(d_rho[i]), q_a, q_b, float(d_q[i])))
    return RunDiff(
        a=ra.name,
        b=rb.name,
        common_steps=len(step_ids),
        only_a=ra.steps - len(step_ids),
        only_b=rb.steps - len(step_ids),
        params_a=ra.params,
        params_b=rb.params,
        delta_rho=_quantiles(d_rho),
        delta_q_h_smoothed=_quantiles(d_q),
        top_moved=movers,
    )
