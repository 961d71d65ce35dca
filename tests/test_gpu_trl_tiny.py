"""bench/gpu_trl.py on the CPU (--size tiny --no-warm-up: nothing to warm on a CPU, and each TRL
step here is ~13 s): per prompt layout one TRL GRPO step, with the store's advantages
(StoreAdvantages: ingest, score_live, credits, hand-off), the real Qwen3 tokenizer and a tiny random Qwen3 of its vocabulary; the JSON the GPU run writes. No
timing is asserted, only that every part ran, the shares add up, and the hindsight signal reached
the trainer on every step (zero signal is a failure: on the GPU it once was all zeros)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import BENCH
from _shared import TOKENIZERS

pytest.importorskip("trl")


@pytest.mark.slow  # TRL's trainer and the Qwen3 vocabulary on a CPU: ~1-3 min on a loaded 2-core machine
def test_gpu_trl_bench_tiny(tmp_path: Path) -> None:
    tokenizer = TOKENIZERS / "qwen3"
    if not tokenizer.is_dir():
        pytest.skip(f"{tokenizer} is not here (../shared absent)")
    out = tmp_path / "trl.json"
    r = subprocess.run(
        [sys.executable, str(BENCH / "gpu_trl.py"), "--size", "tiny", "--no-warm-up"]
        + ["--tokenizer", str(tokenizer), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert "error" not in doc, doc.get("traceback")
    assert doc["prompt"]["tokens"] > 100 and doc["prompt"]["episode_steps"] > 5
    assert [s["layout"] for s in doc["steps"]] == ["per-step", "episode"] and doc["warm_up"] is False
    assert [s["warm_up"] for s in doc["steps"]] == [False, False]  # (the GPU run warms each layout up first)
    for step in doc["steps"]:
        parts = ("score_live", "credits", "ingest", "advantages", "generate_and_score")
        assert all(step[k] > 0 for k in parts), step
        assert step["advantages"] <= step["generate_and_score"] <= step["step_s"]
        assert step["hindsight_s"] == pytest.approx(step["score_live"] + step["credits"] + step["handoff"], abs=1e-3)
        assert 0 < step["hindsight_share"] < step["with_ingest_share"] < 1
        assert step["skipped_rows"] == 0 and step["refused_rows"] == 0  # every rollout stored, scored, placed
        # the signal that reached the trainer (its own log): rewards differ, some completion ended and was
        # trained, its advantage is not 0, and the batch's hindsight term is non-zero on some step
        assert step["reward_std"] > 0 and 1 <= step["trained_rows"] <= step["rows"], step
        assert step["advantage_abs_max"] > 0 and step["hindsight_nonzero_share"] > 0, step
    assert "zero_signal_steps" not in doc
    assert len(doc["scorers"]) == 2 and len(set(doc["scorers"].values())) == 2  # one scorer per step's weights
    assert doc["paper_hindsight_share"] == 0.083
    assert sum("of the step (paper 8.3%)" in line for line in doc["summary"]) == 2
    assert sum(": signal: advantage_abs_max " in line for line in doc["summary"]) == 2  # printed per step
