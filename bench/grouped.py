"""End to end on the in-process backend: the same steps scored grouped vs per-step.

    python bench/grouped.py --episodes ../shared/samples/long --tokenizer ../shared/tokenizers/qwen2.5 \
        --steps 30 --rounds 3
    python bench/grouped.py --episodes ../shared/samples/long --model DEMO_MODEL_DIR --steps 30 --rounds 3

A tiny random Qwen2 model with the tokenizer's vocabulary (``local/tiny_model.py``;
cached under ``--cache``) scores the first ``--steps`` steps of every benchmark episode
through ``run_scoring`` (queue, leases, single writer: the real path) with
``--grouping per-step``, ``grouped``, and ``grouped`` + ``--truncation window`` (another
scorer: other prompts above the budget), into fresh copies of one ingested database, in
alternating order, ``--rounds`` times. The in-process backend has no prefix cache (like
vLLM for prompt-logprob requests), so every request is computed in full.

Reported per mode: wall seconds, requests, prompt tokens, and per step: wall ms, model
CPU ms (the forward passes; torch runs on one thread here so that it can be measured) and
client CPU ms (everything else in the process: prompts, grouping, bookkeeping, SQL).
Also checks that both modes stored the same values (within 1e-5).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hcapo_store.devkit.tiny_model import build_tiny_model
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.forward import LogprobModel
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage.store import Store

# (label, grouping, truncation); grouped+window is another scorer (other prompts over the budget)
MODES = (
    ("per-step", "per-step", "sliding"),
    ("grouped", "grouped", "sliding"),
    ("grouped+window", "grouped", "window"),
)


class ModelClock:
    """Thread CPU spent inside the model's forward passes (torch on one thread)."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.requests = 0
        self.tokens = 0
        original = LogprobModel.score_spans

        def timed(model: LogprobModel, ids: Any, spans: Any) -> Any:
            started = time.thread_time()
            try:
                return original(model, ids, spans)
            finally:
                self.cpu += time.thread_time() - started
                self.requests += 1
                self.tokens += len(ids)

        LogprobModel.score_spans = timed  # type: ignore[method-assign]

    def reset(self) -> None:
        self.cpu, self.requests, self.tokens = 0.0, 0, 0


async def _keep_loaded() -> None:
    return None


def stored(store: Store) -> dict[tuple[int, int], np.ndarray]:
    rows = store.query(
        "SELECT st.episode_id, st.step_index, s.token_logprobs FROM scores s JOIN steps st ON st.id = s.step_id"
    )[1]
    return {(e, i): np.frombuffer(blob, "<f4") for e, i, blob in rows}


def run_once(
    base_db: Path,
    scratch: Path,
    cfg: ScoreConfig,
    mode: tuple[str, str, str],
    steps: int,
    episodes: int,
    clock: ModelClock,
) -> dict[str, Any]:
    label, grouping, truncation = mode
    db = scratch / f"{label}.db"
    shutil.copy(base_db, db)
    store = Store.open(str(db))
    cfg.truncation = truncation  # type: ignore[assignment]
    prep = prepare(store, cfg)  # loads the model, outside the timed part
    prep.backend.close = _keep_loaded  # type: ignore[method-assign]  # run_scoring would drop it after each call
    clock.reset()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    scored = 0
    for name in [r[0] for r in store.query("SELECT name FROM episodes ORDER BY id")[1]][:episodes]:
        report = run_scoring(
            store, prep, RunOptions(concurrency=1, grouping=grouping, limit=steps, filters=Filters(episodes=(name,)))
        )
        assert report.failed == 0, report.summary()
        scored += report.scored
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    values = stored(store)
    store.close()
    return {
        "mode": label,
        "steps": scored,
        "wall_s": wall,
        "requests": clock.requests,
        "tokens": clock.tokens,
        "model_cpu_s": clock.cpu,
        "client_cpu_s": cpu - clock.cpu,
        "values": values,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=Path, default=Path(__file__).resolve().parents[2] / "shared/samples/long")
    ap.add_argument("--tokenizer", type=Path, help="build a tiny random model with this tokenizer's vocabulary")
    ap.add_argument(
        "--model",
        type=Path,
        help="or score with this model directory (with its tokenizer), "
        "e.g. the demo model: small vocabulary, so the decoder body dominates as in a real LLM",
    )
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hcapo-bench-models")
    ap.add_argument("--steps", type=int, default=30, help="steps scored per episode")
    ap.add_argument("--max-episodes", type=int, default=2)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.model is None and args.tokenizer is None:
        ap.error("give --tokenizer or --model")
    model_dir = args.model or build_tiny_model(args.cache / f"tiny-{args.tokenizer.name}", args.tokenizer)
    clock = ModelClock()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        base = scratch / "base.db"
        with Store.open(str(base)) as store:
            ingest(store, sorted(p for p in args.episodes.iterdir() if (p / "result.json").exists()))
        cfg = ScoreConfig(backend="transformers", model=str(model_dir), max_context=args.max_context)
        results: dict[str, list[dict[str, Any]]] = {m[0]: [] for m in MODES}
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                r = run_once(base, scratch, cfg, mode, args.steps, args.max_episodes, clock)
                results[mode[0]].append(r)
                print(
                    f"round {round_} {mode[0]:14}: {r['steps']} steps, {r['requests']} requests, "
                    f"{r['tokens'] / 1e3:.0f}k tokens, {r['wall_s']:.1f} s wall, model CPU {r['model_cpu_s']:.1f} s, "
                    f"client CPU {r['client_cpu_s']:.2f} s",
                    flush=True,
                )
    a, b = results["per-step"][0]["values"], results["grouped"][0]["values"]
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= 1e-5, worst
    print(
        f"\nmachine: {platform.platform()}, {os.cpu_count()} CPUs; torch threads 1; model {model_dir.name}; "
        f"max_context {args.max_context}"
    )
    for label, _, _ in MODES:
        rs = results[label]
        n = rs[0]["steps"]
        walls = sorted(r["wall_s"] for r in rs)
        print(
            f"{label:14}: {n} steps, {rs[0]['requests']} requests, {rs[0]['tokens'] / 1e6:.2f}M prompt tokens; "
            f"wall min/median/max {walls[0]:.1f}/{statistics.median(walls):.1f}/{walls[-1]:.1f} s; per step: "
            f"wall {statistics.median(r['wall_s'] for r in rs) / n * 1e3:.0f} ms, "
            f"model CPU {statistics.median(r['model_cpu_s'] for r in rs) / n * 1e3:.0f} ms, "
            f"client CPU {statistics.median(r['client_cpu_s'] for r in rs) / n * 1e3:.1f} ms"
        )
    for label in ("grouped", "grouped+window"):
        for what in ("wall_s", "model_cpu_s"):
            ratios = [p[what] / g[what] for p, g in zip(results["per-step"], results[label])]
            print(
                f"{label} speed-up vs per-step (paired, {what}): min/median/max x{min(ratios):.2f}/"
                f"x{statistics.median(ratios):.2f}/x{max(ratios):.2f}"
            )
    print(f"largest |grouped - per-step| logprob difference {worst:.2e}")


if __name__ == "__main__":
    main()
