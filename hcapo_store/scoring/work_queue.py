"""The scoring queue in SQL: enqueue, claim with a lease, heartbeat, complete, fail, release.

Every (step, scorer) pair has one ``attempts`` row. Claims take all claimable steps of
one episode (its requests go in step order, so the server's prefix cache reuses the
shared prefix) in one short write transaction. Completion is race-tolerant: the first
result for a step wins, a late one is discarded without error. Per-dialect SQL lives
here only (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: the episode row locked
``FOR NO KEY UPDATE SKIP LOCKED``, leases judged by the server's clock).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, text

from hcapo_store.masking import mask_credentials
from hcapo_store.processes import pid_alive
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

PENDING, LEASED, DONE, FAILED = "pending", "leased", "done", "failed"

# The steps a scorer may score: those of current episodes converted with its options.
ELIGIBLE = """e.is_current AND e.include_thinking = :include_thinking
  AND e.max_tool_result_chars = :max_tool_result_chars"""
ELIGIBLE_STEPS = f"FROM steps s JOIN episodes e ON e.id = s.episode_id\nWHERE {ELIGIBLE}"

# :scorer_value is :scorer again under another name: PostgreSQL infers one type per
# parameter, and the select list (text) and the comparison (varchar) disagree.
ENQUEUE_SQL = """
INSERT INTO attempts (step_id, scorer_id, episode_id, step_index, status, attempt_count, updated_at)
SELECT s.id, :scorer_value, s.episode_id, s.step_index, 'pending', 0, :now
{steps}{where}
  AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.step_id = s.id AND a.scorer_id = :scorer)
