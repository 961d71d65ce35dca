"""Outputs never destroy inputs; read-only means read-only; nothing stale or cut is silent.

Issue 8 §5 and the credits/export/table items of issue 9 §3, on real SQLite files (and a
real PostgreSQL server for the read-only ``sql`` cases).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_credits import add_scorer, add_scores

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.credits.lookup import get_run, list_runs
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import CreditError, ExportError, StoreError
from hcapo_store.formatting import table
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.export import export_dataset, export_hindsight_json
from hcapo_store.outputs.rows import PARQUET_METADATA_KEY
from hcapo_store.storage.store import Store


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def credited(store: Store, samples: Path) -> Store:
    ingest(store, [samples])
    add_scorer(store, "sc", spec={"max_logprob_tokens": 2048})
    add_scores(store, "sc", seed=5)
    compute_credits(store, CreditParams(), name="r")
    return store


def _one_line_failure(r) -> str:
    assert r.exit_code != 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


# ---- outputs never overwrite the database or another SQLite file ---------------------------


def _make_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()


@pytest.mark.parametrize("command", ["report", "dataset", "dataset-parquet", "hindsight"])
def test_outputs_refuse_the_database_and_any_sqlite_file(
    credited: Store, db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.html").symlink_to(db_path)
    _make_sqlite(tmp_path / "other.sqlite")
    before, other_before = _digest(db_path), _digest(tmp_path / "other.sqlite")
    for target in [str(db_path), "store.db", "./sub/../store.db", "link.html", str(db_path) + "-wal", "other.sqlite"]:
        args = {
            "report": ["report", target],
            "dataset": ["export", "dataset", target],
            "dataset-parquet": ["export", "dataset", target, "--format", "parquet"],
            "hindsight": ["export", "hindsight-json", target],
        }[command]
        r = CliRunner().invoke(cli, ["--db", str(db_path), *args])
        if command == "hindsight" and r.exit_code == 2:  # click itself refuses a file as OUT_DIR
            assert "is a file" in r.output, r.output
        else:
            line = _one_line_failure(r)
            assert "refusing" in line or "not a directory" in line, line
        assert _digest(db_path) == before and _digest(tmp_path / "other.sqlite") == other_before
    assert Store.open(str(db_path), create=False).query("SELECT COUNT(*) FROM credits")[1][0][0] > 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_summary_path_may_not_hit_the_database(credited: Store, tmp_path: Path) -> None:
    """``x.jsonl`` writes ``x.jsonl.summary.json``: that path is checked before anything is written."""
    _make_sqlite(tmp_path / "x.jsonl.summary.json")
    with pytest.raises(ExportError, match="SQLite database"):
        export_dataset(credited, tmp_path / "x.jsonl", "r")
    assert not (tmp_path / "x.jsonl").exists()


# ---- modes, summaries, provenance --------------------------------------------------------------


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_get_the_umask_mode(credited: Store, tmp_path: Path, umask: int, mode: int) -> None:
    from hcapo_store.outputs.report import write_report

    old = os.umask(umask)
    try:
        export_dataset(credited, tmp_path / "d.jsonl", "r")
        export_dataset(credited, tmp_path / "d.parquet", "r", fmt="parquet")
        export_hindsight_json(credited, tmp_path / "hs", "r")
        write_report(credited, tmp_path / "r.html", "r")
    finally:
        os.umask(old)
    files = [
        tmp_path / n for n in ("d.jsonl", "d.jsonl.summary.json", "d.parquet", "d.parquet.summary.json", "r.html")
    ] + list((tmp_path / "hs").rglob("*.json"))
    assert len(files) > 5
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == mode, f


def test_one_summary_per_output_and_parquet_provenance(credited: Store, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    export_dataset(credited, tmp_path / "train.jsonl", "r", omega=0.5)
    export_dataset(credited, tmp_path / "train.parquet", "r", fmt="parquet", omega=0.7)
    js = json.loads((tmp_path / "train.jsonl.summary.json").read_text())
    pa = json.loads((tmp_path / "train.parquet.summary.json").read_text())
    assert (js["config"]["format"], js["config"]["omega"]) == ("jsonl", 0.5)
    assert (pa["config"]["format"], pa["config"]["omega"]) == ("parquet", 0.7)
    run = get_run(credited, "r")
    meta = json.loads(pq.read_schema(tmp_path / "train.parquet").metadata[PARQUET_METADATA_KEY.encode()])
    assert meta["credit_run"] == "r" and meta["scorer_id"] == run.scorer_id == "sc"
    assert meta["run_hash"] == run.run_hash and meta["credit_params"] == run.params
    assert meta["config"]["omega"] == 0.7 and meta["hcapo_store_version"]
    assert pa["provenance"]["run_hash"] == run.run_hash
    # the rows still load with the metadata attached
    assert pq.read_table(tmp_path / "train.parquet").num_rows == pa["episodes_in_dataset"] > 0


# ---- read-only sql on SQLite ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sql, denied",
    [
        ("ATTACH '{tmp}/new.db' AS x", "ATTACH"),
        ("VACUUM INTO '{tmp}/copy.db'", None),  # VACUUM INTO attaches its target: refused either way
        ("PRAGMA user_version = 7", "PRAGMA user_version"),
        ("PRAGMA journal_mode = DELETE", "PRAGMA journal_mode"),
        ("DELETE FROM steps", "DELETE"),
        ("CREATE TEMP TABLE t AS SELECT 1", None),
        ("SELECT load_extension('x')", "load_extension"),
    ],
)
def test_sql_read_only_on_sqlite_uses_the_authorizer(
    credited: Store, db_path: Path, tmp_path: Path, sql: str, denied: str | None
) -> None:
    out = tmp_path / "made"
    out.mkdir()
    before = _digest(db_path)
    r = CliRunner().invoke(cli, ["--db", str(db_path), "sql", sql.format(tmp=out)])
    line = _one_line_failure(r)
    if denied:
        assert line.startswith("Error: read-only: ") and denied in line and "--write" in line, line
    assert list(out.iterdir()) == []  # no file created anywhere
    assert _digest(db_path) == before
    with credited.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA user_version").scalar() == 0
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_sql_read_only_still_reads_and_introspects(credited: Store, db_path: Path) -> None:
    for sql in [
        "PRAGMA table_info(steps)",
        "SELECT * FROM pragma_table_info('steps')",
        "PRAGMA user_version",
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) SELECT * FROM n",
    ]:
        r = CliRunner().invoke(cli, ["--db", str(db_path), "sql", sql, "--format", "json"])
        assert r.exit_code == 0, (sql, r.output)
        assert json.loads(r.output)
    # the pooled connection is writable again afterwards
    r = CliRunner().invoke(cli, ["--db", str(db_path), "sql", "--write", "DELETE FROM tags"])
    assert r.exit_code == 0, r.output


# ---- read-only sql on PostgreSQL -----------------------------------------------------------------


@pytest.fixture
def pg_store():
    from pg import fresh_database

    with fresh_database("ro") as url:
        store = Store.open(url)
        try:
            yield store
        finally:
            store.close()


def _pg(store: Store, sql: str):
    import psycopg
    from pg import _libpq

    with psycopg.connect(_libpq(store.url.replace("+psycopg", "")), autocommit=True) as conn:
        return conn.execute(sql).fetchall()


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT lo_from_bytea(0, 'x'::bytea)",
        "SELECT lo_import('/etc/hostname')",
        "SELECT lo_unlink({lo})",
        'SELECT "lo_unlink" ({lo})',
        "SELECT pg_catalog.lo_unlink/**/({lo})",
        "SELECT pg_terminate_backend({pid})",
        "SELECT pg_cancel_backend({pid})",
        "SELECT pg_reload_conf()",
        "SELECT set_config('statement_timeout', '1', false)",
        "SELECT pg_advisory_lock(1)",
        "SELECT query_to_xml('select lo_' || 'unlink({lo})', true, true, '')",
        "DO $$ BEGIN PERFORM pg_terminate_backend({pid}); END $$",
        'SELECT U&"lo\\005Funlink"({lo})',
    ],
)
def test_sql_read_only_on_postgres_has_no_side_effects(pg_store: Store, sql: str) -> None:
    import psycopg
    from pg import _libpq

    lo = _pg(pg_store, "SELECT lo_from_bytea(0, 'keep'::bytea)")[0][0]
    with psycopg.connect(_libpq(pg_store.url.replace("+psycopg", "")), autocommit=True) as worker:
        pid = worker.info.backend_pid
        los = _pg(pg_store, "SELECT oid FROM pg_largeobject_metadata ORDER BY oid")
        r = CliRunner().invoke(cli, ["--db", pg_store.url, "sql", sql.format(lo=lo, pid=pid)])
        line = _one_line_failure(r)
        assert line.startswith("Error: read-only: ") and "--write" in line, line
        assert worker.execute("SELECT 1").fetchone() == (1,)  # the other session lives
        assert _pg(pg_store, "SELECT oid FROM pg_largeobject_metadata ORDER BY oid") == los
        # this store's database only: pg_locks is the whole server's, where other tests' stores
        # (another xdist worker's) take advisory locks of their own
        mine = "SELECT oid FROM pg_database WHERE datname = current_database()"
        assert _pg(pg_store, f"SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = ({mine})") == [
            (0,)
        ]


def test_postgres_read_only_work_is_rolled_back_even_past_the_check(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second layer alone: with the function check disabled, a large object made in the
    READ ONLY transaction is gone afterwards (the transaction is rolled back, never committed)."""
    import re

    from hcapo_store.storage import readonly

    monkeypatch.setattr(readonly, "_SIDE_EFFECTS", re.compile(r"(?!x)x"))
    monkeypatch.setattr(readonly, "pg_check_volatile", lambda conn, sql: None)
    before = _pg(pg_store, "SELECT count(*) FROM pg_largeobject_metadata")
    cols, rows = pg_store.query("SELECT lo_from_bytea(0, 'x'::bytea) AS oid")
    assert rows[0][0] > 0
    assert _pg(pg_store, "SELECT count(*) FROM pg_largeobject_metadata") == before
    with pytest.raises(StoreError, match="read-only"):
        pg_store.query("DELETE FROM steps")


