"""`sql` cannot run for ever nor act on the server (issue 21): a time limit and Ctrl-C stop
a statement on both engines, and ts_rewrite (which runs SQL given as text) is refused.

Real stores made by the migrations (a SQLite file; a fresh PostgreSQL database, skipped
without HCAPO_TEST_PG_URL), the real CLI in-process, and real `python -m hcapo_store sql`
processes sent a real SIGINT once their statement is seen running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pg
import pytest
from _waiting import HANG_GUARD_S, wait_until
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.storage.store import Store

RUNAWAY = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"
ENGINES = ["sqlite", "postgresql"]


@pytest.fixture(params=ENGINES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = str(tmp_path / "x.db")
        Store.open(url).close()
        yield url
        return
    with pg.fresh_database() as url:
        Store.open(url).close()
        yield url


@pytest.mark.parametrize("query", [RUNAWAY, "SELECT pg_sleep(3600)"])
def test_a_statement_is_stopped_by_its_timeout(runner, store_url, query):
    if "pg_sleep" in query and not store_url.startswith("postgresql"):
        pytest.skip("pg_sleep is PostgreSQL's")
    r = runner.invoke(cli, ["--db", store_url, "sql", "--timeout", "1", query])
    assert r.exit_code == 1, r.output
    (line,) = r.output.strip().splitlines()
    assert "ran longer than 1 s and was stopped" in line and "--timeout" in line, line
    r = runner.invoke(cli, ["--db", store_url, "sql", "SELECT 41 + 1 AS answer"])  # the store still answers
    assert r.exit_code == 0 and "42" in r.output, r.output


def _sqlite_lock_held(pid: int) -> bool:
    """The process holds a lock on the database: its read transaction is open."""
    return any(line.split()[4] == str(pid) for line in Path("/proc/locks").read_text().splitlines())


def _pg_running(store: Store, pid: int) -> bool:
    with store.engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE 'WITH RECURSIVE r(n)%'"
                )
            ).scalar_one()
        )


def test_ctrl_c_stops_a_runaway_query(tmp_path, store_url):
    if store_url.startswith("postgresql"):
        store = Store.open(store_url)
        running = lambda pid: _pg_running(store, pid)  # noqa: E731
    else:
        if not Path("/proc/locks").exists():
            pytest.skip("needs /proc/locks to see the statement running")
        store = None
        running = _sqlite_lock_held
    proc = subprocess.Popen(
        [sys.executable, "-m", "hcapo_store", "--db", store_url, "sql", "--timeout", "0", RUNAWAY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    try:
        wait_until(lambda: running(proc.pid), "the runaway statement runs", procs={"sql": proc})
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 130, (proc.returncode, out, err)
        assert "Traceback" not in err, err
        if store is not None:  # the server's query was cancelled too, not left running
            wait_until(lambda: not _pg_running(store, proc.pid), "the server's query ends")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if store is not None:
            store.close()


@pytest.mark.parametrize(
    "query",
    [
        "SELECT ts_rewrite('a'::tsquery, 'SELECT pg_terminate_backend(' || {victim} || ')')",
        "SELECT ts_rewrite('a'::tsquery, 'SELECT ' || chr(112) || 'g_terminate_backend(' || {victim} || ')')",
        "SELECT ts_rewrite('a'::tsquery, 'SELECT ' || chr(112) || 'g_read_file(''/etc/hostname'')::tsquery, ''b''::tsquery')",
    ],
)
def test_ts_rewrite_cannot_act_on_the_server(runner, query):
    with pg.fresh_database() as url:
        Store.open(url).close()
        with Store.open(url) as victim_store, victim_store.engine.connect() as victim:
            victim_pid = victim.execute(text("SELECT pg_backend_pid()")).scalar_one()
            r = runner.invoke(cli, ["--db", url, "sql", query.format(victim=victim_pid)])
            assert r.exit_code == 1, r.output
            (line,) = r.output.strip().splitlines()
            assert "ts_rewrite()" in line and "read-only" in line, line
            assert victim.execute(text("SELECT 1")).scalar_one() == 1  # still connected