-- workers starting together race to enqueue the same steps (PostgreSQL, READ COMMITTED)
ON CONFLICT (step_id, scorer_id) DO NOTHING
"""

CLAIMABLE = "(a.status = 'pending' OR (a.status = 'leased' AND a.lease_expires_at < :now))"


@dataclass(frozen=True)
class Filters:
    # Exact episode names, keys or ids; storage.episodes.resolve_episodes turns what a user
    # typed (a part of a name too) into keys, refusing an ambiguous one.
    episodes: tuple[str, ...] = ()
    min_reward: float | None = None

    def sql(self, params: dict[str, Any]) -> str:
        parts = []
        if self.episodes:
            keys, ids = [], []
            for i, e in enumerate(self.episodes):
                params[f"ep{i}"] = e
                keys.append(f":ep{i}")
                if e.isascii() and e.isdigit():  # an id compared as an integer: an index lookup, not
                    params[f"epid{i}"] = int(e)  # a cast of every row's id (follow's cycles ask by id)
                    ids.append(f":epid{i}")
            names = ", ".join(keys)
            by_id = f" OR e.id IN ({', '.join(ids)})" if ids else ""
            parts.append(f"(e.name IN ({names}) OR e.source_key IN ({names}){by_id})")
        if self.min_reward is not None:
            params["min_reward"] = self.min_reward
            parts.append("e.reward >= :min_reward")
        return "".join(f" AND {p}" for p in parts)

    # A filter by episode names a few episodes: its queries walk those episodes (by their
    # indexes) and then their rows (by episode id), never the store's. SQLite keeps a CROSS
    # JOIN's left table as the outer loop; left to itself, its planner walked every queued row
    # of the scorer through ix_attempts_claim (the one-new-episode follow cycle grew with the
    # store). PostgreSQL plans a CROSS JOIN with a WHERE like any inner join.
    def steps_from(self) -> str:
        """The FROM and WHERE of the eligible steps ``s`` of episodes ``e`` (filter not included)."""
        if self.episodes:
            return f"FROM episodes e CROSS JOIN steps s\nWHERE s.episode_id = e.id AND {ELIGIBLE}"
        return ELIGIBLE_STEPS

    def attempts_from(self) -> str:
        """The FROM and WHERE of the queue rows ``a`` of current episodes ``e`` (filter not included)."""
        if self.episodes:
            return "FROM episodes e CROSS JOIN attempts a WHERE a.episode_id = e.id AND e.is_current"
        return "FROM attempts a JOIN episodes e ON e.id = a.episode_id WHERE e.is_current"


@dataclass(frozen=True)
class Lease:
    attempt_id: int
    step_id: int
    step_index: int
    attempt_count: int


@dataclass(frozen=True)
class Claim:
    episode_id: int
    leases: list[Lease]


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def enqueue(
    store: Store,
    scorer_id: str,
    *,
    include_thinking: bool,
    max_tool_result_chars: int,
    filters: Filters = Filters(),
) -> int:
    """Create queue rows for steps of current episodes that have none (set-based), of the
    episodes ``filters`` selects (a run only claims those: the others' rows can wait for a run
    that wants them, and a filtered run does not read the whole store to queue them)."""
    params: dict[str, Any] = {
        "scorer": scorer_id,
        "scorer_value": scorer_id,
        "include_thinking": include_thinking,
        "max_tool_result_chars": max_tool_result_chars,
    }
    where = filters.sql(params)
    sql = ENQUEUE_SQL.format(steps=filters.steps_from(), where=where)
    with db.write(store.engine) as conn:
        params["now"] = db.sql_now(conn)
        return conn.execute(text(sql), params).rowcount or 0


def unscored_steps(
    store: Store,
    scorer_id: str,
    *,
    include_thinking: bool,
    max_tool_result_chars: int,
    filters: Filters,
    limit: int | None = None,
) -> list[tuple[int, int]]:
    """(episode_id, step_index) of eligible steps not yet done or failed, in queue order; read-only."""
    params: dict[str, Any] = {
        "scorer": scorer_id,
        "include_thinking": include_thinking,
        "max_tool_result_chars": max_tool_result_chars,
    }
    where = filters.sql(params)
    sql = (
        f"SELECT s.episode_id, s.step_index {filters.steps_from()}{where} AND NOT EXISTS (SELECT 1 FROM attempts a "
        "WHERE a.step_id = s.id AND a.scorer_id = :scorer AND a.status IN ('done', 'failed')) "
        "ORDER BY s.episode_id, s.step_index"
    )
    if limit is not None:  # the database stops at the limit ("is there any?" reads one row)
        sql += f" LIMIT {int(limit)}"
    with db.read(store.engine) as conn:
        return [(ep, idx) for ep, idx in conn.execute(text(sql), params)]


def requeue_failed(store: Store, scorer_id: str, filters: Filters) -> int:
    params: dict[str, Any] = {"scorer": scorer_id}
    where = filters.sql(params)
    with db.write(store.engine) as conn:
        params["now"] = db.sql_now(conn)
        return (
            conn.execute(
                text(
                    "UPDATE attempts SET status = 'pending', attempt_count = 0, lease_owner = NULL, "
                    "lease_expires_at = NULL, updated_at = :now WHERE scorer_id = :scorer AND status = 'failed' "
                    f"AND episode_id IN (SELECT e.id FROM episodes e WHERE e.is_current{where})"
                ),
                params,
            ).rowcount
            or 0
        )


def count_claimable(store: Store, scorer_id: str, filters: Filters) -> int:
    params: dict[str, Any] = {"scorer": scorer_id}
    where = filters.sql(params)
    with db.read(store.engine) as conn:
        params["now"] = db.sql_now(conn)
        return int(
            conn.execute(
                text(f"SELECT COUNT(*) {filters.attempts_from()} AND a.scorer_id = :scorer AND {CLAIMABLE}{where}"),
                params,
            ).scalar_one()
        )


def claim(
    store: Store, scorer_id: str, worker: str, *, lease_seconds: float, filters: Filters, max_steps: int | None = None
) -> Claim | None:
    """Lease the claimable steps of one episode (at most ``max_steps``, in step order)."""
    params: dict[str, Any] = {"scorer": scorer_id, "me": worker}
    where = filters.sql(params)
    with db.write(store.engine) as conn:
        now = db.sql_now(conn)
        params.update(now=now, expires=now + lease_seconds)
        pg = conn.dialect.name == "postgresql"
        if pg:
            # The episode row is the claim's mutex (NO KEY UPDATE: FK checks of concurrent
            # inserts are not blocked); SKIP LOCKED moves on to the next episode instead of
            # waiting. Locking attempt rows one by one would deadlock: two claimers could each
            # hold one step of the same episode and wait for the other's.
            row = conn.execute(
                text(
                    f"SELECT e.id FROM episodes e WHERE e.is_current{where} AND EXISTS (SELECT 1 FROM attempts a "
                    f"WHERE a.episode_id = e.id AND a.scorer_id = :scorer AND {CLAIMABLE}) "
                    "ORDER BY e.id LIMIT 1 FOR NO KEY UPDATE OF e SKIP LOCKED"
                ),
                params,
            ).first()
        else:  # SQLite: BEGIN IMMEDIATE already serialises claimers
            row = conn.execute(
                text(
                    f"SELECT a.episode_id {filters.attempts_from()} AND a.scorer_id = :scorer AND {CLAIMABLE}{where} "
                    "ORDER BY a.episode_id, a.step_index LIMIT 1"
                ),
                params,
            ).first()
        if row is None:
            return None
        params["episode"] = row[0]
        limit = f" LIMIT {int(max_steps)}" if max_steps is not None else ""
        # PostgreSQL: rows a heartbeat or a result write holds right now are skipped, not waited for.
        skip = " FOR UPDATE SKIP LOCKED" if pg else ""
        rows = conn.execute(
            text(
                "UPDATE attempts SET status = 'leased', lease_owner = :me, lease_expires_at = :expires, "
                "updated_at = :now WHERE id IN (SELECT a.id FROM attempts a WHERE a.scorer_id = :scorer "
                f"AND a.episode_id = :episode AND {CLAIMABLE} ORDER BY a.step_index{limit}{skip}) "
                f"AND {CLAIMABLE.replace('a.', '')} "
                "RETURNING id, step_id, step_index, attempt_count"
            ),
            params,
        ).all()
    leases = sorted((Lease(*r) for r in rows), key=lambda lease: lease.step_index)
    return Claim(episode_id=row[0], leases=leases)


def heartbeat(store: Store, worker: str, *, lease_seconds: float, scored: int, failed: int) -> None:
    with db.write(store.engine) as conn:
        now = db.sql_now(conn)
        conn.execute(
            text("UPDATE attempts SET lease_expires_at = :exp WHERE lease_owner = :me AND status = 'leased'"),
            {"exp": now + lease_seconds, "me": worker},
        )
        conn.execute(
            text("UPDATE workers SET heartbeat_at = :now, scored = :scored, failed = :failed WHERE id = :me"),
            {"now": now, "me": worker, "scored": scored, "failed": failed},
        )


def register_worker(store: Store, worker: str, scorer_id: str) -> None:
    host, _, pid = worker.rpartition(":")
    with db.write(store.engine) as conn:
        now = db.sql_now(conn)
        conn.execute(text("DELETE FROM workers WHERE id = :id"), {"id": worker})
        conn.execute(
            text(
                "INSERT INTO workers (id, scorer_id, host, pid, started_at, heartbeat_at, state, scored, failed) "
                "VALUES (:id, :scorer, :host, :pid, :now, :now, 'running', 0, 0)"
            ),
            {
                "id": worker,
                "scorer": scorer_id,
                "host": host or socket.gethostname(),
                "pid": int(pid) if pid.isdigit() else os.getpid(),
                "now": now,
            },
        )


def finish_worker(
    store: Store, worker: str, state: str, *, scored: int | None = None, failed: int | None = None
) -> int:
    """Mark the worker stopped and give back the steps it still holds; returns how many.

    ``scored``/``failed``: the worker's final counts (the heartbeat's are up to a third of
    a lease old); None keeps the stored ones (e.g. when reaping a dead worker).
    """
    with db.write(store.engine) as conn:
        now = db.sql_now(conn)
        released = (
            conn.execute(
                text(
                    "UPDATE attempts SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, updated_at = :now "
                    "WHERE lease_owner = :me AND status = 'leased'"
                ),
                {"me": worker, "now": now},
            ).rowcount
            or 0
        )
        conn.execute(
            text(
                "UPDATE workers SET state = :state, heartbeat_at = :now, scored = COALESCE(:scored, scored), "
                "failed = COALESCE(:failed, failed) WHERE id = :me"
            ),
            {"state": state, "now": now, "me": worker, "scored": scored, "failed": failed},
        )
    return released


def reap_dead_local_workers(store: Store) -> int:
    """Release leases of workers on this host whose process is gone (e.g. kill -9).

    Other hosts' workers are judged by lease expiry only: we cannot see their processes.
    """
    host = socket.gethostname()
    with db.read(store.engine) as conn:
        rows = conn.execute(
            text("SELECT id, pid FROM workers WHERE host = :host AND state = 'running'"), {"host": host}
        ).all()
    dead = [wid for wid, pid in rows if pid != os.getpid() and not pid_alive(pid)]
    released = 0
    for wid in dead:
        released += finish_worker(store, wid, "dead")
    return released


@dataclass(frozen=True)
class OthersLeases:
    owner: str
    steps: int
    until: float  # epoch seconds: the latest of the owner's lease expiries


def leases_of_others(store: Store, scorer_id: str, worker: str, filters: Filters) -> list[OthersLeases]:
    """Unexpired leases of this scorer's steps held by other workers, per owner."""
    params: dict[str, Any] = {"scorer": scorer_id, "me": worker}
    where = filters.sql(params)
    with db.read(store.engine) as conn:
        params["now"] = db.sql_now(conn)
        rows = conn.execute(
            text(
                f"SELECT a.lease_owner, COUNT(*), MAX(a.lease_expires_at) {filters.attempts_from()} "
                "AND a.scorer_id = :scorer AND a.status = 'leased' AND a.lease_expires_at >= :now "
                f"AND a.lease_owner <> :me{where} "
                "GROUP BY a.lease_owner ORDER BY a.lease_owner"
            ),
            params,
        ).all()
    return [OthersLeases(str(owner), int(n), float(until)) for owner, n, until in rows]


