"""Benchmark: `credits compute` on N episodes × 100 steps (budget: 1M steps ≤ 10 s, RSS ≤ 1 GB).

    python bench/credits.py                     # 1,000 episodes
    python bench/credits.py --episodes 10000    # the 1,000,000-step budget

Builds a database directly with bulk inserts (episodes, steps, scores; no ingest, no
model), then measures `compute_credits` in a fresh child process so that its peak RSS
(resource.getrusage) is the computation's own, and finally runs the plain-Python reference
(`hcapo_store/devkit/original_math.py`) on the same data in memory in that process for the speed ratio
and a numeric cross-check.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hcapo_store.credits.compute import compute_credits  # noqa: E402
from hcapo_store.credits.equations import CreditParams  # noqa: E402
from hcapo_store.storage import db  # noqa: E402
from hcapo_store.storage.store import Store  # noqa: E402

SCORER = "bench-scorer"
TOKENS = 16  # stored logprobs per step (small: the blob is read only when re-aggregating)


def _episode_steps(rng: random.Random, steps: int) -> list[tuple[str, str | None, float | None]]:
    """(phase, subtask_id, subtask_reward) per step: planning, then subtasks, some revisited."""
    n_plan = rng.randint(1, 3)
    out: list[tuple[str, str | None, float | None]] = [("planning", None, 0.5)] * n_plan
    rewards = {f"S{i}": round(rng.random(), 4) for i in range(1, 6)}
    current = 1
    while len(out) < steps:
        sid = f"S{current}" if rng.random() > 0.1 else f"S{rng.randint(1, 5)}"
        out.extend([("executing", sid, rewards[sid])] * rng.randint(5, 25))
        current = min(current + 1, 5)
    return out[:steps]


def build(path: Path, episodes: int, steps: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    store = Store.open(str(path))
    now = "2025-01-01T00:00:00+00:00"
    with db.write(store.engine) as conn:
        conn.exec_driver_sql(
            "INSERT INTO scorers (id, label, spec, created_at) VALUES (?, ?, ?, ?)", (SCORER, "bench", "{}", now)
        )
        step_id = 0
        for first in range(0, episodes, 500):
            ep_rows, step_rows, score_rows = [], [], []
            for e in range(first + 1, min(first + 500, episodes) + 1):
                ep_rows.append(
                    (
                        e,
                        f"bench/{e}",
                        1,
                        True,
                        "h",
                        "jsonl",
                        str(e),
                        f"episode_{e:06d}",
                        round(rng.random(), 4),
                        "{}",
                        False,
                        True,
                        4000,
                        2 * steps,
                        steps,
                        b"",
                        now,
                    )
                )
                for t, (phase, sid, r) in enumerate(_episode_steps(rng, steps)):
                    step_id += 1
                    step_rows.append((step_id, e, t, 2 * t + 1, phase, sid, r))
                    lps = [rng.uniform(-4.0, 0.0) for _ in range(TOKENS)]
                    blob = struct.pack(f"<{TOKENS}f", *lps)
                    score_rows.append(
                        (step_id, SCORER, blob, TOKENS, sum(lps) / TOKENS, TOKENS, 0, 0, 1000, 900, False, now)
                    )
            conn.exec_driver_sql(
                "INSERT INTO episodes (id, source_key, version, is_current, content_hash, source_format,"
                " external_id, name, reward, frozen_scores, reward_backfilled, include_thinking,"
                " max_tool_result_chars, num_messages, num_steps, raw_source, ingested_at)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                ep_rows,
            )
            conn.exec_driver_sql(
                "INSERT INTO steps (id, episode_id, step_index, message_index, phase, subtask_id,"
                " subtask_reward) VALUES (?,?,?,?,?,?,?)",
                step_rows,
            )
            conn.exec_driver_sql(
                "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob,"
                " total_action_tokens, skipped_action_tokens, truncated_prefix_tokens, input_tokens,"
                " logprob_start_len, flattened, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                score_rows,
            )
    store.close()


def measure(path: Path, params: CreditParams) -> dict:
    from hcapo_store.devkit.original_math import compute_ratios_and_qh

    store = Store.open(str(path))
    with db.write(store.engine) as conn:  # a reused database: time a fresh run, not a delete
        conn.exec_driver_sql("DELETE FROM credits")
        conn.exec_driver_sql("DELETE FROM credit_runs")
    t0 = time.perf_counter()
    result = compute_credits(store, params)
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    if (
        params.variant != "original"
    ):  # the plain reference is the original's; tests/test_credit_variants.py checks paper
        store.close()
        n = result.run.steps
        return {
            "episodes": result.run.episodes,
            "steps": n,
            "seconds": round(seconds, 3),
            "steps_per_s": round(n / seconds),
            "peak_rss_mb": round(peak_mb, 1),
            "reference_seconds": None,
            "reference_over_store": None,
            "max_abs_diff_vs_reference": None,
        }
    # The reference on the same data, in memory (loading is not timed).
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT e.id, e.reward, s.phase, s.subtask_id, s.subtask_reward, sc.mean_logprob, c.q_h_smoothed, "
            "sc.token_count, sc.token_logprobs "
            "FROM episodes e JOIN steps s ON s.episode_id = e.id JOIN scores sc ON sc.step_id = s.id "
            "JOIN credits c ON c.step_id = s.id AND c.run_id = ? ORDER BY e.id, s.step_index",
            (result.run.id,),
        ).all()
    episodes: dict[int, tuple[float, list[dict]]] = {}
    n_tok = params.max_logprob_tokens
    for e, reward, phase, sid, sr, m, q, count, blob in rows:
        if n_tok and count > n_tok:  # the suffix re-aggregation, done the plain way
            lps = struct.unpack(f"<{count}f", blob)[-n_tok:]
            m = sum(lps) / n_tok
        episodes.setdefault(e, (reward, []))[1].append(
            {"phase": phase, "subtask_id": sid, "subtask_reward": sr, "mean_logprob": m, "_db": q}
        )
    del rows
    t1 = time.perf_counter()
    for reward, steps in episodes.values():
        compute_ratios_and_qh(
            steps,
            reward,
            params.t_temp,
            params.gamma,
            params.c_min,
            params.c_max,
            params.alpha,
            params.smooth,
            params.uses_dense,
        )
    ref_seconds = time.perf_counter() - t1
    max_diff = max(abs(s["q_h_smoothed"] - s["_db"]) for _, steps in episodes.values() for s in steps)
    store.close()
    n = result.run.steps
    return {
        "episodes": result.run.episodes,
        "steps": n,
        "seconds": round(seconds, 3),
        "steps_per_s": round(n / seconds),
        "peak_rss_mb": round(peak_mb, 1),
        "reference_seconds": round(ref_seconds, 3),
        "reference_over_store": round(ref_seconds / seconds, 2),
        "max_abs_diff_vs_reference": max_diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--db", type=Path, help="reuse/keep this database file")
    ap.add_argument(
        "--max-logprob-tokens", type=int, default=None, help="also exercise the suffix re-aggregation (e.g. 8)"
    )
    ap.add_argument("--no-dense-rewards", action="store_true")
    ap.add_argument("--variant", choices=("original", "paper"), default="original")
    ap.add_argument("--json", action="store_true", help="print the measurement as one JSON object")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # child process mode
    args = ap.parse_args()
    params = CreditParams(
        dense=not args.no_dense_rewards, max_logprob_tokens=args.max_logprob_tokens, variant=args.variant
    )
    if args.measure:
        print(json.dumps(measure(args.db, params)))
        return
    tmp = tempfile.TemporaryDirectory()
    path = args.db or Path(tmp.name) / "bench.db"
    if not path.exists():
        t0 = time.perf_counter()
        build(path, args.episodes, args.steps)
        print(f"built {args.episodes} episodes x {args.steps} steps in {time.perf_counter() - t0:.1f} s: {path}")
    cmd = [sys.executable, __file__, "--measure", "--db", str(path)]
    if args.max_logprob_tokens:
        cmd += ["--max-logprob-tokens", str(args.max_logprob_tokens)]
    if args.no_dense_rewards:
        cmd.append("--no-dense-rewards")
    if args.variant != "original":
        cmd += ["--variant", args.variant]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"credits compute: {out['steps']:,} steps of {out['episodes']:,} episodes in {out['seconds']} s "
        f"({out['steps_per_s']:,} steps/s), peak RSS {out['peak_rss_mb']} MB"
    )
    if out["reference_seconds"] is None:
        tmp.cleanup()
        return
    print(
        f"reference (plain Python, in memory, same data): {out['reference_seconds']} s "
        f"= {out['reference_over_store']}x the store's time (which includes SQL read + write); "
        f"max |q_h_smoothed diff| = {out['max_abs_diff_vs_reference']:.3g}"
    )
    tmp.cleanup()


if __name__ == "__main__":
    main()
