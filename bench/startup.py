"""Start-up time of the CLI: `hcapo-store --help` and `hcapo-store status` as new processes.

Each round runs every case once, in turn (paired), so machine load hits all cases alike;
``python -c pass`` is the interpreter's own floor. ``--baseline DIR`` also times another
checkout (e.g. the commit before a change) in the same rounds. Target: --help < 0.3 s idle.

    python bench/startup.py --runs 7
    python bench/startup.py --runs 7 --baseline /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


Case = tuple[list[str], Path]


def _cases(checkouts: dict[str, Path], db: Path) -> dict[str, Case]:
    """name -> (argv, checkout). The CLI runs as `python -m cli` in each checkout (the
    module the console script imports), without a launcher (pyenv shims) in the way."""
    cases = {"python -c pass": ([sys.executable, "-c", "pass"], ROOT)}
    for label, root in checkouts.items():
        cases[f"{label}: --help"] = ([sys.executable, "-m", "cli", "--help"], root)
        cases[f"{label}: status"] = ([sys.executable, "-m", "cli", "--db", str(db), "status"], root)
    return cases


def _time(case: Case) -> float:
    argv, root = case
    env = {**os.environ, "PYTHONPATH": str(root)}
    t0 = time.perf_counter()
    # cwd too: `python -m` puts the working directory first on sys.path.
    subprocess.run(argv, env=env, cwd=root, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="rounds (at least 3)")
    ap.add_argument("--baseline", type=Path, help="another checkout to time in the same rounds")
    args = ap.parse_args()
    runs = max(args.runs, 3)
    checkouts = {"this": ROOT}
    if args.baseline:
        checkouts["baseline"] = args.baseline.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.db"
        subprocess.run(
            [sys.executable, "-m", "cli", "--db", str(db), "ingest", str(ROOT / "examples" / "trajectories")],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
            stdout=subprocess.DEVNULL,
        )
        cases = _cases(checkouts, db)
        for case in cases.values():  # warm the page cache and .pyc files
            _time(case)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(runs):
            for name, case in cases.items():
                times[name].append(_time(case))
    print(
        f"{platform.node()} · {os.cpu_count()} cores · Python {platform.python_version()} · "
        f"load {os.getloadavg()[0]:.2f} · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {runs} rounds"
    )
    print("| case | min | median | max |\n| --- | ---: | ---: | ---: |")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.3f} s | {statistics.median(ts):.3f} s | {max(ts):.3f} s |")


if __name__ == "__main__":
    main()
