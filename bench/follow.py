"""Benchmark: `follow` while a writer drops real-size episodes in groups (issue 17).

    python bench/follow.py --groups 3 --group-size 8 --every 5
    python bench/follow.py --json

A writer moves groups of copies of the long real-format samples (~100 steps each) into
``rollouts/step_NNNN/`` every ``--every`` seconds (a rename per episode directory: each
appears whole) while ``hcapo-store follow`` runs in its own process against the zero-latency
``/generate`` server of bench/bookkeeping.py (so the server's own scoring time is ~0 and
everything measured is the store: scan, ingest, prompt building, bookkeeping, credits).

Reported: per batch, the lag from its last episode landing on disk to its credits being
ready (p50 / p95 / max), and the steps/s sustained from the first drop to the last batch.
Beside it, in the same run, the same work for the first group done by hand in one process
(ingest, score, credits over the group; start-up not counted): the part of the lag that is
the scoring itself (the client's prompt building and bookkeeping) rather than following.
The server's own time is the CPU time its process used while follow ran, per batch (it
builds and serialises every logprob of every response): the lag beyond it is the store's.
Budget (issue 17): lag <= 2 s beyond the server's own scoring time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from bookkeeping import QWEN3, start_server  # noqa: E402
from ingest import SAMPLES, write_real_episodes  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _by_hand(group: Path, url: str, tokenizer: str, args: argparse.Namespace) -> float:
    """ingest + score + credits of one group in this process, on a fresh database (start-up excluded)."""
    from hcapo_store.credits.compute import compute_credits
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
    from hcapo_store.scoring.scheduler import RunOptions
    from hcapo_store.storage.store import Store

    with tempfile.TemporaryDirectory() as tmp, Store.open(str(Path(tmp) / "by_hand.db")) as store:
        cfg = ScoreConfig(
            server=url, tokenizer=tokenizer, max_context=args.max_context, prompt_layout=args.prompt_layout
        )
        prep = prepare(store, cfg)
        t = time.perf_counter()
        ingest(store, [group], name_root=group.parent)
        report = run_scoring(
            store, prep, RunOptions(concurrency=args.concurrency, prepare_workers=args.prepare_workers)
        )
        ids = [i for (i,) in store.query("SELECT id FROM episodes", read_only=True)[1]]
        compute_credits(store, episodes=ids)
        seconds = time.perf_counter() - t
    if report.failed:
        raise SystemExit(f"by hand: {report.failed} step(s) failed")
    return seconds


def _children_cpu() -> float:
    """User + system CPU seconds of this process's children that have ended and been waited for."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=3, help="batches the writer drops")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between two drops")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--prompt-layout", choices=["per-step", "episode"], default="per-step")
    ap.add_argument(
        "--tokenizer",
        default=str(QWEN3) if QWEN3.is_dir() else None,
        help="tokenizer directory (default: the shared Qwen3 tokenizer, else the demo tokenizer)",
    )
    ap.add_argument("--prepare-workers", type=int, help="follow's --prepare-workers (default: its own: threads here)")
    ap.add_argument("--samples", type=Path, default=SAMPLES, help="real-format episodes to copy")
    ap.add_argument("--json", action="store_true", help="print the measurement as one JSON object")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="hcapo-bench-follow-"))
    tokenizer = args.tokenizer
    if tokenizer is None:
        from hcapo_store.devkit.tiny_model import build_demo_tokenizer

        tokenizer = str(build_demo_tokenizer(tmp / "tokenizer"))
    url, server = start_server(tokenizer)

    staging, root, db = tmp / "staging", tmp / "rollouts", tmp / "follow.db"
    n = args.groups * args.group_size
    write_real_episodes(staging, n, args.samples)
    root.mkdir()
    argv = [sys.executable, "-m", "hcapo_store", "--db", str(db), "follow", str(root), "--server", url]
    argv += ["--tokenizer", tokenizer, "--max-context", str(args.max_context), "--group-size", str(args.group_size)]
    argv += ["--concurrency", str(args.concurrency), "--until-idle", str(max(10.0, 2 * args.every)), "--json"]
    argv += ["--prompt-layout", args.prompt_layout]
    argv += ["--prepare-workers", str(args.prepare_workers)] if args.prepare_workers is not None else []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    children_cpu = _children_cpu()
    follower = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert follower.stderr is not None
    started = ""  # its first look is done (the live line): start-up is not lag
    while not started.startswith("follow:"):
        line = follower.stderr.readline()  # before it, hints such as "nothing to follow yet"
        if not line:
            raise SystemExit(f"follow did not start: {started}{follower.stderr.read()[-3000:]}")
        started = line
    landed: dict[str, float] = {}
    server_cpu = _cpu_seconds(server.pid)
    episodes = sorted(staging.iterdir())
    first = time.time()
    for g in range(args.groups):
        step = root / f"step_{g:04d}"
        step.mkdir()
        for ep in episodes[g * args.group_size : (g + 1) * args.group_size]:
            os.rename(ep, step / ep.name)
        landed[f"rollouts/step_{g:04d}"] = time.time()
        if g + 1 < args.groups:
            time.sleep(args.every)
    out, err = follower.communicate(timeout=3600)
    server_cpu = _cpu_seconds(server.pid) - server_cpu  # the server's own work for every batch
    # follow's own process: its prepare workers are children of multiprocessing's forkserver, not counted
    follow_cpu = _children_cpu() - children_cpu
    by_hand = _by_hand(root / "step_0000", url, tokenizer, args)
    server.terminate()
    if follower.returncode != 0:
        raise SystemExit(f"follow exited {follower.returncode}:\n{err[-3000:]}")
    batches = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda b: b["key"])
    lags, ready = [], []
    for b in batches:
        at = dt.datetime.fromisoformat(b["ready_at"]).timestamp()
        ready.append(at)
        lags.append(at - landed[b["key"]])
    steps = sum(b["steps"] for b in batches)
    server_per_batch = server_cpu / len(batches)
    result = {
        "groups": args.groups,
        "group_size": args.group_size,
        "every_s": args.every,
        "batches": len(batches),
        "steps": steps,
        "lag_p50_s": round(statistics.median(lags), 2),
        "lag_p95_s": round(_percentile(lags, 0.95), 2),
        "lag_max_s": round(max(lags), 2),
        "lags_s": [round(x, 2) for x in lags],  # in landing order: the first pays the workers' start
        "lag_p50_after_first_s": round(statistics.median(lags[1:] or lags), 2),
        "follow_process_cpu_per_batch_s": round(follow_cpu / len(batches), 2),  # start-up, idle cycles included
        "steps_per_s": round(steps / (max(ready) - first), 1),
        "server_cpu_per_batch_s": round(server_per_batch, 2),
        "lag_p50_beyond_server_s": round(statistics.median(lags) - server_per_batch, 2),
        "by_hand_first_group_s": round(by_hand, 2),
        "lag_p50_over_by_hand": round(statistics.median(lags) / by_hand, 2),
        "tokenizer": Path(tokenizer).name,
        "prompt_layout": args.prompt_layout,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"follow: {result['batches']} batches of {args.group_size} real-size episodes ({steps} steps), one "
            f"every {args.every} s: lag p50 {result['lag_p50_s']} s, p95 {result['lag_p95_s']} s, max "
            f"{result['lag_max_s']} s ({result['lag_p50_beyond_server_s']} s beyond the server's own "
            f"{result['server_cpu_per_batch_s']} CPU-s per batch; after the first batch p50 "
            f"{result['lag_p50_after_first_s']} s; follow's process {result['follow_process_cpu_per_batch_s']} CPU-s per "
            "batch); "
            f"{result['steps_per_s']} steps/s sustained; the same group by hand "
            f"(ingest + score + credits, one process): {result['by_hand_first_group_s']} s "
            f"(lag p50 / by hand = {result['lag_p50_over_by_hand']})"
        )


if __name__ == "__main__":
    main()
