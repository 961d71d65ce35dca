"""Requests and prompt tokens per episode, against the prefill floor, for every prompt layout.

    python bench/tokens.py --episodes ../shared/samples/long \
        --tokenizer ../shared/tokenizers/qwen2.5 --tokenizer ../shared/tokenizers/qwen3

Ingests the episodes (real on-disk format, default conversion options) into a scratch
SQLite file, builds every step's prompt exactly as ``score`` does, forms the requests
(``scoring/grouping.py``) and counts, per episode:

* ``floor``: the conversation's tokens (rendered once with the episode's hindsight block, up
  to its last step: what ``episode_floors`` records), and every layout's tokens as a multiple
  of it (``xfloor``);
* ``requests`` and ``prompt`` tokens sent;
* ``prefill``: the tokens a server with a perfect, unbounded prefix cache would still
  compute (each request minus its longest common prefix with any earlier request of the
  episode). vLLM skips its prefix cache for prompt-logprob requests, and the in-process
  backend has none: there, ``prompt`` is what is computed.

Nothing is sent anywhere; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.episode_layout import conversation_tokens
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import GroupPrompt
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.scoring.grouping import plan_requests
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store

MODES = (  # label, layout, grouping, truncation
    ("per-step", "per-step", "per-step", "sliding"),
    ("grouped", "per-step", "grouped", "sliding"),
    ("grouped+window", "per-step", "grouped", "window"),
    ("episode-layout", "episode", "grouped", "sliding"),
)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def prefill_with_cache(requests: list[list[int]]) -> int:
    """Tokens to compute when every earlier request of the episode is cached (radix tree)."""
    seen: list[np.ndarray] = []
    total = 0
    for ids in requests:
        arr = np.asarray(ids, dtype=np.int64)
        hit = max((common_prefix(arr, s) for s in seen), default=0)
        # A server recomputes at least the last token to get logits (SGLang/vLLM both do).
        total += len(arr) - min(hit, len(arr) - 1)
        seen.append(arr)
    return total


def load_episodes(root: Path, scratch: Path) -> list[Any]:
    store = Store.open(str(scratch / "bench.db"))
    dirs = sorted(p for p in root.iterdir() if (p / "result.json").exists())
    report = ingest(store, dirs)
    if report.failed:
        raise SystemExit(f"{report.failed} episode(s) failed to ingest from {root}")
    with store.engine.connect() as conn:
        ids = [r[0] for r in store.query("SELECT id FROM episodes WHERE is_current ORDER BY id")[1]]
        episodes = [load_episode(conn, i) for i in ids]
    store.close()
    return episodes


def measure(
    tokenizer: Any, episode: Any, max_context: int, layout: str, grouping: str, truncation: str
) -> dict[str, Any]:
    builder = PromptBuilder(tokenizer, max_context=max_context, truncation=truncation, layout=layout)
    planned = plan_requests(builder, episode.messages, episode.outcome, episode.steps, grouping=grouping)
    requests = [r for r in planned if isinstance(r, GroupPrompt)]
    ids = [list(r.input_ids) for r in requests]
    floor = conversation_tokens(builder, episode.messages, episode.outcome, episode.steps)
    return {
        "floor": floor,
        "xfloor": round(sum(map(len, ids)) / floor, 3),
        "steps": sum(len(r.members) for r in requests),
        "failed": len(planned) - len(requests),
        "requests": len(requests),
        "prompt": sum(map(len, ids)),
        "prefill": prefill_with_cache(ids),
        "max_request": max(map(len, ids), default=0),
        "truncated_steps": sum(1 for r in requests for m in r.members if m.truncated_prefix_tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=Path, default=Path(__file__).resolve().parents[2] / "shared/samples/long")
    ap.add_argument("--tokenizer", type=Path, action="append", required=True)
    ap.add_argument("--max-context", type=int, action="append")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    contexts = args.max_context or [32768, 131072]
    with tempfile.TemporaryDirectory() as scratch:
        episodes = load_episodes(args.episodes, Path(scratch))
    rows = []
    for tok_path in args.tokenizer:
        tokenizer = load_tokenizer(tok_path)
        for episode in episodes:
            for ctx in contexts:
                row = {"tokenizer": tok_path.name, "episode": episode.name, "max_context": ctx}
                for label, layout, grouping, truncation in MODES:
                    row[label] = measure(tokenizer, episode, ctx, layout, grouping, truncation)
                rows.append(row)
                if not args.json:
                    print_row(row)
    if args.json:
        print(json.dumps({"machine": platform.platform(), "rows": rows}, indent=1))


def print_row(row: dict[str, Any]) -> None:
    base = row["per-step"]
    head = (
        f"{row['tokenizer']:8} {row['episode']:12} ctx {row['max_context']:6}  {base['steps']} steps, "
        f"floor {base['floor']} conversation tokens"
    )
    parts = []
    for label, _, _, _ in MODES:
        m = row[label]
        parts.append(
            f"{label}: {m['requests']} req, {m['prompt'] / 1e6:.3f}M prompt = {m['xfloor']:.2f}x floor "
            f"(x{base['prompt'] / max(m['prompt'], 1):.1f}), {m['prefill'] / 1e6:.3f}M prefill-cached "
            f"(x{base['prefill'] / max(m['prefill'], 1):.1f})"
        )
    print(head + "\n    " + "\n    ".join(parts), flush=True)


if __name__ == "__main__":
    main()
