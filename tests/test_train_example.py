"""examples/train_weighted.py: an advantage-weighted NLL step over the tokenized export, on the tiny model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from test_tokenized import scored_with

from hcapo_store.outputs.export import export_dataset
from hcapo_store.storage.store import Store


def test_weighted_training_step_lowers_the_loss(
    store: Store, samples: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    scored_with(store, samples, tiny_model_dir)
    data = tmp_path / "train.parquet"
    summary = export_dataset(
        store, data, "r", min_reward=0.0, layout="tokenized", tokenizer=tiny_model_dir, fmt="parquet"
    )
    assert summary.weighted_tokens > 0
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_weighted.py"),
            str(data),
            "--model",
            str(tiny_model_dir),
            "--steps",
            "4",
            "--lr",
            "3e-3",
            "--max-length",
            "4096",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    losses = json.loads(out.stdout)["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) and x > 0 for x in losses)
    assert losses[-1] < losses[0]
