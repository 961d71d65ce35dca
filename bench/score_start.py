"""Benchmark: a whole `hcapo-store score` process, with and without a tokenizer class record
(rendering/tokenizer_memo.py).

    python bench/score_start.py --rounds 5 --json-out r.json

Each round scores the same four episodes (the shared long samples, else the project's examples)
into a fresh copy of one ingested store against the zero-latency `/generate` server of
bench/bookkeeping.py, twice, in turn: with an empty ``HCAPO_CACHE_DIR`` (the process loads its
tokenizer by ``AutoTokenizer``, which imports torch: what every `score` did before the records)
and with the directory an earlier `score` recorded into (the class loaded alone, checked by
digest). Reported per case: wall seconds and the child's CPU seconds (user + system), median
of the rounds, and the ratio recorded / rule.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from _paired import finish, header  # noqa: E402
from bookkeeping import QWEN3, start_server  # noqa: E402

SAMPLES = REPO.parent / "shared" / "samples" / "trajectories"


def _cli(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of ``python -m cli ARGS`` (this tree's CLI)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=REPO,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokenizer", default=str(QWEN3), help="tokenizer directory (default: the shared Qwen3)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    episodes = SAMPLES if SAMPLES.is_dir() else REPO / "examples" / "trajectories"

    url, server = start_server(args.tokenizer)
    runs: dict[str, list[dict[str, float]]] = {"rule": [], "recorded": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
            blank = Path(tmp) / "blank.db"
            _cli(["--db", str(blank), "ingest", str(episodes)], base)
            recorded = Path(tmp) / "recorded"
            warm = Path(tmp) / "warm.db"
            shutil.copyfile(blank, warm)  # records the class, warms the page cache and the server
            _cli(
                ["--db", str(warm), "score", "--server", url, "--tokenizer", args.tokenizer],
                {**base, "HCAPO_CACHE_DIR": str(recorded)},
            )
            for i in range(args.rounds):
                for case in runs:
                    db = Path(tmp) / f"{case}-{i}.db"
                    shutil.copyfile(blank, db)
                    cache = recorded if case == "recorded" else Path(tmp) / f"empty-{i}"
                    wall, cpu = _cli(
                        ["--db", str(db), "score", "--server", url, "--tokenizer", args.tokenizer],
                        {**base, "HCAPO_CACHE_DIR": str(cache)},
                    )
                    runs[case].append({"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
    finally:
        server.terminate()
    medians = {case: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")} for case, rs in runs.items()}
    ratios = {
        k: [round(a[k] / b[k], 3) for a, b in zip(runs["recorded"], runs["rule"], strict=True)]
        for k in ("wall_s", "cpu_s")
    }
    doc = {**header(Path(__file__), argv), "episodes": str(episodes), "runs": runs, "medians": medians}
    print(json.dumps(medians))
    return finish(doc, {"recorded_over_rule": ratios}, args.json_out)


if __name__ == "__main__":
    main()
