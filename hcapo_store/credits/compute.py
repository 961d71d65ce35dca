"""Compute a credit run: ``compute_credits``.

It streams (episodes ⨝ steps ⟕ scores) for one scorer in a single ordered query, computes
Eq. 5–7 per batch of whole episodes with numpy (``credits/equations.py``; the paper variant's
advantages in ``credits/paper.py``), and bulk-inserts the credits with executemany, all inside
one write transaction: a run either exists with all its credits or not at all. Episodes with a
step that has no score under the scorer (missing or failed) are listed as incomplete and get
no credits. A run's identity (``run_hash``) is its scorer and parameters, and for a batch's
run the episodes' content identities (``scoped_run_hash``), never database-local ids.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.canonical import canonical_json, content_hash
from hcapo_store.clock import utcnow
from hcapo_store.credits.equations import CreditParams, EpisodeBatch, episode_credits, hcapo_weights, run_hash
from hcapo_store.credits.lookup import RunInfo, find_run, run_staleness, scope_sql
from hcapo_store.credits.signal import CreditSignal, measure
from hcapo_store.errors import CreditError
from hcapo_store.ingestion import fields
from hcapo_store.scoring.scorer import resolve_scorer
from hcapo_store.storage import db
from hcapo_store.storage.once import insert_once
from hcapo_store.storage.store import Store

RUN_TRIES = 5  # looks again after another writer created this run (or took its name) first
FETCH_ROWS = 50_000  # rows per fetch of the streaming select
INSERT_ROWS = 100_000  # credits per executemany call
MAX_LISTED_INCOMPLETE = 10_000  # names kept in credit_runs.incomplete; the count is exact

# One ordered pass over every step of every current episode, with its score (if any).
# The credit stream's rows are plain DB-API tuples (a million of them): their fields are read
# by these names' positions, never by bare numbers.
STREAM_COLUMNS = (
    ("episode_id", "e.id"),
    ("reward", "e.reward"),
    ("step_id", "s.id"),
    ("phase", "s.phase"),
    ("subtask_id", "s.subtask_id"),
    ("subtask_reward", "s.subtask_reward"),
    ("mean_logprob", "sc.mean_logprob"),
    ("token_count", "sc.token_count"),
    ("blob", "{blob}"),
)
_STREAM_NAMES = tuple(name for name, _ in STREAM_COLUMNS)
_EPISODE_ID = _STREAM_NAMES.index("episode_id")
_MEAN_LOGPROB = _STREAM_NAMES.index("mean_logprob")

STREAM_SQL = (
    "SELECT "
    + ", ".join(f"{expr} AS {name}" for name, expr in STREAM_COLUMNS)
    + """
