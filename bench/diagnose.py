"""Benchmark: `diagnose` over N episodes × 100 steps (budget: 1M steps ≤ 10 s, RSS ≤ 1 GB; issue 18).

    python bench/diagnose.py                     # 1,000 episodes
    python bench/diagnose.py --episodes 10000    # the 1,000,000-step budget

Builds the database as bench/credits.py does (bulk inserts, no model), computes one credit
run (not timed here: bench/credits.py times it), then measures `diagnose_run` in a fresh
child process so that its peak RSS is its own. A numeric cross-check of the headline numbers
against plain numpy on the same rows is printed beside the timing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from credits import build  # noqa: E402  (bench/credits.py)

from hcapo_store.credits.compute import compute_credits  # noqa: E402
from hcapo_store.credits.diagnose import diagnose_run  # noqa: E402
from hcapo_store.credits.equations import CreditParams  # noqa: E402
from hcapo_store.storage.store import Store  # noqa: E402


def measure(path: Path, run: str) -> dict:
    import numpy as np

    store = Store.open(str(path))
    t0 = time.perf_counter()
    got = diagnose_run(store, run)
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rho = np.asarray(store.query("SELECT rho_raw FROM step_credits WHERE run = :r", {"r": run})[1], dtype=float)[:, 0]
    store.close()
    return {
        "steps": got["steps"],
        "seconds": round(seconds, 3),
        "steps_per_s": round(got["steps"] / seconds),
        "peak_rss_mb": round(peak_mb, 1),
        "rho_raw_std": got["rho_raw_std"],
        "abs_diff_std_vs_numpy": abs(got["rho_raw_std"] - float(rho.std())),
        "warnings": [w["code"] for w in got["warnings"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--db", type=Path, help="reuse/keep this database file")
    ap.add_argument("--measure", metavar="RUN", help=argparse.SUPPRESS)  # child process mode
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.db, args.measure)))
        return
    tmp = tempfile.TemporaryDirectory()
    path = args.db or Path(tmp.name) / "bench.db"
    if not path.exists():
        t0 = time.perf_counter()
        build(path, args.episodes, args.steps)
        print(f"built {args.episodes} episodes x {args.steps} steps in {time.perf_counter() - t0:.1f} s: {path}")
    store = Store.open(str(path))
    run = compute_credits(store, CreditParams()).run.name  # an existing run of these parameters is reused
    store.close()
    cmd = [sys.executable, __file__, "--measure", run, "--db", str(path)]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
