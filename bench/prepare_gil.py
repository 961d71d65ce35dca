"""The model thread's forwards while episodes are prepared beside it, in threads or in processes.

    python bench/prepare_gil.py --tokenizer ../shared/tokenizers/qwen3 [--workers 2] [--seconds 8] [--json]

A tiny Qwen3 on the CPU (one torch thread; small ops, so the host's Python sets the pace as it
does when a GPU model launches kernels) runs forwards back to back in its own thread for
``--seconds``, three times: alone; while synthetic episodes are prepared
(``scoring/preparing.py`` ``requests_for``: load, render, tokenize, episode layout) in
``--workers`` threads; and while a ``PreparePool`` of as many processes prepares them, fed by an
event loop as the scheduler feeds it. Reported per mode: the forwards' median and p90 wall ms,
the model thread's median ms off the CPU per forward (wall minus its thread CPU time: waiting
for the GIL, or for a core), and the episodes prepared. On a machine with fewer free cores than
workers + 1 the processes also take the model's core: compare the off-CPU ms with that in mind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="tokenizer dir (e.g. ../shared/tokenizers/qwen3)")
    p.add_argument("--workers", type=int, default=2, help="preparing threads, then processes")
    p.add_argument("--seconds", type=float, default=8.0, help="forwards per mode, seconds")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--steps-per-subtask", type=int, default=6)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hcapo_store.devkit.synth import EpisodeBuilder
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.rendering.prompts import PromptBuilder
    from hcapo_store.rendering.tokenizers import load_tokenizer
    from hcapo_store.scoring.preparing import BuilderRecipe, PreparePool, requests_for
    from hcapo_store.storage.store import Store

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="hcapo-gil-"))
    paths = [
        EpisodeBuilder(seed=i, episode_id=i, reward=0.5)
        .standard(steps_per_subtask=args.steps_per_subtask)
        .write(work / "episodes" / f"episode_{i:03d}")
        for i in range(1, args.episodes + 1)
    ]
    store = Store.open(str(work / "gil.db"))
    ingest(store, paths, jobs=1)
    ids = [int(r[0]) for r in store.query("SELECT id FROM episodes ORDER BY id")[1]]
    steps = {i: {int(r[0]) for r in store.query("SELECT step_index FROM steps WHERE episode_id = :e", {"e": i})[1]}
             for i in ids}  # fmt: skip
    options: dict[str, Any] = {"layout": "episode"}
    builder = PromptBuilder(load_tokenizer(args.tokenizer), **options)
    recipe = BuilderRecipe.of(args.tokenizer, options, builder)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    tokens = torch.randint(0, 1024, (1, 128))

    def forwards(stop: threading.Event, rows: list[tuple[float, float]]) -> None:
        with torch.inference_mode():
            while not stop.is_set():
                wall, cpu = time.perf_counter(), time.thread_time()
                model(input_ids=tokens, use_cache=False)
                rows.append((time.perf_counter() - wall, time.thread_time() - cpu))

    def measure(beside: Any) -> dict[str, Any]:
        stop, rows, prepared = threading.Event(), [], [0]
        thread = threading.Thread(target=forwards, args=(stop, rows))
        thread.start()
        until = time.monotonic() + args.seconds
        if beside is not None:
            beside(until, prepared)
        else:
            time.sleep(args.seconds)
        stop.set()
        thread.join()
        walls = sorted(w * 1000 for w, _ in rows)
        return {
            "forwards": len(rows),
            "median_ms": round(statistics.median(walls), 3),
            "p90_ms": round(walls[int(0.9 * (len(walls) - 1))], 3),
            "off_cpu_ms_median": round(statistics.median((w - c) * 1000 for w, c in rows), 3),
            "episodes_prepared": prepared[0],
        }

    def in_threads(until: float, prepared: list[int]) -> None:
        def loop() -> None:
            while time.monotonic() < until:
                for i in ids:
                    requests_for(store, builder, i, steps[i], "grouped", "k")
                    prepared[0] += 1

        with ThreadPoolExecutor(args.workers) as pool:
            for _ in range(args.workers):
                pool.submit(loop)

    pool = PreparePool(store.url, recipe, args.workers)

    def in_processes(until: float, prepared: list[int]) -> None:
        async def one() -> None:
            while time.monotonic() < until:
                for i in ids:
                    await pool.prepare(i, steps[i], "grouped", "k")
                    prepared[0] += 1

        async def all_() -> None:
            await asyncio.gather(*(one() for _ in range(args.workers)))

        asyncio.run(all_())

    asyncio.run(pool.prepare(ids[0], steps[ids[0]], "grouped", "k"))  # the workers started and warm
    out = {
        "workers": args.workers,
        "episodes": len(ids),
        "alone": measure(None),
        "threads": measure(in_threads),
        "processes": measure(in_processes),
    }
    pool.close()
    out["threads_over_alone"] = round(out["threads"]["median_ms"] / out["alone"]["median_ms"], 3)
    out["processes_over_alone"] = round(out["processes"]["median_ms"] / out["alone"]["median_ms"], 3)
    if args.json:
        print(json.dumps(out))
    else:
        for mode in ("alone", "threads", "processes"):
            print(mode, out[mode])
        print(f"forward median: threads x{out['threads_over_alone']}, processes x{out['processes_over_alone']} alone")


if __name__ == "__main__":  # the preparing processes import this module
    main()
