"""examples/train_weighted.py: an advantage-weighted NLL step over the tokenized export, on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _examples import run_example
from conftest import REPO
from test_tokenized import scored_with

from hcapo_store.outputs.export import export_dataset
from hcapo_store.storage.store import Store


@pytest.mark.slow  # trains (docs/DEVELOPMENT.md: the slow tier)
def test_weighted_training_step_lowers_the_loss(
    store: Store, samples: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scored_with(store, samples, tiny_model_dir)
    data = tmp_path / "train.parquet"
    summary = export_dataset(
        store, data, "r", min_reward=0.0, layout="tokenized", tokenizer=tiny_model_dir, fmt="parquet"
    )
    assert summary.weighted_tokens > 0
    out = run_example(  # in this process: the test reads the example's status and output only
        REPO / "examples" / "train_weighted.py",
        *[
            str(data),
            "--model",
            str(tiny_model_dir),
            "--steps",  # the first loss is before any update, the second after one: enough for "lowers"
            "2",
            "--lr",
            "3e-3",
            "--max-length",
            "4096",
            "--json",
        ],
        monkeypatch=monkeypatch,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    losses = json.loads(out.stdout)["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert losses[-1] < losses[0]


@pytest.mark.slow  # trains (docs/DEVELOPMENT.md: the slow tier)
def test_grpo_example_trains_on_the_stores_credits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/train_grpo_hcapo.py: TRL's GRPO steps whose advantages come from the store."""
    out = run_example(  # in this process: the test reads the example's status, output and store only
        REPO / "examples" / "train_grpo_hcapo.py",
        *["--steps", "2", "--workdir", str(tmp_path), "--json"],
        monkeypatch=monkeypatch,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    steps = [json.loads(line) for line in out.stdout.splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(math.isfinite(s["loss"]) and s["advantage_abs_max"] > 0 for s in steps)
    assert all(s["skipped_logged"] == s["skipped"] for s in steps)  # the trainer's log says the rows left at 0
    assert steps[0]["scorer_id"] != steps[1]["scorer_id"]  # each step scored by the policy at its own weights
    with Store.open(str(tmp_path / "hcapo.db")) as store:
        runs = {name for (name,) in store.query("SELECT name FROM credit_runs")[1]}
        episodes = store.query("SELECT count(*) FROM episodes WHERE is_current")[1][0][0]
    assert {s["credit_run"] for s in steps} <= runs and episodes >= 6
    for s in steps:
        # outcome-only rollouts: the hindsight term is in most steps' advantages (the library's paper
        # defaults use the terminal return; dense returns gave 0 on every step), and it carries the
        # policy's scores: each episode has two steps (an earlier turn in the prompt), so the ratio
        # moves off 1 (single-turn episodes are refused: tests/test_trl_batches.py)
        assert s["hindsight_nonzero_steps"] > s["steps"] / 2, s
        assert s["ratio_varying_steps"] > s["steps"] / 2, s
