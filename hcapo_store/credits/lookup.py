"""Credit runs by name: ``get_run``, ``list_runs``, ``resolve_run``, and each run's staleness
(credited episodes superseded since, completely scored episodes it lacks).

``RunInfo`` is one row of ``credit_runs`` with its scorer's label; ``find_run`` reads one by a
WHERE clause for ``compute`` and ``compare``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, text

from hcapo_store.credits.equations import CreditParams
from hcapo_store.credits.signal import CreditSignal, measure_run
from hcapo_store.errors import CreditError
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


@dataclass
class RunInfo:
    id: int
    name: str
    scorer_id: str
    scorer_label: str | None
    params: dict[str, Any]
    run_hash: str
    episodes: int
    steps: int
    incomplete_episodes: int
    incomplete: list[str]
    created_at: str
    variant: str = "original"
    stored_advantages: bool = False  # False: a run from before revision 0003 (exports compute them)
    episode_scope: list[int] | None = None  # a batch's run (follow): only these episode ids
    # credits/signal.py's CreditSignal as a dict: the hindsight term's non-zero share and the advantage
    # spread (recorded by compute; measured from the credits for a run from before revision 0008)
    signal: dict[str, Any] | None = None
    # Staleness, filled by get_run / list_runs (see ``run_staleness``).
    superseded_episodes: int = 0  # credited episodes that have a newer version since
    uncredited_complete_episodes: int = 0  # current, completely scored, not in the run
    unscored_new_versions: int = 0  # new versions of credited episodes not yet completely scored

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stale": self.stale}

    @property
    def credit_params(self) -> CreditParams:
        return CreditParams.from_dict(self.params)

    @property
    def credit_signal(self) -> CreditSignal | None:
        return CreditSignal.from_dict(self.signal)

    @property
    def stale(self) -> str | None:
        """Why the run no longer matches the store, or None when it is fresh."""
        why = []
        if self.superseded_episodes:
            why.append(f"{self.superseded_episodes} credited episode(s) have a newer version")
        if self.uncredited_complete_episodes:
            why.append(f"{self.uncredited_complete_episodes} completely scored episode(s) are not in it")
        if not why:
            return None
        then = "run `hcapo-store credits compute --recompute` with its parameters"
        if self.unscored_new_versions:
            scorer = self.scorer_label or self.scorer_id[:12]
            then = (
                f"score the {self.unscored_new_versions} new version(s) first (`hcapo-store score` with the "
                f"options of scorer {scorer}; `hcapo-store scorers list` shows them), then {then}"
            )
        return f"credit run {self.name!r} is stale: {'; '.join(why)}; {then}"


RUN_SQL = """
SELECT r.id, r.name, r.scorer_id, sc.label AS scorer_label, r.params, r.run_hash, r.episodes, r.steps,
       r.incomplete_episodes, r.incomplete, r.created_at, r.variant, r.episode_scope, r.signal,
       CASE WHEN EXISTS (SELECT 1 FROM credits c WHERE c.run_id = r.id AND c.advantage IS NOT NULL)
            THEN 1 ELSE 0 END AS stored
FROM credit_runs r LEFT JOIN scorers sc ON sc.id = r.scorer_id
"""


def _run_from_row(row: Any) -> RunInfo:
    r = row._mapping  # by name: a column added to RUN_SQL never shifts the others
    return RunInfo(
        id=r["id"],
        name=r["name"],
        scorer_id=r["scorer_id"],
        scorer_label=r["scorer_label"],
        params=json.loads(r["params"]),
        run_hash=r["run_hash"],
        episodes=r["episodes"],
        steps=r["steps"],
        incomplete_episodes=r["incomplete_episodes"],
        incomplete=json.loads(r["incomplete"]) if r["incomplete"] else [],
        created_at=r["created_at"],
        variant=r["variant"],
        stored_advantages=bool(r["stored"]),
        episode_scope=json.loads(r["episode_scope"]) if r["episode_scope"] else None,
        signal=json.loads(r["signal"]) if r["signal"] else None,
    )


def find_run(conn: Connection, where: str, **params: Any) -> RunInfo | None:
    row = conn.execute(text(RUN_SQL + " WHERE " + where), params).first()
    return _run_from_row(row) if row is not None else None


STALE_SUPERSEDED_SQL = """
SELECT COUNT(DISTINCT s.episode_id)
FROM credits c JOIN steps s ON s.id = c.step_id JOIN episodes e ON e.id = s.episode_id
WHERE c.run_id = :run AND e.is_current IS NOT TRUE
"""

STALE_UNSCORED_SQL = """
SELECT COUNT(*) FROM episodes e
WHERE e.is_current IS TRUE
  AND e.source_key IN (SELECT o.source_key FROM credits c JOIN steps s ON s.id = c.step_id
                       JOIN episodes o ON o.id = s.episode_id
                       WHERE c.run_id = :run AND o.is_current IS NOT TRUE)
  AND EXISTS (SELECT 1 FROM steps s LEFT JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = :scorer
              WHERE s.episode_id = e.id AND sc.id IS NULL)
