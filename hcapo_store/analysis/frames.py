"""pandas DataFrames of credits and scores, for notebooks (``pip install 'hcapo-store[pandas]'``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import text

from hcapo_store.credits.lookup import get_run
from hcapo_store.errors import MissingExtra
from hcapo_store.scoring.scorer import resolve_scorer
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

CREDITS_SQL = "SELECT * FROM step_credits WHERE run_id = :run ORDER BY episode, episode_id, step_index"
STEPS_SQL = """
SELECT v.*, {blob} AS token_logprobs
FROM step_scores v JOIN scores sc ON sc.step_id = v.step_id AND sc.scorer_id = v.scorer_id
WHERE v.scorer_id = :scorer
ORDER BY v.episode, v.episode_id, v.step_index
"""


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError as exc:
        raise MissingExtra("pandas", "pandas", "DataFrames (credits_frame, steps_frame)") from exc
    return pd


def credits_frame(store: Store, run: str | None = None) -> Any:
    """Every credited step of a credit run (the ``step_credits`` view) as a pandas DataFrame.

    ``run``: the run's name (default: the only run). One row per step, in episode and step
    order: episode, subtask, reward, mean_logprob, pi_hind, rho, q_h, q_h_smoothed, ...
    """
    pd = _pandas()
    info = get_run(store, run)
    with db.read(store.engine) as conn:
        result = conn.execute(text(CREDITS_SQL), {"run": info.id})
        return pd.DataFrame(result.all(), columns=list(result.keys()))


def steps_frame(store: Store, scorer: str | None = None, *, token_logprobs: bool = False) -> Any:
    """Every scored step of a scorer (the ``step_scores`` view) as a pandas DataFrame.

    ``scorer``: id, unique id prefix or label (default: the only scorer). With
    ``token_logprobs=True`` a ``token_logprobs`` column holds each step's per-token
    hindsight logprobs as a float32 numpy array (else the column is absent).
    """
    pd = _pandas()
    with db.read(store.engine) as conn:
        scorer_id, _ = resolve_scorer(conn, scorer)
        sql = STEPS_SQL.format(blob="sc.token_logprobs" if token_logprobs else "NULL")
        result = conn.execute(text(sql), {"scorer": scorer_id})
        frame = pd.DataFrame(result.all(), columns=list(result.keys()))
    if token_logprobs:
        frame["token_logprobs"] = [
            np.frombuffer(bytes(b), dtype="<f4") if b is not None else None for b in frame["token_logprobs"]
        ]
    else:
        frame = frame.drop(columns=["token_logprobs"])
    return frame