TOPK_KEY = "topk"  # a score row's top-k (``score --top-k``), written to topk_scores beside its score


@dataclass
class StepResult:
    """One finished attempt, to be written by the single writer."""

    attempt_id: int
    step_id: int
    score_row: dict[str, Any] | None = None  # success
    error_kind: str | None = None
    error: str | None = None
    final: bool = False  # the step is failed for good


def write_results(conn: Connection, scorer_id: str, worker: str, outcomes: list[StepResult]) -> tuple[int, int, int]:
    """Apply a batch in the caller's transaction; returns (scored, failed, discarded).

    Failed attempts are written first, one by one, in order (a retried step's errors come
    before its success); successes then take their attempts in one ``UPDATE … RETURNING``
    per chunk and insert their scores in one ``executemany``: per-row statements were
    most of the writer's time at hundreds of steps per second."""
    now = db.sql_now(conn)
    failed = 0
    successes: list[StepResult] = []
    for o in outcomes:
        if o.score_row is not None:
            successes.append(o)
            continue
        message = mask_credentials(o.error or "")  # a server URL's password never reaches the database
        params = {"id": o.attempt_id, "kind": o.error_kind, "msg": message, "me": worker, "now": now}
        conn.execute(_RECORD_ERROR, params)
        conn.execute(_FAIL_ATTEMPT if o.final else _COUNT_ERROR, params)
        failed += int(o.final)
    won: set[int] = set()
    attempt_ids = list(dict.fromkeys(o.attempt_id for o in successes))
    for i in range(0, len(attempt_ids), _IDS_PER_STATEMENT):
        chunk = attempt_ids[i : i + _IDS_PER_STATEMENT]
        won.update(conn.execute(_FINISH_ATTEMPTS, {"ids": chunk, "now": now}).scalars())
    rows = []
    topk_rows = []
    for o in successes:
        if o.attempt_id not in won:
            continue  # someone else finished this step first (or a duplicate in this batch)
        won.discard(o.attempt_id)
        assert o.score_row is not None
        row = {
            **OPTIONAL_SCORE_COLUMNS,
            **o.score_row,
            "step_id": o.step_id,
            "scorer_id": scorer_id,
            "worker_id": worker,
        }
        top = row.pop(TOPK_KEY, None)  # score --top-k: from the same request, stored with its score
        if top is not None:
            topk_rows.append({**top, "step_id": o.step_id, "scorer_id": scorer_id})
        rows.append(row)
    if rows:
        conn.execute(_INSERT_SCORE, rows)
    if topk_rows:
        conn.execute(_INSERT_TOPK, topk_rows)
    return len(rows), failed, len(successes) - len(rows)


