"""A run must not call the work done while other workers hold leases (issue 21).

Workers on one SQLite file or PostgreSQL database, against the fault server (the reference
model in the test process) whose answers are held: a worker then holds leases and nothing
else moves. A real `python -m hcapo_store score` process is killed with SIGKILL and not
reaped (a zombie: its pid still answers signal 0); a new run (the CLI in this process) must
reclaim its steps at once and score them. A live worker's leases (a run in a thread of the
test process, which is alive: its pid answers) are waited for by a `score` process, with a
message naming it, until it finishes them. Only the process whose pid matters is a process:
each costs the imports of torch and transformers.
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
from click.testing import CliRunner
from faultserver import FaultServer
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
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


def _args(db: str, server: FaultServer, tiny_model_dir: Path) -> list[str]:
    return [
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


def _cmd(db: str, server: FaultServer, tiny_model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "hcapo_store", *_args(db, server, tiny_model_dir)]


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
        # The new run need not be a process of its own: only the victim's pid is judged.
        r = CliRunner(env={"NO_COLOR": "1"}).invoke(cli, _args(db, server, tiny_model_dir))
        assert r.exit_code == 0, r.output
        assert "nothing to score" not in r.stdout, r.output
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
    # The first worker runs in a thread of this process (a live pid: os.getpid()), with the
    # options the command line gives the second one, so both are one scorer.
    first_store = Store.open(db)
    cfg = ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT)
    prep = prepare(first_store, cfg)
    outcome: dict = {}

    def run_first() -> None:
        try:
            outcome["report"] = run_scoring(first_store, prep, RunOptions(lease_seconds=float(LONG_LEASE)))
        except BaseException as exc:  # shown by the assertion below
            outcome["error"] = exc

    first = threading.Thread(target=run_first, daemon=True)
    first.start()
    me = os.getpid()
    second = None
    try:
        steps = _counts(store)["steps"]
        wait_until(lambda: _leased_by(store, me) == steps or not first.is_alive(), "the first worker holds every step")
        assert first.is_alive(), outcome
        second_log = tmp_path / "second.log"
        second = _spawn(_cmd(db, server, tiny_model_dir), second_log)
        waiting = f"waiting for {steps} step(s) leased by worker"
        wait_until(
            lambda: waiting in second_log.read_text() and f":{me}" in second_log.read_text(),
            "the second run says whose leases it waits for",
            procs={"second": second},
        )
        assert first.is_alive(), outcome
        held.set()
        first.join(timeout=HANG_GUARD_S)
        assert not first.is_alive() and "error" not in outcome, outcome
        assert outcome["report"].failed == 0, outcome
        assert second.wait(timeout=HANG_GUARD_S) == 0, second_log.read_text()
        counts = _counts(store)
        assert counts.get("done") == counts["steps"] > 0, counts
    finally:
        held.set()
        first.join(timeout=HANG_GUARD_S)
        if second is not None:
            second.kill()
            second.wait()
        first_store.close()
        store.close()
