"""Issue 34 item 2: a one-new-episode `follow` cycle costs its new work, not the store's size.

The cycle's scoring run is filtered to the new episode: its queue statements must reach rows
through that episode's id (SQLite's EXPLAIN QUERY PLAN: SEARCH by an identifying column, never
a SCAN of a store-sized table nor a walk of all of the scorer's rows), and the filtered queue
must give what the plain rule over every row gives. Real SQLite files through the real
migrations, a real reference server, the real follower."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pg
import pytest
from _queue_results import done_result
from alembic import command
from sqlalchemy import event, inspect, text

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.online.follow import FollowConfig, Follower
from hcapo_store.scoring import work_queue
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.scoring.scorer import register
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

# Tables that grow with the store; a plan may SCAN only the others (a few rows each:
# scorers, workers; a worker row is per process, not per episode).
STORE_SIZED = {"episodes", "steps", "messages", "subtasks", "tags", "attempts", "scores", "credits", "batch_episodes"}
# Columns that name a row or an episode: an index search starting with one of them reads that
# row's few entries. One starting with scorer_id, status or is_current reads the scorer's
# whole queue (or the store's current episodes).
IDENTIFYING = {
    "rowid",
    "id",
    "episode_id",
    "step_id",
    "name",
    "source_key",
    "lease_owner",
    "attempt_id",
    "run_id",
    "batch_id",
    "key",
    "batch_hash",
    "run_hash",
}
ACCESS = re.compile(r"^(SCAN|SEARCH) (\w+)")
FIRST_COLUMN = re.compile(r"\((\w+)[=<>]")  # "(episode_id=? AND scorer_id=?)": episode_id


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _tables(store: Store) -> set[str]:
    with store.engine.connect() as conn:
        return set(inspect(conn).get_table_names())


def _plan_problems(statement: str, plan: list[str], tables: set[str]) -> list[str]:
    """What in one statement's plan reads more than the rows it names."""
    words = set(re.findall(r"\w+", statement))
    insert = statement.lstrip().upper().startswith("INSERT")
    out = []
    for line in plan:
        m = ACCESS.match(line)
        if m is None:
            continue
        kind, obj = m.groups()
        c = FIRST_COLUMN.search(line)
        first_column = c.group(1) if c else None
        if insert and obj not in words:
            continue  # a foreign-key check SQLite runs only when a violation is pending, not the statement's own read
        if obj in ("CONSTANT", "SUBQUERY"):
            continue
        table = obj if obj in tables else _table_of_alias(statement, obj, tables)
        assert table in tables, f"cannot tell which table {obj!r} is in {statement!r}"
        if table not in STORE_SIZED:
            continue
        if kind == "SCAN" or first_column not in IDENTIFYING:
            out.append(line)
    return out


def _table_of_alias(statement: str, alias: str, tables: set[str]) -> str:
    """The table a plan's alias stands for: ``FROM attempts a``, ``JOIN episodes AS e``."""
    for m in re.finditer(rf"\b(\w+)\s+(?:AS\s+)?{re.escape(alias)}\b(?!\.)", statement):
        if m.group(1) in tables:
            return m.group(1)
    return alias