"""

STALE_UNCREDITED_SQL = """
SELECT COUNT(*) FROM episodes e
WHERE e.is_current IS TRUE
  AND EXISTS (SELECT 1 FROM steps s WHERE s.episode_id = e.id)
  AND NOT EXISTS (SELECT 1 FROM steps s JOIN credits c ON c.step_id = s.id AND c.run_id = :run
                  WHERE s.episode_id = e.id)
  AND NOT EXISTS (SELECT 1 FROM steps s LEFT JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = :scorer
                  WHERE s.episode_id = e.id AND sc.id IS NULL)
"""


def scope_sql(scope: Sequence[int] | None) -> str:
    if scope is None:
        return ""
    ids = ", ".join(str(int(i)) for i in scope)  # integers we stored ourselves
    return f" AND e.id IN ({ids})" if ids else " AND 1 = 0"


def run_staleness(conn: Connection, run: RunInfo) -> RunInfo:
    """Fill in what changed since the run was computed: credited episodes superseded by a
    new version, and episodes completely scored (e.g. after the run) that it lacks."""
    bind = {"run": run.id, "scorer": run.scorer_id}
    if run.signal is None:  # a run from before revision 0008: measured from its stored credits
        measured = measure_run(conn, run.id, float(run.params.get("omega", 1.0)))
        run.signal = None if measured is None else measured.as_dict()
    run.superseded_episodes = int(conn.execute(text(STALE_SUPERSEDED_SQL), bind).scalar() or 0)
    uncredited = STALE_UNCREDITED_SQL + scope_sql(run.episode_scope)  # a batch's run: its own episodes only
    run.uncredited_complete_episodes = int(conn.execute(text(uncredited), bind).scalar() or 0)
    if run.superseded_episodes:
        run.unscored_new_versions = int(conn.execute(text(STALE_UNSCORED_SQL), bind).scalar() or 0)
    return run


def get_run(store: Store, name: str | None = None) -> RunInfo:
    """A run by name (with its staleness); with no name, the only run (else an error listing them)."""
    with db.read(store.engine) as conn:
        return named_run(conn, name)


def named_run(conn: Connection, name: str | None = None) -> RunInfo:
    """:func:`get_run` within a read the caller holds."""
    names = None if name is not None else _run_names(conn)
    if names is not None and len(names) == 1:
        name = names[0]
    if name is not None:
        run = find_run(conn, "r.name = :name", name=name)
        if run is not None:
            return run_staleness(conn, run)
    names = _run_names(conn) if names is None else names
    known = ", ".join(names) if names else "none; run `credits compute` first"
    if name is None:
        raise CreditError(f"several credit runs, pick one: {known}")
    raise CreditError(f"no credit run named {name!r} (runs: {known})")


def _run_names(conn: Connection) -> list[str]:
    return [r[0] for r in conn.execute(text("SELECT name FROM credit_runs ORDER BY id"))]


def resolve_run(store: Store, run: RunInfo | str | None) -> RunInfo:
    """``run`` itself when it is already resolved, else :func:`get_run` (callers that show a
    run in several places resolve it once and pass it down: each lookup scans for staleness)."""
    return run if isinstance(run, RunInfo) else get_run(store, run)


def list_runs(store: Store) -> list[RunInfo]:
    """Every credit run, oldest first."""
    with db.read(store.engine) as conn:
        runs = [_run_from_row(r) for r in conn.execute(text(RUN_SQL + " ORDER BY r.created_at, r.id"))]
        return [run_staleness(conn, r) for r in runs]


def signal_text(store: Store, name: str | None) -> str | None:
    """The recorded hindsight signal of run ``name`` in one line (``follow``'s published batches),
    without the staleness scan ``get_run`` does; None without a run or a record."""
    if not name:
        return None
    with db.read(store.engine) as conn:
        stored = conn.execute(text("SELECT signal FROM credit_runs WHERE name = :n"), {"n": name}).scalar()
    signal = CreditSignal.from_dict(json.loads(stored)) if stored else None
    return None if signal is None else ("warning: " if signal.plain_grpo else "") + signal.text()
