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
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _waiting import HANG_GUARD_S, wait_until
from click.testing import CliRunner
from faultserver import FaultServer, step_prompts, stored_scores
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import FLUSH_SECONDS, RunOptions
from hcapo_store.storage.store import Store, count

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
    return [
        HCAPO,
        "--db",
        str(db),
        "score",
        "--server",
        server.url,
        "--tokenizer",
        str(tiny_model_dir),
        "--max-context",
        str(MAX_CONTEXT),
        "--concurrency",
        str(CONCURRENCY),
        "--json",
    ]


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})


def _scores(store: Store) -> int:
    return count(store, "SELECT COUNT(*) FROM scores")


def _lease_owners(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.execute(text("SELECT DISTINCT lease_owner FROM attempts WHERE status = 'leased'")).scalars())


def _holding(store: Store, processes: int) -> bool:
    """Every process holds leases, or (more processes than episodes to go round) all are leased."""
    pending, total = (
        count(store, "SELECT COUNT(*) FROM attempts WHERE status = 'pending'"),
        count(store, "SELECT COUNT(*) FROM attempts"),
    )
    owners = len(_lease_owners(store))
    return total > 0 and (owners == processes or (pending == 0 and owners >= 2))


def _check_complete(store: Store) -> int:
    steps = count(store, "SELECT COUNT(*) FROM steps")
    assert _scores(store) == steps
    assert (
        count(
            store,
            "SELECT COUNT(*) FROM (SELECT step_id, scorer_id FROM scores "
            "GROUP BY step_id, scorer_id HAVING COUNT(*) > 1) d",
        )
        == 0
    )
    with store.engine.connect() as conn:
        states = dict(conn.execute(text("SELECT status, COUNT(*) FROM attempts GROUP BY status")).all())
    assert states == {"done": steps}
    assert count(store, "SELECT COUNT(*) FROM attempt_errors") == 0
    return steps


def test_kill_9_at_random_moments_then_resume(tmp_path, server, episodes_dir, tiny_model_dir):
    # The uninterrupted run, into another database.
    clean = _store(tmp_path / "clean.db", episodes_dir)
    prep = prepare(
        clean, ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT)
    )
    assert run_scoring(clean, prep, RunOptions(concurrency=CONCURRENCY)).failed == 0
    steps = _check_complete(clean)
    expected = stored_scores(clean, prep.scorer_id)
    prompts = step_prompts(clean, prep.builder)
    assert server.requests < steps  # grouped
    clean.close()

    db = tmp_path / "x.db"
    store = _store(db, episodes_dir)
    rng = random.Random(20240607)
    kills = 0
    # One server per process (the same model): each request is then known to come from
    # the process that round started, whatever arrives late from a killed one.
    requested: list[Counter[str]] = []
    for round_ in range(3):
        before_scores = _scores(store)
        with FaultServer(server.ref, delay=0.02) as round_server:
            proc = _spawn(_cmd(db, round_server, tiny_model_dir), tmp_path / f"killed-{round_}.log")
            # The kill comes at a random point of progress, not of time: once the run has
            # committed a random part (at most a third) of what is left, however slow or fast
            # the machine is; then within one flush interval, so requests are in flight.
            target = before_scores + rng.randint(1, max(1, (steps - before_scores) // 3))
            wait_until(
                lambda p=proc, target=target: _scores(store) >= target or p.poll() is not None,
                "a random part of the work committed",
            )
            time.sleep(rng.uniform(0.0, FLUSH_SECONDS))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(timeout=HANG_GUARD_S)  # reaped: a zombie would still look alive to the next run
        requested.append(round_server.step_counts(prompts))
        # Only the steps that were missing were requested (a kill loses at most the ones in flight).
        assert sum(requested[-1].values()) <= steps - before_scores
        assert _scores(store) >= before_scores
    assert kills >= 2, "the runs finished before they could be killed: make the work bigger"
    assert 0 < _scores(store) < steps

    missing = steps - _scores(store)
    # The resuming run is the CLI in this process: only the killed runs need processes of their own.
    with FaultServer(server.ref, delay=0.02) as final_server:
        done = CliRunner().invoke(cli, _cmd(db, final_server, tiny_model_dir)[1:])
    requested.append(final_server.step_counts(prompts))
    assert done.exit_code == 0, done.output
    # The resumed run scores exactly the missing steps: dead workers' leases are released at once.
    assert sum(requested[-1].values()) == missing
    assert _check_complete(store) == steps
    # No process asks for a step twice: a step is requested again only by a later process,
    # after a kill lost it (in flight, or answered but not yet committed by the writer).
    # (step_counts lists every step, with 0 for those a process did not request)
    assert all(max(c.values(), default=0) <= 1 for c in requested), [
        [kv for kv in c.items() if kv[1] > 1] for c in requested
    ]
    total = sum(requested, Counter())
    assert len(total) == steps and max(total.values()) <= 1 + kills
    # Lost work per kill is bounded: the requests in flight (one per concurrent episode) and
    # the results of one flush interval (the single writer commits every FLUSH_SECONDS);
    # a grouped request carries up to 3 steps here.
    assert sum(total.values()) - steps <= kills * 4 * CONCURRENCY * 3
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


# Four processes on two cores; two share a SQLite queue in test_postgres.py (one of them killed).
@pytest.mark.parametrize("processes", [4])
def test_processes_share_one_queue(tmp_path, server, episodes_dir, tiny_model_dir, processes):
    db = tmp_path / "x.db"
    store = _store(db, episodes_dir)
    steps = count(store, "SELECT COUNT(*) FROM steps")
    server.reset()
    server.gate.clear()  # scoring starts once the processes hold work (however slowly they start)
    try:
        procs = [_spawn(_cmd(db, server, tiny_model_dir), tmp_path / f"p{i}.log") for i in range(processes)]
        wait_until(
            lambda: _holding(store, processes),
            "the processes hold all the work they can",
            procs={f"p{i}": p for i, p in enumerate(procs)},
        )
        holders = set(_lease_owners(store))
    finally:
        server.gate.set()
    for i, proc in enumerate(procs):
        assert proc.wait(timeout=HANG_GUARD_S) == 0, (tmp_path / f"p{i}.log").read_text()
    # No step was requested twice, none is missing; steps were grouped.
    prep = prepare(
        store, ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT)
    )
    per_step = server.step_counts(step_prompts(store, prep.builder))
    assert len(per_step) == steps and set(per_step.values()) == {1}
    assert set(server.counts.values()) == {1} and server.requests < steps
    assert _check_complete(store) == steps
    with store.engine.connect() as conn:
        by_worker = dict(conn.execute(text("SELECT worker_id, COUNT(*) FROM scores GROUP BY worker_id")).all())
        reported = dict(conn.execute(text("SELECT id, scored FROM workers")).all())
    assert len(holders) >= 2 and set(by_worker) == holders, (holders, by_worker)
    assert all(reported[w] == n for w, n in by_worker.items())  # final counts reach the workers table
    store.close()
