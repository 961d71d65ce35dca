"""Counts for ``hcapo-store status``: one pass of set-based SQL."""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import text

from hcapo_store.processes import pid_alive
from hcapo_store.scoring.scorer import scorer_counts
from hcapo_store.storage import db
from hcapo_store.storage.db import sql_now
from hcapo_store.storage.store import Store

# A worker that holds no lease is judged by this age of its heartbeat (the default lease).
STALE_WITHOUT_LEASES_SECONDS = 120.0


def worker_state(w: dict[str, Any], now: float) -> str:
    """The state as of now, not as last written: a worker killed with -9 wrote "running"
    last. Same host: its pid is gone → dead; else its leases expired (or, holding none,
    no heartbeat for a default lease) → stale."""
    if w["state"] != "running":
        return w["state"]
    if w["host"] == socket.gethostname() and not pid_alive(int(w["pid"])):
        return "dead"
    expires = w["lease_expires_at"]
    if expires is not None and expires < now:
        return "stale"
    if expires is None and now - w["heartbeat_at"] > STALE_WITHOUT_LEASES_SECONDS:
        return "stale"
    return "running"


@dataclass(frozen=True)
class WorkerStatus:
    """One ``score`` process, as of now (newest heartbeat first in ``StoreStatus.workers``)."""

    id: str
    scorer_id: str | None
    host: str
    pid: int
    state: str  # as of now (``worker_state``): a killed worker's "running" reads "dead" or "stale"
    heartbeat_at: float  # in the database's clock
    scored: int
    failed: int
    leases: int  # unexpired leases it holds
    seconds_since_heartbeat: float
    stored_state: str  # the state it last wrote


@dataclass(frozen=True)
class StoreStatus:
    """``status``: what the store holds and who is scoring it; ``as_dict()`` is ``status --json``."""

    database: str  # the store's location as shown to people (no password)
    episodes: int  # current versions
    superseded_versions: int  # older versions of episodes, kept
    steps: int  # of current episodes, as are messages and subtasks
    messages: int
    subtasks: int
    credit_runs: int
    steps_by_phase: dict[str, int]
    # per scorer: scored / failed / leased / missing steps and its tokens against the prefill
    # floor (``scoring.scorer.scorer_counts``, which owns that record's shape)
    scorers: list[dict[str, Any]]
    workers: list[WorkerStatus]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def status(store: Store) -> StoreStatus:
    """Counts of episodes, steps, subtasks, per-scorer progress and workers."""
    with db.read(store.engine) as conn:
        one = lambda sql: int(conn.execute(text(sql)).scalar_one() or 0)  # noqa: E731
        counts = {
            "episodes": one("SELECT COUNT(*) FROM episodes WHERE is_current"),
            "superseded_versions": one("SELECT COUNT(*) FROM episodes WHERE NOT is_current"),
            "steps": one("SELECT COUNT(*) FROM steps s JOIN episodes e ON e.id = s.episode_id WHERE e.is_current"),
            "messages": one(
                "SELECT COUNT(*) FROM messages m JOIN episodes e ON e.id = m.episode_id WHERE e.is_current"
            ),
            "subtasks": one(
                "SELECT COUNT(*) FROM subtasks t JOIN episodes e ON e.id = t.episode_id WHERE e.is_current"
            ),
            "credit_runs": one("SELECT COUNT(*) FROM credit_runs"),
        }
        phases = conn.execute(
            text(
                "SELECT s.phase, COUNT(*) FROM steps s JOIN episodes e ON e.id = s.episode_id "
                "WHERE e.is_current GROUP BY s.phase ORDER BY s.phase"
            )
        ).all()
        # Leases and heartbeats are written in the database's clock (PostgreSQL: the server's).
        t = sql_now(conn)
        rows = [
            dict(r)
            for r in conn.execute(
                text(
                    "SELECT w.id, w.scorer_id, w.host, w.pid, w.state, w.heartbeat_at, w.scored, w.failed, "
                    "(SELECT COUNT(*) FROM attempts a WHERE a.lease_owner = w.id AND a.status = 'leased' "
                    " AND a.lease_expires_at > :now) AS leases, "
                    "(SELECT MAX(a.lease_expires_at) FROM attempts a WHERE a.lease_owner = w.id AND a.status = 'leased') "
                    " AS lease_expires_at "
                    "FROM workers w ORDER BY w.heartbeat_at DESC"
                ),
                {"now": t},
            ).mappings()
        ]
    workers = []
    for w in rows:
        state = worker_state(w, t)
        del w["lease_expires_at"]
        workers.append(
            WorkerStatus(
                **{**w, "state": state},
                seconds_since_heartbeat=round(t - w["heartbeat_at"], 1),
                stored_state=w["state"],
            )
        )
    return StoreStatus(
        database=store.display,
        **counts,
        steps_by_phase={p: n for p, n in phases},
        scorers=scorer_counts(store),
        workers=workers,
    )
