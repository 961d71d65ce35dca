"""Requests prepared in worker processes (scoring/preparing.py): the stored log-probabilities are
the threads' bit for bit, with the real Qwen3 tokenizer and a tiny Qwen3 of its vocabulary on the
CPU, in both prompt layouts; the pool is kept for the next run; by default, threads for a model
on the CPU, processes for a large run against a server."""

from __future__ import annotations

import json

import pytest
from _shared import TOKENIZERS
from faultserver import stored_scores

torch = pytest.importorskip("torch")
from _tiny_qwen3 import tiny_qwen3  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from hcapo_store.devkit.synth import write_standard_episodes  # noqa: E402
from hcapo_store.ingestion.pipeline import ingest  # noqa: E402
from hcapo_store.scoring import preparing  # noqa: E402
from hcapo_store.scoring.backends.inprocess import LiveModelBackend  # noqa: E402
from hcapo_store.scoring.live import score_live  # noqa: E402
from hcapo_store.storage.store import Store  # noqa: E402

QWEN3 = TOKENIZERS / "qwen3"


@pytest.fixture(scope="module")
def qwen3_store(tmp_path_factory: pytest.TempPathFactory):
    if not QWEN3.is_dir():
        pytest.skip(f"{QWEN3} is not here (../shared absent)")
    work = tmp_path_factory.mktemp("prep")
    write_standard_episodes(work / "eps", 1, steps_per_subtask=1, output_words=6)
    tok = AutoTokenizer.from_pretrained(str(QWEN3))
    model = tiny_qwen3(len(tok), max_position_embeddings=8192).eval()
    with Store.open(str(work / "p.db")) as store:
        report = ingest(store, [work / "eps"], jobs=1)
        assert not report.failed
        yield store, model
    preparing.close_pools()


@pytest.mark.slow  # worker processes start (imports, the Qwen3 tokenizer): ~20-60 s on a loaded 2-core machine
@pytest.mark.parametrize("layout", ["episode", "per-step"])
def test_processes_store_the_threads_logprobs_bit_for_bit(qwen3_store, layout: str) -> None:
    store, model = qwen3_store
    scored = {}
    for workers in (0, 2):
        live = score_live(
            store,
            model,
            tokenizer=str(QWEN3),
            weight_version=f"{layout}-{workers}",
            prompt_layout=layout,  # type: ignore[arg-type]
            max_context=4096,
            prepare_workers=workers,
        )
        assert live.report.failed == 0 and live.report.scored > 0
        scored[workers] = stored_scores(store, live.scorer_id)
    threads, processes = scored[0], scored[2]
    assert processes.keys() == threads.keys() and len(threads) == live.report.scored
    for key, (mean, blob, count) in threads.items():
        assert processes[key] == (mean, blob, count), key  # the blob: every token's float, bit for bit
    # the pool stays for the next run of this store and builder
    assert any(pool.workers == 2 and not pool.broken for pool in preparing._pools.values())


def test_the_default_prepares_in_threads_on_a_cpu(qwen3_store) -> None:
    _, model = qwen3_store
    backend = LiveModelBackend(model, weight_version="d")
    assert preparing.default_prepare_workers(backend) == 0  # not started: nothing known
    import asyncio

    asyncio.run(backend.start())
    try:
        assert backend.computes_in()["device"] == "cpu"
        assert preparing.default_prepare_workers(backend) == 0
    finally:
        asyncio.run(backend.close())


def test_an_in_memory_store_gets_no_pool() -> None:
    recipe = preparing.BuilderRecipe("x", (), "fast")
    assert preparing.shared_pool("sqlite://", recipe, 2) is None
    assert preparing.shared_pool("sqlite:///:memory:", recipe, 2) is None
    assert preparing.shared_pool("sqlite:////tmp/a.db", recipe, 0) is None


@pytest.mark.slow  # worker processes start (imports, the tokenizer)
def test_score_prepare_workers_from_the_cli_stores_the_threads_numbers(tmp_path, tiny_model_dir) -> None:
    """``score --prepare-workers 2`` against an HTTP server prepares in worker processes (a pool is
    started) and stores what ``--prepare-workers 0`` (threads) stores, bit for bit."""
    from click.testing import CliRunner
    from conftest import EXAMPLES, SAMPLES

    from hcapo_store.cli import cli
    from hcapo_store.devkit.refserver import make_server

    samples = SAMPLES if SAMPLES.exists() else EXAMPLES
    preparing.close_pools()  # a pool an earlier test kept would answer for this one
    server = make_server(tiny_model_dir).start()
    runner = CliRunner()
    scored = {}
    try:
        for workers in ("0", "2"):
            db = tmp_path / f"w{workers}.db"
            assert runner.invoke(cli, ["--db", str(db), "ingest", str(samples)]).exit_code == 0
            args = ["--db", str(db), "score", "--server", server.url, "--tokenizer", str(tiny_model_dir)]
            args += ["--max-context", "1024", "--prepare-workers", workers, "--json"]
            r = runner.invoke(cli, args, catch_exceptions=False)
            assert r.exit_code == 0 and json.loads(r.output)["failed"] == 0, r.output
            with Store.open(str(db)) as store:
                (scorer_id,) = [row[0] for row in store.query("SELECT id FROM scorers")[1]]
                scored[workers] = stored_scores(store, scorer_id)
            if workers == "2":
                assert any(pool.workers == 2 and not pool.broken for pool in preparing._pools.values())
    finally:
        server.shutdown()
        preparing.close_pools()
    assert scored["0"] and scored["2"] == scored["0"]


@pytest.mark.slow  # 140 steps scored twice against the reference server; worker processes start
def test_a_large_run_against_a_server_prepares_in_processes_by_default(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """No ``prepare_workers``: a run of ``PREPARE_PROCESSES_FROM_STEPS`` steps or more against a
    server starts a pool (kept for the next run), uses it as its workers start, and stores what
    threads store, bit for bit. The threshold is lowered to 100 steps here, for a run of 140 (the
    default's value and the runs below it are tests/test_packed_ids.py's; 594 steps scored twice
    took ~45 s of the suite)."""
    from hcapo_store.devkit.refserver import make_server
    from hcapo_store.scoring import defaults
    from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
    from hcapo_store.scoring.scheduler import RunOptions

    preparing.close_pools()
    monkeypatch.setattr(defaults, "PREPARE_PROCESSES_FROM_STEPS", 100)
    write_standard_episodes(tmp_path / "eps", 4, steps_per_subtask=6, output_words=8)  # 4 x 35 steps
    server = make_server(tiny_model_dir).start()
    scored = {}
    try:
        for workers in (0, None):
            with Store.open(str(tmp_path / f"{workers}.db")) as store:
                assert not ingest(store, [tmp_path / "eps"], jobs=1).failed
                prep = prepare(store, ScoreConfig(server=server.url, tokenizer=str(tiny_model_dir), max_context=1024))
                report = run_scoring(store, prep, RunOptions(prepare_workers=workers))
                assert report.failed == 0 and report.scored >= defaults.PREPARE_PROCESSES_FROM_STEPS
                scored[workers] = stored_scores(store, prep.scorer_id)
                pools = [pool for pool in preparing._pools.values() if not pool.broken]
                if workers == 0 or preparing.usable_cpus() < 2:
                    assert not pools
                else:  # started by default, and kept
                    assert [pool.workers for pool in pools] == [defaults.PREPARE_PROCESSES]
    finally:
        server.shutdown()
        preparing.close_pools()
    assert scored[0] and scored[None] == scored[0]
