"""Benchmark: opening an existing store (``Store.open``: engine, schema check) in a warm process.

Each round runs this tree and, with ``--baseline DIR``, another checkout (e.g. the commit
before a change) in turn, each in its own process, so machine load hits both alike.

    python bench/store_open.py --rounds 3 --opens 40
    python bench/store_open.py --rounds 3 --opens 40 --baseline /path/to/older/checkout --json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# run in a child with the checkout first on sys.path: ms per open of an existing SQLite store
_CHILD = """
import sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from hcapo_store.storage.store import Store
url = f"sqlite:///{tempfile.mkdtemp()}/s.db"
Store.open(url).engine.dispose()  # created, and the process warm
n = int(sys.argv[2])
t = time.perf_counter()
for _ in range(n):
    Store.open(url).engine.dispose()
print((time.perf_counter() - t) / n * 1000)
"""


def _one(checkout: Path, opens: int) -> float:
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(checkout), str(opens)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),  # not a checkout: the one named is the one imported
    )
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--opens", type=int, default=40, help="opens timed per process")
    ap.add_argument("--baseline", type=Path, help="another checkout, timed in the same rounds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    ms: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            ms[name].append(_one(tree, args.opens))
    out: dict = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "opens": args.opens}
    out["ms_per_open"] = ms
    out["median_ms"] = {name: statistics.median(v) for name, v in ms.items()}
    if args.baseline:
        out["ratios"] = [round(a / b, 3) for a, b in zip(ms["this"], ms["baseline"])]
    if args.json:
        print(json.dumps(out))
    else:
        for name, v in ms.items():
            print(f"{name}: " + ", ".join(f"{x:.1f}" for x in v) + " ms per open")
        if args.baseline:
            print("this / baseline per round: " + ", ".join(f"×{r:.2f}" for r in out["ratios"]))


if __name__ == "__main__":
    main()
