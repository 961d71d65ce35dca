"""Benchmark: tokenizing whole rendered conversations piece by piece, the backend's
``encode_batch`` (before) against rendering/ascii_bpe.py (ASCII pieces without the backend's
pre-tokenizer; the rest still through ``encode_batch``), as ``SegmentEncoder.offsets`` does.

    python bench/ascii_bpe.py --input budget --episodes 8 --rounds 7
    python bench/ascii_bpe.py --input real --episodes 4 --tokenizer ../shared/tokenizers/qwen2.5

Each conversation is rendered once with its hindsight block (as ``--prompt-layout episode``
does) and cut into the pieces between added tokens. Per round both strategies tokenize every
piece, in alternating order; the figure is the process's CPU time (all threads: the backend's
batch runs on its thread pool) per 1,000 tokens, and the ratio is taken round by round.
Before timing, every piece's ids and offsets are checked equal between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from ingest import BUDGET_OUTPUT_WORDS, write_real_episodes, write_synthetic_episodes  # noqa: E402
from sqlalchemy import text  # noqa: E402

from hcapo_store.ingestion.pipeline import ingest  # noqa: E402
from hcapo_store.rendering.ascii_bpe import AsciiBpe, encode_pieces  # noqa: E402
from hcapo_store.rendering.prompts import (  # noqa: E402
    HINDSIGHT_TEMPLATE,
    hindsight_text,
    inject_hindsight,
    normalize_messages,
)
from hcapo_store.rendering.segments import SegmentEncoder  # noqa: E402
from hcapo_store.rendering.template import render_chat  # noqa: E402
from hcapo_store.rendering.tokenizers import load_tokenizer  # noqa: E402
from hcapo_store.storage.episodes import load_episode  # noqa: E402
from hcapo_store.storage.store import Store  # noqa: E402


def conversations(tokenizer, kind: str, n: int) -> list[str]:
    """The whole renderings of ``n`` episodes of the input, hindsight block included."""
    root = Path(tempfile.mkdtemp(prefix="hcapo-bench-ascii-"))
    if kind == "budget":
        write_synthetic_episodes(root / "eps", n, output_words=BUDGET_OUTPUT_WORDS)
    else:
        write_real_episodes(root / "eps", n)
    store = Store.open(str(root / "bench.db"))
    ingest(store, [root / "eps"])
    out = []
    with store.engine.connect() as conn:
        for (episode_id,) in conn.execute(text("SELECT id FROM episodes WHERE is_current ORDER BY id")).all():
            e = load_episode(conn, episode_id)
            msgs = inject_hindsight(normalize_messages(e.messages), hindsight_text(e.outcome, {}, HINDSIGHT_TEMPLATE))
            out.append(render_chat(tokenizer, msgs, generation=False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=str(REPO.parent / "shared" / "tokenizers" / "qwen3"))
    ap.add_argument("--input", choices=["budget", "real"], default="budget")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    backend = tokenizer.backend_tokenizer
    fast, why_not = AsciiBpe.of(backend)
    if fast is None:
        sys.exit(f"the ASCII strategy is off for {args.tokenizer}: {why_not}")
    encoder = SegmentEncoder(tokenizer)  # cuts the renderings at added tokens, as offsets() does
    pieces = [p for t in conversations(tokenizer, args.input, args.episodes) for p in encoder._split(t)[0]]

    before = backend.encode_batch(pieces, add_special_tokens=False)
    after = encode_pieces(backend, fast, pieces)
    assert [(a.ids, a.offsets) for a in after] == [(b.ids, b.offsets) for b in before], "strategies differ"
    tokens = sum(len(e.ids) for e in before)
    ascii_chars = sum(len(p) for p in pieces if p.isascii())

    def run(strategy: str) -> float:
        t = time.process_time()
        if strategy == "before":
            encs = backend.encode_batch(pieces, add_special_tokens=False)
        else:
            encs = encode_pieces(backend, fast, pieces)
        sum(len(e.ids) for e in encs)  # what a placement reads of every piece: its ids
        return time.process_time() - t

    run("before"), run("after")  # warm-up (the strategy's memo fills here, as in a long run)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            times[side].append(run(side))
    per_k = {k: [1e6 * v / tokens for v in vs] for k, vs in times.items()}  # ms per 1k tokens
    ratios = [a / b for a, b in zip(times["after"], times["before"])]
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "input": args.input,
        "tokenizer": Path(args.tokenizer).name,
        "episodes": args.episodes,
        "pieces": len(pieces),
        "tokens": tokens,
        "ascii_share_of_characters": round(ascii_chars / max(sum(map(len, pieces)), 1), 4),
        "ms_per_1k_tokens_before": [round(min(per_k["before"]), 3), round(statistics.median(per_k["before"]), 3)],
        "ms_per_1k_tokens_after": [round(min(per_k["after"]), 3), round(statistics.median(per_k["after"]), 3)],
        "after_over_before_median": round(statistics.median(ratios), 3),
        "after_over_before_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for k, v in result.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
