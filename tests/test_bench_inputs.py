"""The benchmarks' real-shaped inputs: copies of the long real-format samples that ingest
as new episodes (new ids, new hashes) and keep the samples' shape. No timing here."""

from __future__ import annotations

import pytest
from _bench import BENCH, bench_module
from _forked_runs import Forks
from sqlalchemy import text

from hcapo_store.ingestion.pipeline import ingest


def test_real_shaped_copies_ingest_as_new_episodes_of_the_samples_size(tmp_path, store):
    bench = bench_module("ingest")
    if not bench.SAMPLES.is_dir():
        pytest.skip(f"no long samples at {bench.SAMPLES}")
    samples = sorted(p for p in bench.SAMPLES.iterdir() if (p / "pi_session.jsonl").is_file())
    n = 2 * len(samples) + 1
    total = bench.write_real_episodes(tmp_path / "eps", n)

    report = ingest(store, [tmp_path / "eps"])
    assert (report.new, report.failed) == (n, 0)
    with store.engine.connect() as conn:
        hashes = conn.execute(text("SELECT COUNT(DISTINCT content_hash) FROM episodes")).scalar_one()
        steps = conn.execute(text("SELECT num_steps FROM episodes ORDER BY id")).scalars().all()
    assert hashes == n
    # Round robin over the samples: copy i has the size and the steps of sample i % len.
    sizes = [(p / "pi_session.jsonl").stat().st_size for p in samples]
    written = [(tmp_path / "eps" / f"episode_{i:05d}" / "pi_session.jsonl").stat().st_size for i in range(n)]
    assert all(abs(w - sizes[i % len(samples)]) < 64 for i, w in enumerate(written))
    assert steps[: len(samples)] == steps[len(samples) : 2 * len(samples)]
    assert total >= sum(written)


def test_synthetic_copies_ingest_as_new_episodes(tmp_path, store):
    # The synthetic baseline reuses 8 generated sessions; each copy needs its own session id,
    # or ingest refuses the copies as conflicting versions of one episode.
    bench = bench_module("ingest")
    n = 10
    bench.write_synthetic_episodes(tmp_path / "eps", n)
    report = ingest(store, [tmp_path / "eps"])
    assert (report.new, report.failed) == (n, 0)


def test_bookkeeping_bench_runs_against_its_server(forks: Forks):
    # The bench drives the real runner with prebuilt prompts against its own zero-latency
    # server: when the runner grows a new call (the vocabulary probe, grouping), the bench must
    # still score every step, or its numbers measure failures.
    bench = BENCH / "bookkeeping.py"
    args = ["--input", "synthetic", "--episodes", "1", "--repeat", "1", "--only-bookkeeping", "--no-timers"]
    out = forks.run(str(bench), *args, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [line for line in out.stdout.splitlines() if ", run 1: " in line]
    # the runner and its one baseline (stdlib json bodies; the hand-written transport is gone)
    assert len(runs) == 2 and all("15 steps (0 failed)" in line for line in runs), out.stdout


def test_the_budget_input_is_the_budgets_shape_and_scores_end_to_end(forks: Forks):
    """`--input budget` is what BENCHMARKS.md's client-budget row reads: 99-step episodes, every
    step scored end to end in the episode layout, and the GPU time it is set against reported."""
    import json

    from _shared import TOKENIZERS

    bench = BENCH / "bookkeeping.py"
    args = ["--input", "budget", "--episodes", "1", "--prompt-layout", "episode", "--no-timers", "--json"]
    out = forks.run(str(bench), *args, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    run = report["end_to_end#1"]
    assert (run["steps"], run["failed"]) == (99, 0), run
    assert report["sent_tokens_per_step"] > 0 and report["gpu_ms_per_step_at_prefill_rate"] > 0
    if (
        TOKENIZERS / "qwen3"
    ).is_dir():  # (else the demo tokenizer counts otherwise) one request per 99-step episode of ~25k tokens: its share per step
        assert 200 <= report["sent_tokens_per_step"] <= 300, report["sent_tokens_per_step"]
    assert report["summary"]["gpus_per_client_core"][1] > 0


def test_the_ascii_bpe_bench_checks_both_strategies_agree_before_timing(forks: Forks):
    """bench/ascii_bpe.py (BENCHMARKS.md's tokenizer row) asserts every piece's ids and offsets
    equal under both strategies before it times them: it must run to its figures."""
    import json

    from _shared import TOKENIZERS

    if not (TOKENIZERS / "qwen3").is_dir():
        pytest.skip(f"no Qwen3 tokenizer at {TOKENIZERS / 'qwen3'}")
    bench = BENCH / "ascii_bpe.py"
    args = ["--input", "budget", "--episodes", "1", "--rounds", "1", "--tokenizer", str(TOKENIZERS / "qwen3"), "--json"]
    out = forks.run(str(bench), *args, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["tokens"] > 20_000 and report["ascii_share_of_characters"] > 0.9
    assert report["after_over_before_median"] > 0
