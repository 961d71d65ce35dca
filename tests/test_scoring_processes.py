"""`hcapo-store score` as real processes on one SQLite file: kill -9 at random moments and
resume; several processes sharing the queue, with grouped requests (the default). The
server (the reference model behind a counting proxy, tests/faultserver.py) runs in a
thread of the test process and logs every request, across all client processes; the
tests map the requests back to the steps they scored."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text

from faultserver import FaultServer, step_prompts, stored_scores
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.local.refserver import make_server
from hcapo_store.scoring.runner import FLUSH_SECONDS, RunOptions
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.storage.store import Store, count
from hcapo_store.local.synth import write_standard_episodes

MAX_CONTEXT = 2048
CONCURRENCY = 2
HCAPO = shutil.which("hcapo-store") or str(Path(sys.executable).with_name("hcapo-store"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[FaultServer]:
    ref = make_server(tiny_model_dir)  # not started: the proxy calls ref.generate in-process
    with FaultServer(ref, delay=0.02) as proxy:
        yield proxy
    ref.httpd.server_close()


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 6, seed=3, steps_per_subtask=1, output_words=20)
    return root


def _store(path: Path, episodes_dir: Path) -> Store:
    store = Store.open(str(path))
    ingest(store, [episodes_dir])
    return store


def _cmd(db: Path, server: FaultServer, tiny_model_dir: Path) -> list[str]:
    return [HCAPO, "--db", str(db), "score", "--server", server.url, "--tokenizer", str(tiny_model_dir),
            "--max-context", str(MAX_CONTEXT), "--concurrency", str(CONCURRENCY), "--json"]


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})


def _scores(store: Store) -> int:
    return count(store, "SELECT COUNT(*) FROM scores")


def _check_complete(store: Store) -> int:
    steps = count(store, "SELECT COUNT(*) FROM steps")
    assert _scores(store) == steps
    assert count(store, "SELECT COUNT(*) FROM (SELECT step_id, scorer_id FROM scores "
                        "GROUP BY step_id, scorer_id HAVING COUNT(*) > 1) d") == 0
    with store.engine.connect() as conn:
        states = dict(conn.execute(text("SELECT status, COUNT(*) FROM attempts GROUP BY status")).all())
    assert states == {"done": steps}
    assert count(store, "SELECT COUNT(*) FROM attempt_errors") == 0
    return steps


def test_kill_9_at_random_moments_then_resume(tmp_path, server, episodes_dir, tiny_model_dir):
    # The uninterrupted run, into another database.
    clean = _store(tmp_path / "clean.db", episodes_dir)
    prep = prepare(clean, ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir),
                                      max_context=MAX_CONTEXT))
    assert run_scoring(clean, prep, RunOptions(concurrency=CONCURRENCY)).failed == 0
    steps = _check_complete(clean)
    expected = stored_scores(clean, prep.scorer_id)
    prompts = step_prompts(clean, prep.builder)
    assert server.requests < steps  # grouped
    clean.close()

    db = tmp_path / "x.db"
    store = _store(db, episodes_dir)
    server.reset()
    rng = random.Random(20240607)
    kill_times: list[float] = []
    for round_ in range(3):
        before_scores, before_steps = _scores(store), sum(server.step_counts(prompts).values())
        proc = _spawn(_cmd(db, server, tiny_model_dir), tmp_path / f"killed-{round_}.log")
        # Startup (imports, tokenizer) takes seconds, and a loaded machine slows everything:
        # count the delay from its first committed score, so that every round makes progress.
        deadline = time.monotonic() + 60
        while (_scores(store) == before_scores and proc.poll() is None and time.monotonic() < deadline):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kill_times.append(time.monotonic())
        proc.wait(timeout=30)  # reaped: a zombie would still look alive to the next run
        # Only the steps that were missing were requested (a kill loses at most the ones in flight).
        assert sum(server.step_counts(prompts).values()) - before_steps <= steps - before_scores
        assert _scores(store) >= before_scores
    kills = len(kill_times)
    assert kills >= 2, "the runs finished before they could be killed: make the work bigger"
    assert 0 < _scores(store) < steps

    missing, before = steps - _scores(store), server.step_counts(prompts)
    done = subprocess.run(_cmd(db, server, tiny_model_dir), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # The resumed run scores exactly the missing steps: dead workers' leases are released at once.
    after = server.step_counts(prompts)
    assert sum(after.values()) - sum(before.values()) == missing
    assert _check_complete(store) == steps
    # A kill loses only recent work: the requests in flight (one per concurrent episode)
    # and results not yet committed (the single writer commits every FLUSH_SECONDS).
    assert max(after.values()) <= 1 + kills
    for key, n in after.items():
        if n > 1:
            first = min(e.at for e in server.log if e.fault is None and e.ids[:len(prompts[key].input_ids)]
                        == tuple(prompts[key].input_ids) and e.first_scored <= prompts[key].first_scored)
            assert any(0 <= t - first <= 1.0 + FLUSH_SECONDS for t in kill_times), (key, first, kill_times, [
                (e.at, e.first_scored, len(e.ids)) for e in server.log if e.ids[:len(prompts[key].input_ids)]
                == tuple(prompts[key].input_ids)])
    assert sum(after.values()) - steps <= kills * 4 * CONCURRENCY * 3  # at most 3 steps per request here
    with store.engine.connect() as conn:
        workers = dict(conn.execute(text("SELECT state, COUNT(*) FROM workers GROUP BY state")).all())
    assert workers.get("dead", 0) == kills and workers.get("running", 0) == 0

    got = stored_scores(store, prep.scorer_id)
    assert got.keys() == expected.keys()
    for key, (mean, blob, token_count) in expected.items():
        # A resumed group may start later than the uninterrupted one: same values up to float order.
        assert got[key][2] == token_count and got[key][0] == pytest.approx(mean, abs=1e-5), key
        np.testing.assert_allclose(np.frombuffer(got[key][1], "<f4"), np.frombuffer(blob, "<f4"), atol=1e-5, rtol=0)
    store.close()


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_share_one_queue(tmp_path, server, episodes_dir, tiny_model_dir, processes):
    db = tmp_path / "x.db"
    store = _store(db, episodes_dir)
    steps = count(store, "SELECT COUNT(*) FROM steps")
    server.reset()
    procs = [_spawn(_cmd(db, server, tiny_model_dir), tmp_path / f"p{i}.log") for i in range(processes)]
    for i, proc in enumerate(procs):
        assert proc.wait(timeout=180) == 0, (tmp_path / f"p{i}.log").read_text()
    # No step was requested twice, none is missing; steps were grouped.
    prep = prepare(store, ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir),
                                      max_context=MAX_CONTEXT))
    per_step = server.step_counts(step_prompts(store, prep.builder))
    assert len(per_step) == steps and set(per_step.values()) == {1}
    assert set(server.counts.values()) == {1} and server.requests < steps
    assert _check_complete(store) == steps
    with store.engine.connect() as conn:
        by_worker = dict(conn.execute(text("SELECT worker_id, COUNT(*) FROM scores GROUP BY worker_id")).all())
        reported = dict(conn.execute(text("SELECT id, scored FROM workers")).all())
    assert len(by_worker) >= 2, f"only one process got work: {by_worker}"
    assert all(reported[w] == n for w, n in by_worker.items())  # final counts reach the workers table
    store.close()