# ---- a missing database is never created by a read-only command --------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["sql", "SELECT 1"],
        ["credits", "list"],
        ["credits", "show"],
        ["credits", "diff", "a", "b"],
        ["scorers", "list"],
        ["report", "{out}/r.html"],
        ["export", "dataset", "{out}/d.jsonl"],
        ["export", "hindsight-json", "{out}/hs"],
    ],
)
def test_read_only_commands_never_create_a_database(tmp_path: Path, args: list[str]) -> None:
    missing = tmp_path / "typo" / "hcapo.db"
    r = CliRunner().invoke(cli, ["--db", str(missing), *[a.format(out=tmp_path) for a in args]])
    line = _one_line_failure(r)
    assert f"no database at {missing}" in line and "init" in line, line
    assert list(tmp_path.iterdir()) == []


# ---- staleness -----------------------------------------------------------------------------------


def test_run_computed_before_scoring_finished_is_stale(store: Store, tmp_path: Path, db_path: Path) -> None:
    write_standard_episodes(tmp_path / "eps", 3)
    ingest(store, [tmp_path / "eps"])
    add_scorer(store, "sc")
    steps = store.query("SELECT e.name, s.step_index FROM steps s JOIN episodes e ON e.id = s.episode_id")[1]
    first = min(name for name, _ in steps)
    add_scores(store, "sc", skip={tuple(r) for r in steps if r[0] != first})  # one episode scored so far
    compute_credits(store, CreditParams(), name="early")
    assert get_run(store, "early").stale is None
    add_scores(store, "sc", seed=1, skip={tuple(r) for r in steps if r[0] == first})  # the rest finish later
    run = get_run(store, "early")
    assert run.uncredited_complete_episodes == 2 and "is stale" in run.stale
    runner = CliRunner()
    r = runner.invoke(cli, ["--db", str(db_path), "credits", "list"])
    assert r.exit_code == 0 and "STALE" in r.output and "--recompute" in r.output, r.output
    r = runner.invoke(cli, ["--db", str(db_path), "credits", "show", "early", "--json"])
    assert "2 completely scored episode(s) are not in it" in json.loads(r.output)["stale"]
    r = runner.invoke(cli, ["--db", str(db_path), "export", "dataset", str(tmp_path / "d.jsonl"), "--min-reward", "-1"])
    assert r.exit_code == 0 and "is stale" in r.output, r.output
    r = runner.invoke(cli, ["--db", str(db_path), "export", "hindsight-json", str(tmp_path / "hs")])
    assert r.exit_code == 0 and "is stale" in r.output, r.output
    r = runner.invoke(cli, ["--db", str(db_path), "report", str(tmp_path / "r.html")])
    assert r.exit_code == 0 and "warning:" in r.output and "is stale" in r.output, r.output
    assert "is stale" in (tmp_path / "r.html").read_text()
    # computing again with the same parameters warns instead of returning it as fresh
    result = compute_credits(store, CreditParams(), name="early")
    assert not result.created and "is stale" in result.message
    compute_credits(store, CreditParams(), name="early", replace=True)
    assert get_run(store, "early").stale is None and all(r.stale is None for r in list_runs(store))