_IDS_PER_STATEMENT = 500  # well under SQLite's bound-variable limit
_INSERT_TOPK = text(
    "INSERT INTO topk_scores (step_id, scorer_id, k, token_count, ids, logprobs) "
    "VALUES (:step_id, :scorer_id, :k, :token_count, :ids, :logprobs)"
)
_FINISH_ATTEMPTS = text(
    "UPDATE attempts SET status = 'done', lease_owner = NULL, lease_expires_at = NULL, updated_at = :now "
    "WHERE id IN :ids AND status <> 'done' RETURNING id"
).bindparams(bindparam("ids", expanding=True))
_RECORD_ERROR = text(
    "INSERT INTO attempt_errors (attempt_id, kind, message, worker_id, at) VALUES (:id, :kind, :msg, :me, :now)"
)
_ERROR_UPDATE = (
    "UPDATE attempts SET attempt_count = attempt_count + 1, last_error_kind = :kind, last_error = :msg, "
    "updated_at = :now{} WHERE id = :id AND status <> 'done'"
)
_COUNT_ERROR = text(_ERROR_UPDATE.format(""))
_FAIL_ATTEMPT = text(_ERROR_UPDATE.format(", status = 'failed', lease_owner = NULL, lease_expires_at = NULL"))


def write_floors(conn: Connection, scorer_id: str, floors: list[tuple[int, int]]) -> None:
    """Record (episode id, conversation tokens) for the scorer; an episode's floor is written once."""
    if floors:
        conn.execute(
            text(
                "INSERT INTO episode_floors (scorer_id, episode_id, conversation_tokens) "
                "VALUES (:scorer, :episode, :tokens) ON CONFLICT (scorer_id, episode_id) DO NOTHING"
            ),
            [{"scorer": scorer_id, "episode": e, "tokens": t} for e, t in floors],
        )


# Columns a result may leave out (NULL): the token shares, unknown to a row built elsewhere.
OPTIONAL_SCORE_COLUMNS: dict[str, Any] = {"sent_tokens": None, "sent_cached_tokens": None}

SCORE_COLUMNS = (
    "step_id",
    "scorer_id",
    "token_logprobs",
    "token_count",
    "mean_logprob",
    "total_action_tokens",
    "skipped_action_tokens",
    "truncated_prefix_tokens",
    "input_tokens",
    "logprob_start_len",
    "flattened",
    "prompt_tokens",
    "cached_tokens",
    "latency_s",
    "server_model",
    "worker_id",
    "created_at",
    "sent_tokens",
    "sent_cached_tokens",
)
_INSERT_SCORE = text(
    f"INSERT INTO scores ({', '.join(SCORE_COLUMNS)}) VALUES ({', '.join(':' + c for c in SCORE_COLUMNS)})"
)
