"""A credit run's stored per-token values read back (``token_credits``: a ``--variant log-ratio``
run's per-token advantages, docs/FAMILY.md), for those who place them on a trainer's ids."""

from __future__ import annotations

import numpy as np
from sqlalchemy import Connection, text


def token_advantages(conn: Connection, run_id: int, episode_id: int | None = None) -> dict[tuple[int, int], np.ndarray]:
    """(episode id, step index) → the run's per-token advantages (float32); empty for a run
    without per-token values (HCAPO's)."""
    sql = (
        "SELECT s.episode_id, s.step_index, tc.advantages FROM token_credits tc JOIN steps s ON s.id = tc.step_id "
        "WHERE tc.run_id = :run" + ("" if episode_id is None else " AND s.episode_id = :ep")
    )
    bind = {"run": run_id, **({} if episode_id is None else {"ep": episode_id})}
    return {
        (int(e), int(i)): np.frombuffer(bytes(b), dtype="<f4").astype(np.float32)
        for e, i, b in conn.execute(text(sql), bind)
    }


def step_token_advantages(conn: Connection, run_id: int, episode_id: int) -> dict[int, np.ndarray]:
    """One episode's per-token advantages by step index (``token_advantages``)."""
    return {i: v for (_, i), v in token_advantages(conn, run_id, episode_id).items()}


def step_backbones(conn: Connection, run_id: int, episode_id: int) -> dict[int, float]:
    """One episode's A_i by step index (``credits.a_macro``: a log-ratio run's GRPO backbone,
    0 without ``--grpo``), what a token no scorer scored gets (``handoff.with_lead_in``)."""
    sql = (
        "SELECT s.step_index, c.a_macro FROM credits c JOIN steps s ON s.id = c.step_id "
        "WHERE c.run_id = :run AND s.episode_id = :ep"
    )
    return {int(i): float(a or 0.0) for i, a in conn.execute(text(sql), {"run": run_id, "ep": episode_id})}
