"""Counts for ``hcapo-store status``: one pass of set-based SQL."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from hcapo_store.storage.db import sql_now
from hcapo_store.scoring.identity import scorer_counts
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

def status(store: Store) -> dict[str, Any]:
    """Counts of episodes, steps, subtasks, per-scorer progress and workers."""
    with db.read(store.engine) as conn:
        one = lambda sql: int(conn.execute(text(sql)).scalar_one() or 0)  # noqa: E731
        counts = {
            "episodes": one("SELECT COUNT(*) FROM episodes WHERE is_current"),
            "superseded_versions": one("SELECT COUNT(*) FROM episodes WHERE NOT is_current"),
            "steps": one("SELECT COUNT(*) FROM steps s JOIN episodes e ON e.id = s.episode_id WHERE e.is_current"),
            "messages": one("SELECT COUNT(*) FROM messages m JOIN episodes e ON e.id = m.episode_id WHERE e.is_current"),
            "subtasks": one("SELECT COUNT(*) FROM subtasks t JOIN episodes e ON e.id = t.episode_id WHERE e.is_current"),
            "credit_runs": one("SELECT COUNT(*) FROM credit_runs"),
        }
        phases = conn.execute(text(
            "SELECT s.phase, COUNT(*) FROM steps s JOIN episodes e ON e.id = s.episode_id "
            "WHERE e.is_current GROUP BY s.phase ORDER BY s.phase"
        )).all()
        # Leases and heartbeats are written in the database's clock (PostgreSQL: the server's).
        t = sql_now(conn)
        workers = [dict(r) for r in conn.execute(text(
            "SELECT w.id, w.scorer_id, w.host, w.pid, w.state, w.heartbeat_at, w.scored, w.failed, "
            "(SELECT COUNT(*) FROM attempts a WHERE a.lease_owner = w.id AND a.status = 'leased' "
            " AND a.lease_expires_at > :now) AS leases "
            "FROM workers w ORDER BY w.heartbeat_at DESC"
        ), {"now": t}).mappings()]
    for w in workers:
        w["seconds_since_heartbeat"] = round(t - w["heartbeat_at"], 1)
    return {
        "database": store.display,
        **counts,
        "steps_by_phase": {p: n for p, n in phases},
        "scorers": scorer_counts(store),
        "workers": workers,
    }
