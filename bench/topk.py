"""Benchmark: top-k storage (``topk_scores``, ``score --top-k``) at N scored tokens.

    python bench/topk.py --tokens 100000 1000000 --k 20

Per size: a store of steps of 100 scored tokens (episodes of 10 steps) built with bulk inserts
(no model), then the top-k rows written the way ``scoring/topk.py`` writes them (``TopK.encode``,
one executemany per episode); measured: bytes per token the file grew by (the whole row, page
overhead included, after a checkpoint), the write time, the time to open the store afresh
and read one step's top-k by its key, and the time to decode every row (what ``export scores
--top-k`` reads). Budget (issue 42): <= 150 B per token at K = 20; a 1M-token store stays fast
to open and query.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hcapo_store.storage import db  # noqa: E402
from hcapo_store.storage.store import Store  # noqa: E402
from hcapo_store.storage.topk import TopK  # noqa: E402

TOKENS_PER_STEP = 100
STEPS_PER_EPISODE = 10
SCORER = "b" * 64
NOW = "2026-11-27T00:00:00+00:00"


def build(path: Path, tokens: int) -> int:
    steps = tokens // TOKENS_PER_STEP
    episodes = steps // STEPS_PER_EPISODE
    store = Store.open(str(path))
    with db.write(store.engine) as conn:
        conn.exec_driver_sql(
            "INSERT INTO scorers (id, label, spec, created_at) VALUES (?, ?, ?, ?)", (SCORER, "bench", "{}", NOW)
        )
        ep_rows = [
            (e, f"b/{e}", 1, True, "h", "jsonl", str(e), f"ep{e:07d}", 1.0, "{}", False, True, 4000, 20, 10, b"", NOW)
            for e in range(1, episodes + 1)
        ]
        conn.exec_driver_sql(
            "INSERT INTO episodes (id, source_key, version, is_current, content_hash, source_format, external_id, "
            "name, reward, frozen_scores, reward_backfilled, include_thinking, max_tool_result_chars, num_messages, "
            "num_steps, raw_source, ingested_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            ep_rows,
        )
        step_rows = [
            ((e - 1) * STEPS_PER_EPISODE + t + 1, e, t, 2 * t + 1, "execution", None, None)
            for e in range(1, episodes + 1)
            for t in range(STEPS_PER_EPISODE)
        ]
        conn.exec_driver_sql(
            "INSERT INTO steps (id, episode_id, step_index, message_index, phase, subtask_id, subtask_reward) "
            "VALUES (?,?,?,?,?,?,?)",
            step_rows,
        )
    store.close()
    return episodes * STEPS_PER_EPISODE


def _checkpoint(path: Path) -> None:
    """Everything written into the main file (no connection of the store is open)."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def measure(path: Path, tokens: int, k: int) -> dict:
    steps = build(path, tokens)
    _checkpoint(path)
    before = _size(path)
    store = Store.open(str(path))
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for first in range(1, steps + 1, STEPS_PER_EPISODE):
        rows = []
        for step in range(first, first + STEPS_PER_EPISODE):
            ids = rng.integers(0, 151_936, size=(TOKENS_PER_STEP, k), dtype=np.int32)
            lps = -np.sort(rng.exponential(2.0, size=(TOKENS_PER_STEP, k)).astype(np.float32), axis=1)
            blob_ids, blob_lps = TopK(ids, lps).encode()
            rows.append((step, SCORER, k, TOKENS_PER_STEP, blob_ids, blob_lps))
        with db.write(store.engine) as conn:
            conn.exec_driver_sql(
                "INSERT INTO topk_scores (step_id, scorer_id, k, token_count, ids, logprobs) VALUES (?,?,?,?,?,?)",
                rows,
            )
    write_s = time.perf_counter() - started
    store.close()
    _checkpoint(path)
    grown = _size(path) - before
    started = time.perf_counter()
    store = Store.open(str(path))
    with db.read(store.engine) as conn:
        row = conn.exec_driver_sql(
            "SELECT k, token_count, ids, logprobs FROM topk_scores WHERE scorer_id = ? AND step_id = ?",
            (SCORER, steps // 2),
        ).one()
    top = TopK.decode(bytes(row[2]), bytes(row[3]), row[1], row[0])
    open_query_s = time.perf_counter() - started
    assert top.ids.shape == (TOKENS_PER_STEP, k)
    started = time.perf_counter()
    decoded = 0
    with db.read(store.engine) as conn:
        for k_, n, ids, lps in conn.exec_driver_sql("SELECT k, token_count, ids, logprobs FROM topk_scores"):
            decoded += TopK.decode(bytes(ids), bytes(lps), n, k_).token_count
    read_all_s = time.perf_counter() - started
    store.close()
    assert decoded == steps * TOKENS_PER_STEP
    return {
        "tokens": steps * TOKENS_PER_STEP,
        "k": k,
        "bytes_per_token": round(grown / (steps * TOKENS_PER_STEP), 1),
        "payload_bytes_per_token": 6 * k,
        "write_s": round(write_s, 2),
        "open_and_read_one_step_ms": round(open_query_s * 1000, 1),
        "decode_all_s": round(read_all_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[100_000])
    parser.add_argument("--k", type=int, default=20)
    args = parser.parse_args()
    for tokens in args.tokens:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(measure(Path(tmp) / "topk.db", tokens, args.k)), flush=True)


if __name__ == "__main__":
    main()