FROM episodes e
JOIN steps s ON s.episode_id = e.id
LEFT JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = :scorer
WHERE e.is_current IS TRUE{scope}
ORDER BY e.id, s.step_index
"""
)

CREDIT_COLUMNS = (
    "run_id",
    "step_id",
    "mean_logprob",
    "token_count",
    "pi_hind",
    "rho_raw",
    "rho",
    "r_t",
    "discount",
    "q_h",
    "q_h_smoothed",
    "a_macro",
    "micro",
    "advantage",
)


@dataclass
class ComputeResult:
    run: RunInfo
    created: bool  # False: an existing run with the same scorer + parameters was returned
    message: str
    null_reward_steps: int = 0  # dense steps whose NULL subtask_reward counted as 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run.as_dict(),
            "created": self.created,
            "message": self.message,
            "null_reward_steps": self.null_reward_steps,
            "seconds": round(self.seconds, 3),
        }


def compute_credits(
    store: Store,
    params: CreditParams = CreditParams(),
    *,
    name: str | None = None,
    scorer: str | None = None,
    replace: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    episodes: Sequence[int] | None = None,
) -> ComputeResult:
    """Compute (or find) the credit run of (scorer, params).

    Same scorer + params → the existing run is returned (``created=False``) unless
    ``replace`` recomputes it (e.g. after more steps were scored). ``on_progress(episodes,
    steps)`` is called after each batch. ``episodes``: the run covers only these episode ids
    (a batch of ``follow``: its group statistics are the batch's own); part of the run's identity.
    """
    started = time.perf_counter()
    scope = None if episodes is None else sorted({int(i) for i in episodes})
    default = params.is_default
    with db.write(store.engine) as conn:
        scorer_id, _ = resolve_scorer(conn, scorer)
        # dense or terminal returns, decided before the identity: the recorded params say which
        params, note = params.for_data(has_subtask_rewards(conn, scope))
        h = run_hash(scorer_id, params) if scope is None else scoped_run_hash(conn, scorer_id, params, scope)
        existing = find_run(conn, "r.run_hash = :h", h=h)
        if existing is not None and not replace:
            run_staleness(conn, existing)
            return ComputeResult(
                existing, False, _existing_message(existing, name), seconds=time.perf_counter() - started
            )
        for _ in range(RUN_TRIES):
            run_name = _choose_name(conn, name, default, h, existing)
            if existing is not None:
                conn.execute(text("DELETE FROM credits WHERE run_id = :id"), {"id": existing.id})
                conn.execute(text("DELETE FROM credit_runs WHERE id = :id"), {"id": existing.id})
            run_id = insert_run(conn, run_name, scorer_id, params.as_dict(), params.variant, h, scope)
            if run_id is not None:
                break
            # Another writer created this run (or took this name) first; on PostgreSQL the insert
            # waited for its commit. The same run: return it, as if it had been there before.
            existing = find_run(conn, "r.run_hash = :h", h=h)
            if existing is not None and not replace:
                run_staleness(conn, existing)
                return ComputeResult(
                    existing, False, _existing_message(existing, name), seconds=time.perf_counter() - started
                )
        else:
            raise CreditError(
                f"other writers created a credit run with this name or these parameters first {RUN_TRIES} times "
                "in a row: no run stored (run it again)"
            )
        totals = _fill_run(conn, run_id, scorer_id, params, on_progress, scope)
        if note:
            totals.signal = dataclasses.replace(totals.signal, note=note) if totals.signal else None
        if totals.episodes == 0:  # raising here rolls the run back: an empty run is never listed
            raise CreditError(
                f"no episode is completely scored under scorer {scorer_id[:12]} "
                f"({totals.incomplete_count} incomplete): nothing to credit, no run stored; "
                "score the missing steps first (hcapo-store score, then hcapo-store status)"
            )
        conn.execute(
            text(
                "UPDATE credit_runs SET episodes = :e, steps = :s, incomplete_episodes = :ni, "
                "incomplete = :inc, signal = :sig WHERE id = :id"
            ),
            {
                "sig": None if totals.signal is None else canonical_json(totals.signal.as_dict(), ascii_only=True),
                "e": totals.episodes,
                "s": totals.steps,
                "ni": totals.incomplete_count,
                "inc": json.dumps(totals.incomplete),
                "id": run_id,
            },
        )
        run = find_run(conn, "r.id = :id", id=run_id)
    assert run is not None
    verb = "recomputed" if existing is not None else "computed"
    msg = (
        f"{verb} credit run {run.name!r}: {run.steps} steps of {run.episodes} episodes"
        f"; {run.incomplete_episodes} incomplete episode(s) skipped"
    )
    if totals.null_rewards:
        msg += f"; warning: {totals.null_rewards} step(s) with NULL subtask_reward used r_t = 0"
    for warning in totals.warnings:
        msg += f"; warning: {warning}"
    if totals.signal is not None:
        msg += f"\n{'warning: ' if totals.signal.plain_grpo else ''}{totals.signal.text()}"
    return ComputeResult(run, True, msg, totals.null_rewards, time.perf_counter() - started)


def _existing_message(run: RunInfo, name: str | None) -> str:
    msg = f"credit run {run.name!r} already has this scorer and these parameters: returned it"
    if name is not None and name != run.name:
        msg += f" (the name {name!r} was not used)"
    if run.stale:
        return f"{msg}; warning: {run.stale}"
    return msg + "; use --recompute to compute it again"


def _choose_name(conn: Connection, name: str | None, default: bool, h: str, existing: RunInfo | None) -> str:
    def taken(n: str) -> bool:
        other = find_run(conn, "r.name = :n", n=n)
        return other is not None and other.run_hash != h

    if name is not None:
        if taken(name):
            raise CreditError(
                f"the name {name!r} is already used by a credit run with other "
                "parameters or another scorer; pick another --name"
            )
        return name
    if existing is not None:
        return existing.name
    if default and not taken("default"):
        return "default"
    return f"run-{h[:8]}"


def has_subtask_rewards(conn: Connection, scope: Sequence[int] | None = None) -> bool:
    """Whether any step of the current episodes (of ``scope``) has a subtask reward: without one,
    dense returns are 0 on every step (``CreditParams.for_data``)."""
    sql = (
        "SELECT 1 FROM steps s JOIN episodes e ON e.id = s.episode_id "
        f"WHERE e.is_current IS TRUE AND s.subtask_reward IS NOT NULL{scope_sql(scope)} LIMIT 1"
    )
    return conn.execute(text(sql)).first() is not None


def scope_identities(conn: Connection, scope: Sequence[int]) -> list[str]:
    """The episode versions' content identities (ingestion's episode key and content hash),
    sorted: the same episodes give the same list in any database, whatever ids they got."""
    ids = sorted({int(i) for i in scope})
    found: dict[int, str] = {}
    for start in range(0, len(ids), 500):  # bind-parameter limits of SQLite and PostgreSQL
        chunk = ids[start : start + 500]
        listed = ", ".join(str(i) for i in chunk)  # ints
        rows = conn.execute(text(f"SELECT id, source_key, content_hash FROM episodes WHERE id IN ({listed})"))
        found.update((int(i), f"{key}\n{h}") for i, key, h in rows)
    missing = [i for i in ids if i not in found]
    if missing:
        raise CreditError(
            f"episode id(s) {missing[:5]} are not in this store: give ids of stored episodes "
            "(hcapo-store episodes lists them)"
        )
    return sorted(found.values())


def scoped_run_hash(conn: Connection, scorer_id: str, params: CreditParams, scope: Sequence[int]) -> str:
    """A run over a set of episodes (a batch): the set is part of its identity, by content
    (episode key and content hash), never by the database-local ids, so a batch's run name
    means the same episodes in every database."""
    episodes = scope_identities(conn, scope)
    return content_hash({"scorer_id": scorer_id, "params": params.as_dict(), "episodes": episodes}, ascii_only=True)


def insert_run(
    conn: Connection,
    name: str,
    scorer_id: str,
    params: dict[str, Any],
    variant: str,
    h: str,
    scope: Sequence[int] | None = None,
) -> int | None:
    """A new ``credit_runs`` row of any variant (HCAPO's here, log-ratio's in log_ratio.py): its
    id, or None when a run with this hash or this name exists already (insert once,
    storage/once.py: two writers of the same run at once see no error)."""
    run_id = insert_once(
        conn,
        "credit_runs",
        {
            "name": name,
            "scorer_id": scorer_id,
            "params": canonical_json(params, ascii_only=True),
            "run_hash": h,
            "episodes": 0,
            "steps": 0,
            "incomplete_episodes": 0,
            "incomplete": None,
            "created_at": utcnow().isoformat(timespec="seconds"),
            "variant": variant,
            "episode_scope": None if scope is None else json.dumps(list(scope)),
        },
        unique=None,  # run_hash or name: whichever a racing writer took first
    )
    return None if run_id is None else int(run_id)


@dataclass
class _Totals:
    episodes: int = 0
    steps: int = 0
    null_rewards: int = 0
    incomplete_count: int = 0
    incomplete_ids: list[int] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    signal: CreditSignal | None = None  # the hindsight signal of the computed advantages


def _fill_run(
    conn: Connection,
    run_id: int,
    scorer_id: str,
    params: CreditParams,
    on_progress: Callable[[int, int], None] | None,
    scope: Sequence[int] | None = None,
) -> _Totals:
    """Streams the scored steps, keeps the complete episodes' columns, then computes every
    credit at once: advantages need statistics over all episodes of a group."""
    n = params.max_logprob_tokens
    # The blob is fetched only for scores the suffix re-aggregation actually changes.
    blob = "CASE WHEN sc.token_count > :n THEN sc.token_logprobs END" if n else "NULL"
    sql = text(STREAM_SQL.format(blob=blob, scope=scope_sql(scope)))
    bind: dict[str, Any] = {"scorer": scorer_id, **({"n": n} if n else {})}
    totals = _Totals()
    parts: list[_Columns] = []
    for rows in _whole_episodes(_raw_stream(conn, sql, bind)):
        cols = _batch_columns(rows, params, totals)
        if cols is not None:
            parts.append(cols)
        if on_progress is not None:
            on_progress(totals.episodes, totals.steps)
    if totals.incomplete_ids:
        totals.incomplete = _episode_names(conn, totals.incomplete_ids)
    if not parts:
        return totals
    cols = _Columns.concat(parts)
    del parts
    columns = _credit_columns(conn, run_id, params, cols, totals)
    insert_sql = _insert_sql(conn)
    # Python objects only for one chunk at a time: a million rows of 14 floats would be ~0.5 GB.
    for i in range(0, len(cols.step_id), INSERT_ROWS):
        chunk = [c[i : i + INSERT_ROWS] for c in columns]
        n = len(chunk[0])
        conn.exec_driver_sql(
            insert_sql, list(zip([run_id] * n, *(c.tolist() if c.dtype != object else list(c) for c in chunk)))
        )
    return totals


@dataclass
class _Columns:
    """Per-step columns of complete episodes, in (episode, step) order."""

    episode: np.ndarray  # int64 episode id per step
    step_id: np.ndarray
    mean: np.ndarray
    tokens: np.ndarray
    subtask_reward: np.ndarray
    group: np.ndarray
    reward: np.ndarray  # per step (the episode's)

    @staticmethod
    def concat(parts: list[_Columns]) -> _Columns:
        return _Columns(*(np.concatenate([getattr(p, f) for p in parts]) for f in _Columns.__dataclass_fields__))


def _credit_columns(
    conn: Connection, run_id: int, params: CreditParams, cols: _Columns, totals: _Totals
) -> list[np.ndarray]:
    """The credit table's columns after ``run_id`` (CREDIT_COLUMNS order) for every collected step."""
    starts = _starts(cols.episode)
    batch = EpisodeBatch(
        starts=starts,
        mean_logprob=cols.mean,
        subtask_reward=cols.subtask_reward,
        group=cols.group,
        episode_reward=cols.reward[starts],
    )
    episode_ids = cols.episode[starts]
    groups = _tag_groups(conn, episode_ids, params.group_by, totals)
    if params.variant == "paper":
        from hcapo_store.credits.paper import paper_advantages

        c = paper_advantages(
            batch,
            params,
            groups=groups,
            success_threshold=params.success_threshold,
            omega=params.omega,
            dense=params.uses_dense,
        )
        a_macro, micro, advantage = c.a_macro, c.micro, c.advantage
    else:
        c = episode_credits(batch, params)  # type: ignore[assignment]
        a_macro, micro, advantage = _original_advantages(conn, params, batch, episode_ids, groups, c.q_h_smoothed)
    totals.null_rewards += c.null_rewards
    totals.signal = measure(cols.episode, micro, advantage, params.omega, rho_raw=c.rho_raw, q_h=c.q_h)
    return [
        cols.step_id,
        cols.mean,
        cols.tokens,
        c.pi_hind,
        c.rho_raw,
        c.rho,
        c.r_t,
        c.discount,
        c.q_h,
        c.q_h_smoothed,
        _nullable(a_macro),
        _nullable(micro),
        _nullable(advantage),
    ]


