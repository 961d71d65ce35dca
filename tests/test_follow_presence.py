"""`batches` with a follower at work (issue 39 §7): an empty change feed says what the running
follower is doing instead of telling the user to start one; a follower gone (stopped, or
killed with -9) is no longer reported. A real follower process against the reference server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _waiting import HANG_GUARD_S, wait_until
from click.testing import CliRunner
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _batches_line(db: Path) -> str:
    r = CliRunner().invoke(cli, ["--db", str(db), "batches"])
    assert r.exit_code == 0, r.output
    return r.output.strip()


def _following(db: Path) -> int:
    with Store.open(str(db), create=False) as store, store.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM workers WHERE state = 'following'")).scalar_one()


@pytest.mark.slow
def test_batches_says_what_a_running_follower_does(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    write_standard_episodes(root / "step_0000", 1, seed=3, steps_per_subtask=1, output_words=5)
    db = tmp_path / "s.db"
    assert CliRunner().invoke(cli, ["--db", str(db), "init"]).exit_code == 0
    argv = [sys.executable, "-m", "hcapo_store", "--db", str(db), "follow", str(root), "--server", ref.url]
    argv += ["--tokenizer", str(tiny_model_dir), "--max-context", "2048", "--group-size", "4", "--poll", "0.2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        # one episode of a group of four: scored, no batch complete; the follower's heartbeat has
        # its counts once its first cycle scored that episode
        wait_until(
            lambda: _following(db) == 1 and "step(s) scored" in _batches_line(db), "following", procs={"f": proc}
        )
        wait_until(lambda: " 0 step(s) scored" not in _batches_line(db), "its cycle counted", procs={"f": proc})
        line = _batches_line(db)
        assert line.startswith(f"no batches yet: a follower is running (pid {proc.pid} on "), line
        assert "a batch is listed once all its episodes are in and scored (--group-size, --batch-timeout)" in line
        assert "run `hcapo-store follow`" not in line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_GUARD_S)
    assert _batches_line(db) == "no batches yet: run `hcapo-store follow`"  # stopped: said on its way out

    # killed with -9 it cannot say so: its process is gone, and that is what counts on this host
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    wait_until(lambda: _following(db) == 1, "following again", procs={"f": proc})
    proc.kill()
    proc.wait(timeout=HANG_GUARD_S)
    assert _following(db) == 1  # the row still says following
    assert _batches_line(db) == "no batches yet: run `hcapo-store follow`"