def test_new_episode_version_makes_the_run_stale(store: Store, tmp_path: Path, db_path: Path) -> None:
    write_standard_episodes(tmp_path / "eps", 3)
    ingest(store, [tmp_path / "eps"])
    add_scorer(store, "sc")
    add_scores(store, "sc")
    compute_credits(store, CreditParams(), name="r")
    result = tmp_path / "eps" / "episode_001" / "result.json"  # a corrected reward: a new version
    result.write_text(json.dumps({**json.loads(result.read_text()), "episode_reward": 0.99}))
    assert ingest(store, [tmp_path / "eps"]).changed == 1
    run = get_run(store, "r")
    assert run.superseded_episodes == 1 and "1 credited episode(s) have a newer version" in run.stale
    assert run.unscored_new_versions == 1
    assert "score the 1 new version(s) first (`hcapo-store score` with the options of scorer" in run.stale
    assert run.stale.endswith("then run `hcapo-store credits compute --recompute` with its parameters")
    summary = export_dataset(store, tmp_path / "d.jsonl", "r", min_reward=-1)
    assert any("is stale" in w and "new version(s) first" in w for w in summary.warnings)
    with store.engine.connect() as conn:
        scored = conn.exec_driver_sql(
            "SELECT e.name, s.step_index FROM steps s JOIN episodes e ON e.id = s.episode_id "
            "WHERE e.is_current AND e.version = 1"
        ).all()
    add_scores(store, "sc", seed=2, skip={tuple(r) for r in scored})  # the new version: only recompute is left
    run = get_run(store, "r")
    assert run.unscored_new_versions == 0 and "first" not in run.stale and "--recompute" in run.stale