def _nullable(x: np.ndarray) -> np.ndarray:
    """NaN → NULL: an object array (None where NaN) when there is a NaN, else the floats."""
    nan = np.isnan(x)
    if not nan.any():
        return x
    out = x.astype(object)
    out[nan] = None
    return out


def _original_advantages(
    conn: Connection,
    params: CreditParams,
    batch: EpisodeBatch,
    episode_ids: np.ndarray,
    groups: list[Any] | None,
    q: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eq. 8 exactly as the default export computes it (``hcapo_weights`` over the episodes with
    reward >= min_reward, in the export's order: by name, then id); NaN for the others."""
    n_steps = len(q)
    a_macro, micro, advantage = (np.full(n_steps, np.nan) for _ in range(3))
    names = dict(_names_of(conn, episode_ids.tolist()))
    lengths = batch.lengths
    order = sorted(
        (i for i in range(len(episode_ids)) if batch.episode_reward[i] >= params.min_reward),
        key=lambda i: (names[int(episode_ids[i])], int(episode_ids[i])),
    )
    if not order:
        return a_macro, micro, advantage
    spans = [(int(batch.starts[i]), int(batch.starts[i] + lengths[i])) for i in order]
    eq8 = hcapo_weights(
        batch.episode_reward[order],
        [q[a:b] for a, b in spans],
        params.omega,
        None if groups is None else [groups[i] for i in order],
    )
    for k, (a, b) in enumerate(spans):
        a_macro[a:b] = eq8.grpo[k]
        micro[a:b] = eq8.micro[k]
        advantage[a:b] = eq8.weights[k]
    return a_macro, micro, advantage


def _names_of(conn: Connection, ids: list[int]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for i in range(0, len(ids), 500):
        marks = ", ".join(str(int(x)) for x in ids[i : i + 500])  # integers from our own query
        out.extend(conn.execute(text(f"SELECT id, name FROM episodes WHERE id IN ({marks})")).all())
    return out


def _tag_groups(conn: Connection, episode_ids: np.ndarray, tag: str | None, totals: _Totals) -> list[Any] | None:
    """Each episode's value of ``tag`` (a tag, ``tag:KEY`` or ``field:NAME``; None: without a
    value, one group of their own), or None."""
    if tag is None:
        return None
    groups = fields.group_values(conn, episode_ids.tolist(), tag)
    untagged = groups.count(None)
    what = fields.kind(tag)
    if untagged == len(groups):
        raise CreditError(
            f"--group-by {tag}: no credited episode has this {what} ({fields.known_keys(conn, tag)}); "
            "tag the episodes at ingest (--tag KEY=VALUE) or pick another tag or field:NAME"
        )
    if untagged:
        totals.warnings.append(
            f"--group-by {tag}: {untagged} of {len(groups)} episode(s) lack this {what} and form one group of their own"
        )
    return groups


def _raw_stream(conn: Connection, sql: Any, bind: dict[str, Any]) -> Iterator[Sequence[tuple]]:
    """Blocks of plain DB-API tuples: no per-row SQLAlchemy objects for a million rows.

    PostgreSQL gets a named (server-side) cursor so memory stays flat; SQLite's cursor
    already steps through the result lazily.
    """
    compiled = sql.compile(dialect=conn.dialect)
    params = compiled.construct_params(bind)
    if compiled.positiontup is not None:
        params = tuple(params[k] for k in compiled.positiontup)
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    cur = dbapi.cursor(name="hcapo_credit_stream") if conn.dialect.name == "postgresql" else dbapi.cursor()
    try:
        cur.execute(compiled.string, params)
        while block := cur.fetchmany(FETCH_ROWS):
            yield block
    finally:
        cur.close()


def _episode_names(conn: Connection, ids: list[int]) -> list[str]:
    names: dict[int, str] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        marks = ", ".join(str(int(x)) for x in chunk)  # integers from our own query
        names.update(conn.execute(text(f"SELECT id, name FROM episodes WHERE id IN ({marks})")).all())
    return [names[i] for i in ids]


def _insert_sql(conn: Connection) -> str:
    """A driver-level INSERT (plain tuples are much cheaper than dicts for a million rows)."""
    style = conn.dialect.paramstyle
    marks = [
        "?" if style == "qmark" else f":{i + 1}" if style == "numeric" else "%s" for i in range(len(CREDIT_COLUMNS))
    ]
    return f"INSERT INTO credits ({', '.join(CREDIT_COLUMNS)}) VALUES ({', '.join(marks)})"


def _whole_episodes(partitions: Iterator[Sequence[Any]]) -> Iterator[list[Any]]:
    """Re-cut fetched row blocks so that no episode is split across two blocks."""
    carry: list[Any] = []
    for part in partitions:
        rows = carry + list(part)
        last = rows[-1][_EPISODE_ID]
        cut = len(rows) - 1
        while cut > 0 and rows[cut - 1][_EPISODE_ID] == last:
            cut -= 1
        carry = rows[cut:]
        if cut:
            yield rows[:cut]
    if carry:
        yield carry


def _batch_columns(rows: list[tuple], params: CreditParams, totals: _Totals) -> _Columns | None:
    """The columns of the complete episodes among ``rows`` (whole episodes, in step order)."""
    ep_col = np.fromiter((r[_EPISODE_ID] for r in rows), dtype=np.int64, count=len(rows))
    starts = _starts(ep_col)
    mean_all = np.asarray([r[_MEAN_LOGPROB] for r in rows], dtype=np.float64)  # NULL (no score) → NaN
    missing = np.add.reduceat(np.isnan(mean_all).astype(np.int64), starts) > 0
    if missing.any():
        ids = ep_col[starts[missing]].tolist()
        totals.incomplete_count += len(ids)
        room = MAX_LISTED_INCOMPLETE - len(totals.incomplete_ids)
        totals.incomplete_ids.extend(ids[: max(room, 0)])
        keep = np.repeat(~missing, np.diff(np.append(starts, len(rows))))
        rows = [r for r, k in zip(rows, keep.tolist()) if k]
        if not rows:
            return None
        ep_col = ep_col[keep]
        starts = _starts(ep_col)
        mean_all = mean_all[keep]
    columns = dict(zip(_STREAM_NAMES, zip(*rows)))
    reward, step_id, phase = columns["reward"], columns["step_id"], columns["phase"]
    subtask_id, subtask_reward = columns["subtask_id"], columns["subtask_reward"]
    token_count, blob = columns["token_count"], columns["blob"]
    mean = mean_all
    tokens = np.asarray(token_count, dtype=np.int64)
    if params.max_logprob_tokens:
        _reaggregate(mean, tokens, blob, params.max_logprob_tokens)
    totals.episodes += len(starts)
    totals.steps += len(rows)
    return _Columns(
        episode=ep_col,
        step_id=np.asarray(step_id, dtype=np.int64),
        mean=mean,
        tokens=tokens,
        subtask_reward=np.asarray(subtask_reward, dtype=np.float64),
        group=_group_codes(subtask_id, phase),
        reward=np.asarray(reward, dtype=np.float64),
    )


def _starts(ep_col: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.concatenate(([True], ep_col[1:] != ep_col[:-1])))


def _reaggregate(mean: np.ndarray, token_count: np.ndarray, blobs: Sequence[bytes | None], n: int) -> None:
    """In place: the mean of the last ``n`` stored token logprobs where more were scored.

    Only rows scored beyond ``n`` tokens carry a blob (see STREAM_SQL); their blobs are
    joined into one float32 array and each suffix is summed with one ``reduceat``.
    """
    rows = [i for i, b in enumerate(blobs) if b is not None]
    if rows:
        values = np.frombuffer(b"".join(blobs[i] for i in rows), dtype="<f4").astype(np.float64)  # type: ignore[misc]
        ends = np.cumsum([len(blobs[i]) // 4 for i in rows])  # type: ignore[arg-type]
        bounds = np.empty(2 * len(rows), dtype=np.int64)
        bounds[0::2], bounds[1::2] = ends - n, ends
        sums = np.add.reduceat(np.append(values, 0.0), bounds)[0::2]
        mean[rows] = sums / n
    np.minimum(token_count, n, out=token_count)


def _group_codes(subtask_ids: Sequence[str | None], phases: Sequence[str]) -> np.ndarray:
    """Integer codes of the group key ``subtask_id or phase`` (the original's ``or``)."""
    codes: dict[str, int] = {}
    return np.fromiter(
        (codes.setdefault(s or p, len(codes)) for s, p in zip(subtask_ids, phases)), dtype=np.int64, count=len(phases)
    )
