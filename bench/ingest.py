"""Ingest throughput and memory: N real-shaped 100-step episodes → episodes/s and peak RSS.

Inputs (``--input``):
  real       (default) copies of the long real-format samples (../shared/samples/long:
             Pi session v3, thinking blocks, long tool outputs, compaction; ~312 KB per
             episode on average), each copy with a new session id and episode id, so
             every content hash and source key is new;
  synthetic  the older 99-step synthetic episodes (~122 KB), for comparison.

Each run ingests into a new database in a fresh subprocess, so its peak RSS is its own.
``--baseline TREE`` pairs every run with the same inputs ingested by the code in another
checkout (e.g. ../main), alternating which goes first; ``--repeat`` sets the number of
pairs. ``--baseline-jobs 1`` pairs instead with this tree parsing in one process (ingest
parses in worker processes by default; ``--jobs`` sets their number for this tree). CPU per
episode counts the workers too; peak RSS is the main process's. Budget (BENCHMARKS.md
budgets): >= 100 episodes/s, peak RSS flat from 1,000 to 5,000.

    python bench/ingest.py --sizes 1000 --repeat 3 --baseline ../main
    python bench/ingest.py --sizes 1000 --repeat 3 --baseline-jobs 1
    python bench/ingest.py --sizes 1000 5000
    python bench/ingest.py --sizes 300 --profile /tmp/ingest.prof
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
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT.parent / "shared" / "samples" / "long"  # ../shared beside the checkout


def _split(session_text: str) -> tuple[dict, str]:
    head, _, rest = session_text.partition("\n")
    return json.loads(head), rest


def _write_copies(
    root: Path, n: int, bases: list[tuple[dict, str, dict]], result_text: Callable[[dict, int], str]
) -> int:
    """n episode dirs, round robin over (session header, rest of session, result) bases; returns total bytes.
    Copy i gets its own session id: the id is the episode's identity (pi:<id>)."""
    total = 0
    for i in range(n):
        header, rest, result = bases[i % len(bases)]
        d = root / f"episode_{i:05d}"
        d.mkdir(parents=True)
        session = json.dumps({**header, "id": f"{header['id'][:-8]}{i:08x}"}) + "\n" + rest
        res = result_text(result, i)
        (d / "pi_session.jsonl").write_text(session)
        (d / "result.json").write_text(res)
        total += len(session) + len(res)
    return total


def write_real_episodes(root: Path, n: int, samples: Path = SAMPLES) -> int:
    """n copies of the real-format samples, round robin, each with new ids; returns total bytes."""
    bases = []
    for d in sorted(p for p in samples.iterdir() if (p / "pi_session.jsonl").is_file()):
        header, rest = _split((d / "pi_session.jsonl").read_text())
        bases.append((header, rest, json.loads((d / "result.json").read_text())))
    if not bases:
        raise SystemExit(f"no sample episodes under {samples}")
    return _write_copies(
        root,
        n,
        bases,
        lambda result, i: json.dumps(
            {**result, "episode_id": i, "episode_reward": round((i % 997) / 997, 4)}, indent=2
        ),
    )


# Tool-output words of the client budget's shape: 99-step synthetic episodes of about 25k Qwen3
# tokens (issue 34: "a 100-step, 25k-token episode is about 8 ms of GPU time per step");
# bench/bookkeeping.py and bench/ascii_bpe.py --input budget.
BUDGET_OUTPUT_WORDS = 215


def write_synthetic_episodes(root: Path, n: int, output_words: int = 40) -> int:
    """The older synthetic 99-step episodes (~40-word tool outputs, no thinking; about 9k Qwen3
    tokens each, ~25k with ``output_words=BUDGET_OUTPUT_WORDS``)."""
    sys.path.insert(0, str(ROOT))
    from hcapo_store.devkit.synth import EpisodeBuilder

    bases = []
    for seed in range(8):
        b = EpisodeBuilder(seed=seed).standard(steps_per_subtask=22, output_words=output_words)
        bases.append((*_split(b.session_text()), b.result()))
    return _write_copies(
        root, n, bases, lambda result, i: json.dumps({**result, "episode_id": i, "episode_reward": (i % 997) / 997})
    )