def test_group_by_a_missing_tag_warns(credited: Store, db_path: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(
        cli,
        [
            "--db",
            str(db_path),
            "export",
            "dataset",
            str(tmp_path / "d.jsonl"),
            "--min-reward",
            "-1",
            "--group-by",
            "nosuchtag",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "warning: --group-by nosuchtag: no exported episode has this tag" in r.output


# ---- tables, parameters, null rewards ------------------------------------------------------------


def test_tables_mark_cut_cells_and_say_how_to_see_them() -> None:
    long = "x" * 70
    text = table(["id", "n"], [(long, 1), ("short", 2)], max_width=60, full="--format json", width=None)
    assert "x" * 59 + "…" in text and long not in text
    assert text.splitlines()[-1].startswith("(long cells are cut") and "--format json" in text
    assert "…" not in table(["id"], [("short",)]) and "cut" not in table(["id"], [(long,)], max_width=None, width=None)


LABELS = [
    "sglang:/models/Qwen3-8B tok=qwen3@2a056a25 ctx=32767 lp=2048 layout=per-step",
    "sglang:/models/Qwen3-8B tok=qwen3@2a056a25 ctx=8192 lp=2048 layout=per-step",
    "sglang:/models/Qwen3-8B tok=qwen3@2a056a25 ctx=32767 lp=2048 layout=per-step no-hindsight",
]


@pytest.mark.parametrize("width", [200, 100, 80, 60, 40])
def test_tables_fit_the_terminal_and_keep_what_tells_labels_apart(width: int) -> None:
    ids = ("5f0e0c1a9b2d", "a41c93e07f55", "c0ffee123456")
    rows = [(ids[i], label, 10 * i, "2026-11-25T10:00:00+00:00") for i, label in enumerate(LABELS)]
    text = table(["scorer", "label", "scored", "created"], rows, max_width=None, width=width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines[:-1] if not line.startswith("(")), text
    shown = [line.split("  ")[1].strip() for line in lines[2 : 2 + len(LABELS)]]
    if width >= 60:
        assert len(set(shown)) == len(LABELS), text  # no two labels look alike after the cut
    assert len({line[:8] for line in lines[2 : 2 + len(LABELS)]}) == len(LABELS)  # the ids stay apart
    if width >= 80:  # the words that differ are all kept
        assert [("32767" in s, "8192" in s, "no-hindsight" in s) for s in shown] == [
            (True, False, False),
            (False, True, False),
            (True, False, True),
        ], text
    if width < 200:
        assert "…" in text and lines[-1].startswith("(long cells are cut")
    # piped (no terminal): whole values
    assert all(label in table(["label"], [(lb,) for lb in LABELS], max_width=None, width=None) for label in LABELS)


def test_credits_list_shows_every_parameter(credited: Store, db_path: Path) -> None:
    compute_credits(credited, CreditParams(t_temp=3.0, max_logprob_tokens=7), name="a-rather-long-run-name")
    r = CliRunner().invoke(cli, ["--db", str(db_path), "credits", "list"])
    assert r.exit_code == 0, r.output
    assert "t_temp=3" in r.output and "max_logprob_tokens=7" in r.output and "…" not in r.output


def test_sql_marks_a_cut_value(credited: Store, db_path: Path) -> None:
    long_id = "f" * 64
    add_scorer(credited, long_id)
    r = CliRunner().invoke(cli, ["--db", str(db_path), "sql", "SELECT id FROM scorers WHERE id LIKE 'fff%'"])
    assert r.exit_code == 0 and long_id not in r.output and "f" * 59 + "…" in r.output, r.output
    assert "--format json" in r.output


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--gamma", "nan"),
        ("--gamma", "inf"),
        ("--gamma", "-1"),
        ("--gamma", "1.5"),
        ("--t-temp", "0"),
        ("--t-temp", "nan"),
        ("--alpha", "2"),
        ("--c-max", "inf"),
        ("--c-min", "-0.5"),
        ("--c-min", "nan"),
    ],
)
def test_credit_parameters_out_of_range_are_refused_in_one_line(
    credited: Store, db_path: Path, flag: str, value: str
) -> None:
    r = CliRunner().invoke(cli, ["--db", str(db_path), "credits", "compute", flag, value])
    if value in ("nan", "inf"):  # the option itself refuses a non-finite number, in one line
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.output.strip().splitlines()[-1] == (
            f"Error: Invalid value for '{flag}': {value!r} is not a finite number: give a number"
        )
    else:
        line = _one_line_failure(r)
        assert f"({flag})" in line and "must be" in line and value in line, line
    name = flag[2:].replace("-", "_")
    with pytest.raises(CreditError, match=name):  # the library refuses too
        CreditParams(**{name: float(value)})
    with pytest.raises(ValueError):
        CreditParams(**{name: float(value)})


def test_null_rewards_give_a_null_range(store: Store, tmp_path: Path) -> None:
    eps = tmp_path / "eps.jsonl"
    msgs = [
        {"role": "user", "content": "do it"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "done"},
    ]
    eps.write_text(json.dumps({"episode_id": 1, "messages": msgs, "reward": 0.5, "plan_score": None}) + "\n")
    assert ingest(store, [eps]).new == 1
    add_scorer(store, "sc")
    add_scores(store, "sc")
    compute_credits(store, CreditParams(), name="r")
    export_hindsight_json(store, tmp_path / "hs", "r")
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "hs").rglob("hindsight_scores.json")]
    assert [s["subtask_reward"] for s in doc["steps"]] == [None, None]
    assert doc["subtask_reward_range"] is None


def test_postgres_select_only_role_cannot_make_large_objects_through_sql(pg_store: Store) -> None:
    """The issue's reproduction: a role with only SELECT grants could still create large objects."""
    import uuid

    import psycopg
    from pg import _libpq
    from sqlalchemy.engine import make_url

    admin = _libpq(pg_store.url.replace("+psycopg", ""))
    role = f"hcapo_ro_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        url = make_url(admin).set(username=role, password="pw").render_as_string(hide_password=False)
        before = _pg(pg_store, "SELECT count(*) FROM pg_largeobject_metadata")
        r = CliRunner().invoke(cli, ["--db", url, "sql", "SELECT lo_from_bytea(0, 'x'::bytea)"])
        assert "read-only" in _one_line_failure(r) and "pw" not in r.output
        assert _pg(pg_store, "SELECT count(*) FROM pg_largeobject_metadata") == before
        r = CliRunner().invoke(cli, ["--db", url, "sql", "SELECT count(*) AS n FROM steps", "--format", "json"])
        assert r.exit_code == 0 and json.loads(r.output) == [{"n": 0}], r.output
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
