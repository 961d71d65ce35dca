"""Ingest throughput and memory: N synthetic 100-step episodes → episodes/s and peak RSS.

Each size runs in a fresh subprocess so its peak RSS is its own. Budget (DESIGN.md §9):
>= 100 episodes/s, peak RSS flat from 1,000 to 5,000 episodes.

    python bench/ingest.py --sizes 1000 5000
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_episodes(root: Path, n: int) -> None:
    """100-step episodes: a few distinct sessions, each result.json different (so every hash is new)."""
    from hcapo_store.local.synth import EpisodeBuilder

    bases = []
    for seed in range(8):
        b = EpisodeBuilder(seed=seed).standard(steps_per_subtask=22, output_words=40)
        bases.append((b.session_text(), b.result()))
    for i in range(n):
        session, result = bases[i % len(bases)]
        d = root / f"episode_{i:05d}"
        d.mkdir(parents=True)
        (d / "pi_session.jsonl").write_text(session)
        (d / "result.json").write_text(json.dumps({**result, "episode_id": i, "episode_reward": (i % 997) / 997}))


def child(root: str, db: str) -> None:
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage.store import Store

    store = Store.open(db)
    t0 = time.perf_counter()
    report = ingest(store, [Path(root)])
    dt = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"episodes": report.new, "steps": report.steps, "seconds": dt,
                      "episodes_per_s": report.new / dt, "peak_rss_mb": rss_mb, "failed": report.failed}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000])
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    results = []
    for n in args.sizes:
        tmp = Path(tempfile.mkdtemp(prefix="hcapo-bench-ingest-"))
        try:
            write_episodes(tmp / "t", n)
            out = subprocess.run([sys.executable, __file__, "--child", str(tmp / "t"), str(tmp / "b.db")],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{n:>6} episodes ({r['steps']} steps): {r['seconds']:.1f}s, {r['episodes_per_s']:.0f} episodes/s, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB, failed {r['failed']}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if len(results) > 1:
        print(f"peak RSS ratio {args.sizes[-1]}/{args.sizes[0]}: {results[-1]['peak_rss_mb'] / results[0]['peak_rss_mb']:.2f}")


if __name__ == "__main__":
    main()
