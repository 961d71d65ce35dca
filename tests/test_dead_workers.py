"""A run must not call the work done while other workers hold leases (issue 21).

Real `python -m hcapo_store score` processes on one SQLite file or PostgreSQL database, against the fault server
(the reference model in the test process) whose answers are held: a worker then holds
leases and nothing else moves. One is killed with SIGKILL and not reaped (a zombie: its pid
still answers signal 0); a new run must reclaim its steps at once and score them. A live
worker's leases are waited for, with a message naming it, until it finishes them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pg
import pytest
from _waiting import HANG_GUARD_S, wait_until
from faultserver import FaultServer
from sqlalchemy import text

from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

MAX_CONTEXT = 2048
LONG_LEASE = "3600"  # the dead worker's leases must not simply expire during the test


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[FaultServer]:
    ref = make_server(tiny_model_dir)  # not started: the fault server calls ref.generate in-process
    with FaultServer(ref) as proxy:
        yield proxy
    ref.httpd.server_close()


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 2, seed=5, steps_per_subtask=1, output_words=12)
    return root


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store's URL: a SQLite file, or a PostgreSQL database (skipped without one)."""
    if request.param == "sqlite":
        yield str(tmp_path / "x.db")
        return
    with pg.fresh_database() as url:
        yield url


def _cmd(db: str, server: FaultServer, tiny_model_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hcapo_store",
        "--db",
        db,
        "score",
        "--server",
        server.url,
        "--tokenizer",
        str(tiny_model_dir),
        "--max-context",
        str(MAX_CONTEXT),
        "--lease-seconds",
        LONG_LEASE,
    ]


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})


def _counts(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT status, COUNT(*) FROM attempts GROUP BY status")).all()
        steps = conn.execute(text("SELECT COUNT(*) FROM steps")).scalar_one()
    return {"steps": int(steps), **{str(s): int(n) for s, n in rows}}


def _leased_by(store: Store, pid: int) -> int:
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT COUNT(*) FROM attempts WHERE status = 'leased' AND lease_owner LIKE :o"), {"o": f"%:{pid}"}
            ).scalar_one()
        )


@pytest.fixture
def held(server: FaultServer) -> Iterator[threading.Event]:
    server.reset()
    server.hold_answers = threading.Event()  # requests arrive and wait: their workers hold leases
    yield server.hold_answers
    server.hold_answers.set()
    server.hold_answers = None


@pytest.mark.slow  # kills a score process (docs/DEVELOPMENT.md: the slow tier); the live-worker test stays fast
def test_a_killed_workers_leases_are_reclaimed_at_once(tmp_path, database, server, episodes_dir, tiny_model_dir, held):
    db = database
    store = Store.open(db)
    ingest(store, [episodes_dir])
    victim = _spawn(_cmd(db, server, tiny_model_dir), tmp_path / "victim.log")
    try:
        wait_until(
            lambda: server.requests > 0 and _leased_by(store, victim.pid) > 0,
            "the victim holds leases",
            procs={"victim": victim},
        )
        victim.send_signal(signal.SIGKILL)
        held_by_victim = _leased_by(store, victim.pid)
        # not reaped (no wait()): a zombie, as under a parent that has not waited yet
        held.set()
        r = subprocess.run(
            _cmd(db, server, tiny_model_dir),
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            env={**os.environ, "NO_COLOR": "1"},
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "nothing to score" not in r.stdout, r.stdout
        counts = _counts(store)
        assert counts.get("done") == counts["steps"] > 0 and held_by_victim > 0, (counts, r.stdout)
    finally:
        victim.kill()
        victim.wait()
        store.close()


def test_a_live_workers_leases_are_waited_for(tmp_path, database, server, episodes_dir, tiny_model_dir, held):
    db = database
    store = Store.open(db)
    ingest(store, [episodes_dir])
    first = _spawn(_cmd(db, server, tiny_model_dir), tmp_path / "first.log")
    second = None
    try:
        steps = _counts(store)["steps"]
        wait_until(
            lambda: _leased_by(store, first.pid) == steps, "the first worker holds every step", procs={"first": first}
        )
        second_log = tmp_path / "second.log"
        second = _spawn(_cmd(db, server, tiny_model_dir), second_log)
        waiting = f"waiting for {steps} step(s) leased by worker"
        wait_until(
            lambda: waiting in second_log.read_text() and f":{first.pid}" in second_log.read_text(),
            "the second run says whose leases it waits for",
            procs={"first": first, "second": second},
        )
        held.set()
        assert first.wait(timeout=HANG_GUARD_S) == 0, (tmp_path / "first.log").read_text()
        assert second.wait(timeout=HANG_GUARD_S) == 0, second_log.read_text()
        counts = _counts(store)
        assert counts.get("done") == counts["steps"] > 0, counts
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()
        store.close()
