"""Benchmark: what the run-time checks of the fast rendering strategies (rendering/verify.py)
cost the client per step, in ONE process, alternating rounds with the checks on and off.

    python bench/verify_cost.py --episodes 16 --rounds 24
    python bench/verify_cost.py --episodes 16 --rounds 24 --prompt-layout per-step --json

The budget (issue 40): the checks cost <= 5 % of the client CPU per step on the budget shape
(bench/bookkeeping.py --input budget: synthetic 99-step episodes of ~25k Qwen3 tokens, scored
at max_context 32768, with --prompt-layout episode, the layout the <= 1 ms budget is stated
for). Whole-process pairs (bench/bookkeeping.py, against the tree before) were too noisy on a
shared machine; here both sides run in the same process on the same loaded episodes, so the
machine's load, the allocator, the caches and the tokenizer are shared, and only the checks
differ: two ``PromptBuilder``s of the same settings, one with ``verify.CHECKED`` (what every
scorer uses) and one with ``verify.UNCHECKED`` (the strategies' results on trust), built
before timing. A round plans every episode's requests (``plan_requests_and_floor``, the
scheduler's preparation) with one builder; its ``time.process_time()`` divided by the steps
is the round's CPU per step. Rounds alternate on/off, the order flipped every pair, after
one warm-up round each (which also takes the once-per-process checks: the first 64 ASCII
pieces, each template's first render).

What is reported: the median CPU per step each way, the ratio of the medians, the
per-pair ratios (min, quartiles, max), and the ratio of the totals, which is the one that
carries the sampled checks at their rate (the placement check falls on one episode in 64 of
the process: about one round in four at 16 episodes). The checks only add work to
preparation, so their share of the whole client's CPU per step (preparation, bookkeeping
and HTTP; bench/bookkeeping.py's end-to-end figure) is smaller than their share here: the
difference in ms per step is printed too, to set against the client's ~1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
QWEN3 = REPO.parent / "shared" / "tokenizers" / "qwen3"


def _quantiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"min": min(values), "p25": q[0], "median": q[1], "p75": q[2], "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=24, help="timed rounds each way (on and off alternate)")
    ap.add_argument("--prompt-layout", choices=("per-step", "episode"), default="episode")
    ap.add_argument("--truncation", choices=("sliding", "window", "turns"), default="sliding")
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--max-logprob-tokens", type=int, default=2048)
    ap.add_argument(
        "--tokenizer",
        default=str(QWEN3) if QWEN3.is_dir() else None,
        help="tokenizer directory (default: the shared Qwen3 tokenizer, else the demo tokenizer)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from ingest import BUDGET_OUTPUT_WORDS, write_synthetic_episodes

    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.rendering import verify
    from hcapo_store.rendering.prompts import PromptBuilder
    from hcapo_store.rendering.tokenizers import load_tokenizer
    from hcapo_store.scoring.grouping import plan_requests_and_floor
    from hcapo_store.storage import db
    from hcapo_store.storage.episodes import load_episode
    from hcapo_store.storage.store import Store

    if verify.reference_mode():
        sys.exit("HCAPO_RENDERING=reference runs no fast strategy: there is nothing to check; unset it")
    tmp = Path(tempfile.mkdtemp(prefix="hcapo-bench-verify-"))
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from hcapo_store.devkit.tiny_model import build_demo_tokenizer

        tokenizer_dir = str(build_demo_tokenizer(tmp / "tokenizer"))
    write_synthetic_episodes(tmp / "episodes", args.episodes, output_words=BUDGET_OUTPUT_WORDS)
    store = Store.open(str(tmp / "bench.db"))
    assert ingest(store, [tmp / "episodes"]).failed == 0
    with db.read(store.engine) as conn:
        ids = [r[0] for r in conn.exec_driver_sql("SELECT id FROM episodes ORDER BY id").all()]
        episodes = [load_episode(conn, i) for i in ids]
    steps = sum(len(e.steps) for e in episodes)
    tokenizer = load_tokenizer(tokenizer_dir)

    def builder(checks: verify.Checks) -> PromptBuilder:
        # the settings job._prepared gives a scorer of these options
        return PromptBuilder(
            tokenizer,
            max_context=args.max_context,
            max_logprob_tokens=args.max_logprob_tokens,
            truncation=args.truncation,
            layout=args.prompt_layout,
            checks=checks,
        )

    builders = {"on": builder(verify.CHECKED), "off": builder(verify.UNCHECKED)}
    fallbacks_before = verify.fallbacks()

    def round_cpu(side: str) -> float:
        b = builders[side]
        start = time.process_time()
        for e in episodes:
            plan_requests_and_floor(b, e.messages, e.outcome, e.steps, e.steps)
        return (time.process_time() - start) / steps * 1e3  # ms per step

    load_before = os.getloadavg()
    for side in ("on", "off"):  # warm-up: the once-per-process checks, the memo, the allocator
        round_cpu(side)
    times: dict[str, list[float]] = {"on": [], "off": []}
    pairs: list[float] = []
    for r in range(args.rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        got = {side: round_cpu(side) for side in order}
        for side in order:
            times[side].append(got[side])
        pairs.append(got["on"] / got["off"])
    load_after = os.getloadavg()

    med = {side: statistics.median(v) for side, v in times.items()}
    total = {side: sum(v) for side, v in times.items()}
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "tokenizer": Path(tokenizer_dir).name,
        "input": f"budget: {len(episodes)} episodes, {steps} steps",
        "prompt_layout": args.prompt_layout,
        "truncation": args.truncation,
        "max_context": args.max_context,
        "rounds_each_way": args.rounds,
        "cpu_ms_per_step_median": {side: round(v, 4) for side, v in med.items()},
        "ratio_of_medians": round(med["on"] / med["off"], 4),
        "ratio_of_totals": round(total["on"] / total["off"], 4),
        "pair_ratios": {k: round(v, 4) for k, v in _quantiles(pairs).items()},
        "checks_ms_per_step": round((total["on"] - total["off"]) / args.rounds, 4),
        "fallbacks": verify.since(fallbacks_before),
        "budget": "checks <= 5 % of the client CPU per step (issue 40)",
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['date']}  {result['machine']}  load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"{result['input']}, {args.prompt_layout} layout, {args.truncation}, max_context {args.max_context}")
    print(f"CPU per step (median of {args.rounds} rounds): checks on {med['on']:.4f} ms, off {med['off']:.4f} ms")
    p = result["pair_ratios"]
    print(
        f"on/off: medians x{result['ratio_of_medians']:.4f}, totals x{result['ratio_of_totals']:.4f}; "
        f"pairs min x{p['min']:.3f} p25 x{p['p25']:.3f} median x{p['median']:.3f} p75 x{p['p75']:.3f} "
        f"max x{p['max']:.3f}"
    )
    print(f"the checks: {result['checks_ms_per_step']:+.4f} ms per step; fallbacks {result['fallbacks'] or 'none'}")


if __name__ == "__main__":
    main()
