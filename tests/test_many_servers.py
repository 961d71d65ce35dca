"""Many servers (issue 19): behind the real SGLang router (``smg --policy manual``) every request
of an episode reaches one worker; ``--server`` repeated spreads episodes by consistent hashing
and moves a dead server's episodes to the others; results equal a single-server run."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _waiting import wait_until
from click.testing import CliRunner
from faultserver import FaultServer, stored_scores

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import ScoringError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.backends.multi import rendezvous_order
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store

TOL = 1e-5
EPISODES = 12  # with two workers, all keys on one would happen 1 time in 2**11


@pytest.fixture(scope="module")
def refs(tiny_model_dir: Path) -> Iterator[tuple[ReferenceServer, ReferenceServer]]:
    with make_server(tiny_model_dir) as a, make_server(tiny_model_dir) as b:
        yield a, b


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many") / "eps"
    write_standard_episodes(root, EPISODES, seed=3, steps_per_subtask=1, output_words=8)
    return root


@pytest.fixture(scope="module")
def single(tmp_path_factory, refs, tiny_model_dir: Path, episodes_dir: Path) -> tuple[str, dict]:
    """The scorer id and scores of the episodes scored through one server: what every
    many-server run must equal (scored once for the module, not once per test)."""
    db = _store(tmp_path_factory.mktemp("single"), "one", episodes_dir)
    _score(db, tiny_model_dir, refs[0].url)
    return _scores(db)


def _store(tmp_path: Path, name: str, episodes_dir: Path) -> Path:
    db = tmp_path / f"{name}.db"
    with Store.open(str(db)) as store:
        ingest(store, [episodes_dir])
    return db


def _score(db: Path, tokenizer: Path, *servers: str) -> dict:
    argv = ["--db", str(db), "score", "--tokenizer", str(tokenizer), "--max-context", "2048", "--json"]
    for url in servers:
        argv += ["--server", url]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _scores(db: Path) -> tuple[str, dict]:
    with Store.open(str(db)) as store:
        sid = store.query("SELECT id FROM scorers")[1][0][0]
        return sid, stored_scores(store, sid)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key, (mean, blob, n) in a.items():
        assert b[key][2] == n and b[key][0] == pytest.approx(mean, abs=TOL)
        np.testing.assert_allclose(np.frombuffer(b[key][1], "<f4"), np.frombuffer(blob, "<f4"), atol=TOL, rtol=0)


def _one_server_each(servers) -> dict[str, int]:
    """Each routing key -> the one server that saw it (fails when a key reached two)."""
    owner: dict[str, int] = {}
    for i, server in enumerate(servers):
        for key in server.routing_keys:
            assert key is not None
            assert owner.setdefault(key, i) == i, f"episode key {key} reached two servers"
    return owner


def test_rendezvous_hashing_moves_only_the_dead_servers_keys():
    names = ["http://a:1", "http://b:2", "http://c:3"]
    keys = [f"ep-{i:016x}" for i in range(3000)]
    first = {k: rendezvous_order(k, names)[0] for k in keys}
    counts = [sum(v == i for v in first.values()) for i in range(3)]
    assert min(counts) > 800  # spread evenly
    without_b = {k: next(i for i in rendezvous_order(k, names) if i != 1) for k in keys}
    assert all(without_b[k] == first[k] for k in keys if first[k] != 1)  # the others' keys stay


def test_repeated_server_keeps_each_episode_on_one_server(tmp_path, refs, tiny_model_dir, episodes_dir, single):
    a, b = refs
    a.routing_keys.clear(), b.routing_keys.clear()
    db = _store(tmp_path, "two", episodes_dir)
    report = _score(db, tiny_model_dir, a.url, b.url)
    assert report["failed"] == 0 and report["scored"] > 0
    owner = _one_server_each(refs)
    assert len(owner) == EPISODES and set(owner.values()) == {0, 1}
    (sid_many, many), (sid_one, one) = _scores(db), single
    assert sid_many == sid_one  # the servers are not part of the scorer
    _assert_same(one, many)


def test_a_server_that_dies_mid_run_has_its_episodes_moved(tmp_path, refs, tiny_model_dir, episodes_dir, single):
    a_ref, _ = refs
    db = _store(tmp_path, "dies", episodes_dir)
    with FaultServer(a_ref) as a, FaultServer(a_ref) as b:
        b.hold_answers = threading.Event()  # B's first request waits: B dies while it holds it
        cfg = ScoreConfig(servers=(a.url, b.url), tokenizer=str(tiny_model_dir), max_context=2048)
        with Store.open(str(db)) as store:
            prep = prepare(store, cfg)
            done: dict = {}
            run = threading.Thread(
                target=lambda: done.update(report=run_scoring(store, prep, RunOptions(concurrency=2)))
            )
            run.start()
            wait_until(lambda: b.requests >= 1 or not run.is_alive(), "server B holds a request")
            b.dead.set()  # from now on B answers nothing, not even a probe, as a killed server
            b.hold_answers.set()
            run.join()
            report = done["report"]
            steps = store.query("SELECT COUNT(*) FROM steps")[1][0][0]
            assert report.failed == 0 and report.scored == steps and report.discarded == 0
            assert store.query("SELECT COUNT(*) FROM scores")[1][0][0] == steps
            assert store.query("SELECT COUNT(*) FROM attempts WHERE status <> 'done'")[1][0][0] == 0
            assert prep.backend.down == {1} and b.requests >= 1  # B served some, then its episodes moved
    _assert_same(single[1], _scores(db)[1])


def test_servers_that_serve_differently_are_refused(tmp_path, refs, tiny_model_dir, episodes_dir):
    a, b = refs
    db = _store(tmp_path, "differ", episodes_dir)
    b.weight_version = "step-9"
    try:
        with Store.open(str(db)) as store, pytest.raises(ScoringError, match="do not serve the same") as err:
            prepare(store, ScoreConfig(servers=(a.url, b.url), tokenizer=str(tiny_model_dir)))
        assert a.url in str(err.value) and b.url in str(err.value)
    finally:
        b.weight_version = "default"


# --- the real SGLang router ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def router(refs) -> Iterator[str]:
    smg = shutil.which("smg")
    if smg is None:
        pytest.skip("the SGLang router (pip install sglang-router: `smg`) is not installed")
    port = _free_port()
    cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "manual"]
    cmd += ["--worker-urls", *(r.url for r in refs), "--log-level", "warn"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]  # not a fixed port
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        def ready() -> bool:
            try:
                workers = httpx.get(f"{url}/workers", timeout=5).json().get("workers", [])
            except (httpx.HTTPError, ValueError):
                return False
            return len(workers) == 2 and all(w.get("is_healthy") for w in workers)

        wait_until(ready, "the router knows both workers as healthy", procs={"smg": proc})
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# starts the smg router process; the same check (one server per episode, the same scores) stays fast in
# test_repeated_server_keeps_each_episode_on_one_server, the key header in tests/test_routing_keys.py
@pytest.mark.slow
def test_the_sglang_router_keeps_each_episode_on_one_worker(
    tmp_path, refs, router, tiny_model_dir, episodes_dir, single
):
    a, b = refs
    a.routing_keys.clear(), b.routing_keys.clear()
    db = _store(tmp_path, "router", episodes_dir)
    report = _score(db, tiny_model_dir, router)
    assert report["failed"] == 0 and report["scored"] > 0
    owner = _one_server_each(refs)
    assert len(owner) == EPISODES and set(owner.values()) == {0, 1}  # both workers, one per episode
    (sid_router, via_router), (sid_direct, direct) = _scores(db), single
    assert sid_router == sid_direct
    _assert_same(direct, via_router)