def _tree_cpu_s() -> float:
    """CPU seconds of this process and every process it started (the parse workers and the
    forkserver that forks them, which has reaped the workers already shut down)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + (t.children_user + t.children_system if p is not me else 0.0)
    return total


def child(tree: str, root: str, db: str, profile: str | None, jobs: int | None) -> None:
    sys.path.insert(0, tree)
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage.store import Store

    store = Store.open(db)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0, cpu0, tree0 = time.perf_counter(), time.process_time(), _tree_cpu_s()
    report = ingest(store, [Path(root)]) if jobs is None else ingest(store, [Path(root)], jobs=jobs)
    dt, cpu, tree_cpu = time.perf_counter() - t0, time.process_time() - cpu0, _tree_cpu_s() - tree0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "episodes": report.new,
                "steps": report.steps,
                "seconds": dt,
                "cpu_s": cpu,  # this process
                "cpu_tree_s": tree_cpu,  # with its parse workers
                "episodes_per_s": report.new / dt,
                "episodes_per_cpu_s": report.new / tree_cpu,
                "peak_rss_mb": rss_mb,
                "failed": report.failed,
            }
        )
    )


def run_child(tree: Path, episodes: Path, db: Path, profile: str | None = None, jobs: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", str(tree), str(episodes), str(db)]
    if profile:
        cmd += ["--profile", profile]
    if jobs is not None:
        cmd += ["--jobs", str(jobs)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tree given is the code measured
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(values: list[float]) -> str:
    return f"min {min(values):.1f} / median {statistics.median(values):.1f} / max {max(values):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000])
    ap.add_argument("--input", choices=("real", "synthetic"), default="real")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size (pairs with --baseline)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout measured (default: this one)")
    ap.add_argument("--baseline", type=Path, help="another checkout whose ingest runs paired with --tree")
    ap.add_argument(
        "--baseline-input",
        choices=("real", "synthetic"),
        help="pair with this tree ingesting the other kind of input instead",
    )
    ap.add_argument("--profile", metavar="FILE", help="cProfile the (first) run of this tree to FILE")
    ap.add_argument("--jobs", type=int, help="ingest's parse workers for this tree (default: its own default)")
    ap.add_argument(
        "--baseline-jobs", type=int, help="pair with this tree ingesting with this many parse workers instead"
    )
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.profile, args.jobs)
        return
    writers = {"real": write_real_episodes, "synthetic": write_synthetic_episodes}
    peak_rss: list[float] = []
    for n in args.sizes:
        tmp = Path(tempfile.mkdtemp(prefix="hcapo-bench-ingest-"))
        try:
            cases = {"this": (args.tree.resolve(), tmp / args.input)}
            if args.baseline:
                cases["baseline"] = (args.baseline.resolve(), tmp / args.input)
            elif args.baseline_input:
                cases["baseline"] = (args.tree.resolve(), tmp / args.baseline_input)
            elif args.baseline_jobs:
                cases["baseline"] = (args.tree.resolve(), tmp / args.input)
            jobs = {"this": args.jobs, "baseline": args.baseline_jobs}
            for kind in {args.input, args.baseline_input} - {None}:
                size = writers[kind](tmp / kind, n)
                print(f"{n} {kind} episodes, {size / n / 1024:.0f} KB each on average")
            runs: dict[str, list[dict]] = {name: [] for name in cases}
            for rep in range(args.repeat):
                order = list(cases) if rep % 2 == 0 else list(reversed(cases))
                for name in order:
                    tree, episodes = cases[name]
                    db = tmp / f"{name}-{rep}.db"
                    r = run_child(tree, episodes, db, args.profile if rep == 0 and name == "this" else None, jobs[name])
                    db.unlink()
                    if r["failed"]:  # a rate over refused episodes measures nothing
                        raise SystemExit(f"{name}: {r['failed']} of {n} episodes failed to ingest; fix the inputs")
                    runs[name].append(r)
                    print(
                        f"  run {rep + 1} {name:8s}: {r['episodes']} episodes ({r['steps']} steps) in "
                        f"{r['seconds']:.1f} s → {r['episodes_per_s']:.0f} episodes/s "
                        f"({r['episodes_per_cpu_s']:.0f} per CPU-second, workers included), peak RSS {r['peak_rss_mb']:.0f} MB, "
                        f"failed {r['failed']}"
                    )
            peak_rss.append(max(r["peak_rss_mb"] for r in runs["this"]))
            for name, results in runs.items():
                print(
                    f"  {name} episodes/s: {_summary([r['episodes_per_s'] for r in results])}; per CPU-second: "
                    f"{_summary([r['episodes_per_cpu_s'] for r in results])}"
                )
            if "baseline" in runs:
                for key, what in (("episodes_per_s", "wall"), ("episodes_per_cpu_s", "CPU")):
                    ratios = [a[key] / b[key] for a, b in zip(runs["this"], runs["baseline"])]
                    print(
                        f"  this / baseline (paired, {what}): min ×{min(ratios):.2f} / "
                        f"median ×{statistics.median(ratios):.2f} / max ×{max(ratios):.2f}"
                    )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if len(peak_rss) > 1:
        print(f"peak RSS ratio {args.sizes[-1]}/{args.sizes[0]} episodes: {peak_rss[-1] / peak_rss[0]:.2f}")
    print("budget (BENCHMARKS.md budgets): >= 100 episodes/s; peak RSS flat in the number of episodes")


if __name__ == "__main__":
    main()