class Plans:
    """Every data statement the engine sends, with SQLite's query plan for it (its own
    parameters, on its own connection, before it runs)."""

    def __init__(self, store: Store) -> None:
        self.seen: list[tuple[str, list[str]]] = []
        self.tables = _tables(store)
        event.listen(store.engine, "before_cursor_execute", self._explain)

    def _explain(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if not re.match(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\b", statement, re.I):
            return
        first = params[0] if many else params
        rows = cursor.connection.execute("EXPLAIN QUERY PLAN " + statement, first).fetchall()
        self.seen.append((statement, [r[3] for r in rows]))

    def problems(self) -> list[str]:
        out = []
        for statement, plan in self.seen:
            bad = _plan_problems(statement, plan, self.tables)
            if bad:
                out.append(f"{' '.join(statement.split())[:160]}\n    " + " | ".join(bad))
        return out


def _conv(prep: Any) -> dict[str, Any]:
    conv = prep.spec["conversion"]
    return {"include_thinking": conv["include_thinking"], "max_tool_result_chars": conv["max_tool_result_chars"]}


def test_a_one_new_episode_cycle_reads_rows_by_episode(tmp_path: Path, ref: ReferenceServer, tiny_model_dir: Path):
    with Store.open(str(tmp_path / "s.db")) as store:
        # The store's other episodes, queued by an earlier whole-store run and never scored.
        write_standard_episodes(tmp_path / "elsewhere", 6, seed=1, steps_per_subtask=1, output_words=5)
        ingest(store, [tmp_path / "elsewhere"])
        prep = prepare(store, ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048))
        register(store, prep.spec)
        queued_elsewhere = work_queue.enqueue(store, prep.scorer_id, **_conv(prep))
        assert queued_elsewhere > 0
        root = tmp_path / "rollouts"
        write_standard_episodes(root / "step_0000", 1, seed=5, steps_per_subtask=1, output_words=5)
        follower = Follower(store, prep, FollowConfig(paths=[root], group_size=1), RunOptions(concurrency=1))
        assert len(follower.cycle().published) == 1

        plans = Plans(store)
        (new,) = write_standard_episodes(root / "step_0001", 1, seed=6, steps_per_subtask=1, output_words=5)
        report = follower.cycle()
        assert [b.key for b in report.published] == ["rollouts/step_0001"]
        assert report.score is not None and report.score.scored > 0 and not report.score.failed
        assert len(plans.seen) > 20  # the listener saw the cycle's statements
        problems = plans.problems()
        assert not problems, "statements reading more than the new episode's rows:\n" + "\n".join(problems)

        # The followed episodes were scored; the others' queue rows are as they were.
        rows = store.query(
            "SELECT e.source_path, a.status, COUNT(*) FROM attempts a JOIN episodes e ON e.id = a.episode_id "
            "GROUP BY 1, 2",
            read_only=True,
        )[1]
        followed = {(Path(p).parent.name, status) for p, status, _ in rows if Path(p).is_relative_to(root)}
        assert followed == {("step_0000", "done"), (new.parent.name, "done")}
        elsewhere: dict[str, int] = {}
        for p, status, n in rows:
            if not Path(p).is_relative_to(root):
                elsewhere[status] = elsewhere.get(status, 0) + n
        assert elsewhere == {"pending": queued_elsewhere}


def _plan(store: Store, sql: str, params: dict[str, Any]) -> list[str]:
    with store.engine.connect() as conn:
        return [r[3] for r in conn.execute(text("EXPLAIN QUERY PLAN " + sql), params)]


def test_the_plan_check_catches_a_walk_of_the_scorers_queue(tmp_path: Path):
    """The rule above fails the statements it is there for: the episode filter through a join
    SQLite drives from ix_attempts_claim, a lease release without its index, a scores join."""
    with Store.open(str(tmp_path / "s.db")) as store:
        tables = _tables(store)
        params = {"s": "x", "n": "1", "i": 1, "now": 0.0}
        walk = (  # count_claimable before: the filter after a join SQLite drove from the scorer's queue
            "SELECT COUNT(*) FROM attempts a JOIN episodes e ON e.id = a.episode_id WHERE a.scorer_id = :s "
            "AND e.is_current AND (a.status = 'pending' OR (a.status = 'leased' AND a.lease_expires_at < :now)) "
            "AND (e.name IN (:n) OR e.source_key IN (:n) OR e.id IN (:i))"
        )
        assert _plan_problems(walk, _plan(store, walk, params), tables)
        scores = (  # follow's member counts before: every score of the scorer
            "SELECT e.id, (SELECT COUNT(*) FROM steps s JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = :s "
            "WHERE s.episode_id = e.id) AS scored FROM episodes e WHERE e.id IN (:i)"
        )
        assert _plan_problems(scores, _plan(store, scores, params), tables)
        scan = "SELECT id FROM attempts WHERE status = 'leased' AND updated_at > 0"
        assert _plan_problems(scan, _plan(store, scan, {}), tables)
        by_id = "SELECT COUNT(*) FROM attempts a WHERE a.episode_id = :i AND a.scorer_id = :s"
        assert not _plan_problems(by_id, _plan(store, by_id, {"s": "x", "i": 1}), tables)


# --- the filtered queue against the plain rule ----------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh store on SQLite, and on PostgreSQL when HCAPO_TEST_PG_URL is set (else skipped)."""
    if request.param == "sqlite":
        with Store.open(str(tmp_path / "q.db")) as store:
            yield store
    else:
        with pg.fresh_database("cycle") as url, Store.open(url) as store:
            yield store


def _queued_store(store: Store, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    eps = write_standard_episodes(tmp_path / "eps", 5, seed=40, steps_per_subtask=1, output_words=5)
    ingest(store, [tmp_path / "eps"])
    result = eps[4] / "result.json"  # a corrected reward: episode_005 gets a second version
    result.write_text(json.dumps({**json.loads(result.read_text()), "episode_reward": 0.99}))
    ingest(store, [tmp_path / "eps"])
    scorer = register(store, {"backend": {"kind": "test"}, "max_context": 1, "max_logprob_tokens": 1})
    return scorer, {"include_thinking": True, "max_tool_result_chars": 4000}


def _episodes(store: Store) -> list[dict[str, Any]]:
    cols, rows = store.query(
        "SELECT id, name, source_key, is_current, reward FROM episodes ORDER BY id", read_only=True
    )
    return [dict(zip(cols, r)) for r in rows]


def _selected(filters: work_queue.Filters, e: dict[str, Any]) -> bool:
    """The plain rule of a filter: an exact name, key or id, and the reward floor; current only."""
    named = not filters.episodes or any(f in (e["name"], e["source_key"], str(e["id"])) for f in filters.episodes)
    rewarded = filters.min_reward is None or e["reward"] >= filters.min_reward
    return bool(e["is_current"]) and named and rewarded


def _attempts(store: Store) -> list[dict[str, Any]]:
    cols, rows = store.query("SELECT * FROM attempts ORDER BY id", read_only=True)
    return [dict(zip(cols, r)) for r in rows]


def test_a_filtered_enqueue_queues_its_episodes_and_a_later_run_the_rest(any_store: Store, tmp_path: Path):
    store = any_store
    scorer, conv = _queued_store(store, tmp_path)
    eps = _episodes(store)
    first, second = eps[0], eps[1]
    old_version = next(e for e in eps if not e["is_current"])
    filters = work_queue.Filters(episodes=(first["name"], str(second["id"]), str(old_version["id"])))
    added = work_queue.enqueue(store, scorer, **conv, filters=filters)
    wanted = {e["id"] for e in eps if _selected(filters, e)}
    assert wanted == {first["id"], second["id"]}  # the old version is not current: not queued
    steps = store.query("SELECT id, episode_id FROM steps", read_only=True)[1]
    assert sorted(a["step_id"] for a in _attempts(store)) == sorted(s for s, e in steps if e in wanted)
    assert added == len(_attempts(store))
    assert work_queue.enqueue(store, scorer, **conv, filters=filters) == 0
    # Another conversion's run queues nothing; an unfiltered run queues every current episode's rest.
    assert work_queue.enqueue(store, scorer, include_thinking=False, max_tool_result_chars=4000) == 0
    rest = work_queue.enqueue(store, scorer, **conv)
    current = {e["id"] for e in eps if e["is_current"]}
    assert sorted(a["step_id"] for a in _attempts(store)) == sorted(s for s, e in steps if e in current)
    assert added + rest == len(_attempts(store))


def test_filtered_queue_reads_give_the_plain_rule(any_store: Store, tmp_path: Path):
    """Claimable counts, claims, others' leases and requeued failures of a filter, through the
    episodes-first statements, equal the plain rule over every row of the queue."""
    store = any_store
    scorer, conv = _queued_store(store, tmp_path)
    work_queue.enqueue(store, scorer, **conv)
    eps = _episodes(store)
    current = [e for e in eps if e["is_current"]]
    every = work_queue.Filters()
    # Mixed states, by the queue's own functions: episode 1 scored, episode 2 failed for good,
    # episode 3 leased by another worker (live), episode 4 leased with an expired lease.
    one = work_queue.claim(store, scorer, "w:1", lease_seconds=60, filters=every)
    assert one is not None
    with db.write(store.engine) as conn:
        work_queue.write_results(conn, scorer, "w:1", [done_result(lease) for lease in one.leases[:-1]])
    two = work_queue.claim(store, scorer, "w:1", lease_seconds=60, filters=every)
    assert two is not None
    failures = [
        work_queue.StepResult(lease.attempt_id, lease.step_id, error_kind="http", error="500", final=True)
        for lease in two.leases
    ]
    with db.write(store.engine) as conn:
        work_queue.write_results(conn, scorer, "w:1", failures)
    assert work_queue.claim(store, scorer, "other:2", lease_seconds=3600, filters=every) is not None
    assert work_queue.claim(store, scorer, "gone:3", lease_seconds=-60, filters=every) is not None
    work_queue.finish_worker(store, "w:1", "stopped")  # gives back episode 1's last step

    attempts = _attempts(store)
    by_id = {e["id"]: e for e in eps}
    filters_list = [
        work_queue.Filters(episodes=(current[0]["name"],)),
        work_queue.Filters(episodes=(str(current[1]["id"]), current[2]["source_key"])),
        work_queue.Filters(episodes=tuple(str(e["id"]) for e in current[2:]), min_reward=0.5),
        work_queue.Filters(episodes=tuple(e["name"] for e in eps)),
        work_queue.Filters(episodes=("no such episode",)),
    ]
    for filters in filters_list:
        mine = [a for a in attempts if a["scorer_id"] == scorer and _selected(filters, by_id[a["episode_id"]])]
        with db.read(store.engine) as conn:
            now = db.sql_now(conn)
        claimable = [
            a for a in mine if a["status"] == "pending" or (a["status"] == "leased" and a["lease_expires_at"] < now)
        ]
        assert work_queue.count_claimable(store, scorer, filters) == len(claimable), filters
        others: dict[str, int] = {}
        for a in mine:
            if a["status"] == "leased" and a["lease_expires_at"] >= now and a["lease_owner"] != "me:9":
                others[a["lease_owner"]] = others.get(a["lease_owner"], 0) + 1
        got = work_queue.leases_of_others(store, scorer, "me:9", filters)
        assert {o.owner: o.steps for o in got} == others, filters
        unscored = sorted((a["episode_id"], a["step_index"]) for a in mine if a["status"] not in ("done", "failed"))
        assert work_queue.unscored_steps(store, scorer, **conv, filters=filters) == unscored, filters
        assert work_queue.unscored_steps(store, scorer, **conv, filters=filters, limit=1) == unscored[:1]
    # Claims in the plain rule's order: the lowest episode with a claimable row, all its claimable rows.
    filters = work_queue.Filters(episodes=tuple(e["name"] for e in eps))
    with db.read(store.engine) as conn:
        now = db.sql_now(conn)
    claimable = sorted(
        (a["episode_id"], a["step_index"], a["id"])
        for a in attempts
        if a["status"] == "pending" or (a["status"] == "leased" and a["lease_expires_at"] < now)
    )
    assert claimable
    got = work_queue.claim(store, scorer, "me:9", lease_seconds=60, filters=filters)
    assert got is not None and got.episode_id == claimable[0][0]
    assert [lease.attempt_id for lease in got.leases] == [i for e, _, i in claimable if e == got.episode_id]
    # Requeued failures: exactly the filter's failed rows.
    failed = {a["id"] for a in attempts if a["status"] == "failed"}
    assert failed
    assert work_queue.requeue_failed(store, scorer, work_queue.Filters(episodes=("no such episode",))) == 0
    assert work_queue.requeue_failed(store, scorer, filters) == len(failed)
    assert {a["id"] for a in _attempts(store) if a["status"] == "pending"} >= failed


def test_migration_0007_downgrades_and_upgrades(tmp_path: Path):
    engine = db.make_engine(db.resolve_url(tmp_path / "m.db"))
    try:
        db.upgrade(engine)

        def indexes() -> set[str]:
            with engine.connect() as conn:
                return {i["name"] for i in inspect(conn).get_indexes("attempts")}

        assert {"ix_attempts_episode", "ix_attempts_lease_owner"} <= indexes()
        with engine.begin() as conn:
            command.downgrade(db.alembic_config(conn), "0006")
        assert not {"ix_attempts_episode", "ix_attempts_lease_owner"} & indexes()
        db.upgrade(engine)
        assert {"ix_attempts_episode", "ix_attempts_lease_owner"} <= indexes()
        assert db.current_revision(engine) == db.head_revision()
    finally:
        engine.dispose()
