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

``--other PYTHON:LIBRARY`` (repeatable) also measures another tokenizer library, installed in
its own virtual environment (``tokenizers`` of another release, e.g. ``pip install --pre
tokenizers``; ``fastokens``), on the same pieces: a child process of that Python loads the
same tokenizer.json, its ids and offsets are checked against the backend's piece by piece
(the count of pieces that differ is reported, nothing is timed for a library that differs
anywhere unless ``--time-anyway``), and each round it encodes every piece once, paired with
the same round of the other strategies (its own process CPU, per 1,000 tokens):

    python bench/ascii_bpe.py --input budget --other /tmp/tokpre/bin/python:tokenizers \
        --other /tmp/fastok/bin/python:fastokens
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
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


def tokenizers_version() -> str:
    from importlib.metadata import version

    return version("tokenizers")


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


# The child a library of another environment runs in: loads the tokenizer, writes every
# piece's ids and offsets, then encodes all pieces once per line read, printing its CPU time.
CHILD = r"""
import json, sys, time
library, tokenizer_file, pieces_file, out_file = sys.argv[1:5]
pieces = json.load(open(pieces_file))
if library == "tokenizers":
    import tokenizers
    tok, version = tokenizers.Tokenizer.from_file(tokenizer_file), tokenizers.__version__
elif library == "fastokens":
    import fastokens
    from importlib.metadata import version as v
    tok, version = fastokens.Tokenizer.from_file(tokenizer_file), v("fastokens")
else:
    sys.exit("unknown library " + library)
def run():
    return tok.encode_batch(pieces, add_special_tokens=False)
def offsets(e):  # tokenizers 1.0's Encoding has none; fastokens raises NotImplementedError
    try:
        return [list(o) for o in e.offsets]
    except (AttributeError, NotImplementedError):
        return None
json.dump([[list(e.ids), offsets(e)] for e in run()], open(out_file, "w"))
print(version, flush=True)
for line in sys.stdin:
    t = time.process_time()
    encs = run()
    sum(len(e.ids) for e in encs)
    print(time.process_time() - t, flush=True)
"""


class Other:
    """A tokenizer library in another environment, driven round by round (see the docstring)."""

    def __init__(self, spec: str, tokenizer_dir: str, pieces: list[str], expected: list) -> None:
        self.python, self.library = spec.rsplit(":", 1)
        root = Path(tempfile.mkdtemp(prefix="hcapo-bench-other-"))
        (root / "pieces.json").write_text(json.dumps(pieces))
        self.proc = subprocess.Popen(
            [self.python, "-c", CHILD, self.library, str(Path(tokenizer_dir) / "tokenizer.json"),
             str(root / "pieces.json"), str(root / "out.json")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.version = self.proc.stdout.readline().strip()
        got = json.loads((root / "out.json").read_text())
        self.differ_ids = sum(1 for g, e in zip(got, expected) if g[0] != e[0])
        self.differ_offsets = sum(1 for g, e in zip(got, expected) if g[1] is None or [tuple(o) for o in g[1]] != e[1])
        self.has_offsets = all(g[1] is not None for g in got)
        self.name = f"{self.library} {self.version}"

    def round(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=str(REPO.parent / "shared" / "tokenizers" / "qwen3"))
    ap.add_argument("--input", choices=["budget", "real"], default="budget")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--other", action="append", default=[], metavar="PYTHON:LIBRARY")
    ap.add_argument("--time-anyway", action="store_true", help="time another library even where it differs")
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

    expected = [(list(b.ids), [tuple(o) for o in b.offsets]) for b in before]
    others = {o.name: o for o in (Other(spec, args.tokenizer, pieces, expected) for spec in args.other)}
    timed = {name: o for name, o in others.items() if args.time_anyway or not (o.differ_ids or o.differ_offsets)}
    run("before"), run("after")  # warm-up (the strategy's memo fills here, as in a long run)
    for o in timed.values():
        o.round()
    times: dict[str, list[float]] = {"before": [], "after": [], **{name: [] for name in timed}}
    for r in range(args.rounds):
        sides = ["before", "after", *timed]
        for side in sides if r % 2 == 0 else sides[::-1]:
            times[side].append(timed[side].round() if side in timed else run(side))
    for o in others.values():
        o.close()
    per_k = {k: [1e6 * v / tokens for v in vs] for k, vs in times.items()}  # ms per 1k tokens
    ratios = [a / b for a, b in zip(times["after"], times["before"])]
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "input": args.input,
        "tokenizer": Path(args.tokenizer).name,
        "before": f"tokenizers {tokenizers_version()}",
        "episodes": args.episodes,
        "pieces": len(pieces),
        "tokens": tokens,
        "ascii_share_of_characters": round(ascii_chars / max(sum(map(len, pieces)), 1), 4),
        "ms_per_1k_tokens_before": [round(min(per_k["before"]), 3), round(statistics.median(per_k["before"]), 3)],
        "ms_per_1k_tokens_after": [round(min(per_k["after"]), 3), round(statistics.median(per_k["after"]), 3)],
        "after_over_before_median": round(statistics.median(ratios), 3),
        "after_over_before_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }
    for name, o in others.items():
        entry: dict = {
            "pieces_with_other_ids": o.differ_ids,
            "pieces_with_other_offsets": o.differ_offsets if o.has_offsets else "no offsets given",
        }
        if name in timed:
            mine = [a / b for a, b in zip(times[name], times["before"])]
            entry["ms_per_1k_tokens"] = [
                round(min(per_k[name]), 3),
                round(statistics.median(per_k[name]), 3),
            ]
            entry["over_before_median"] = round(statistics.median(mine), 3)
            entry["over_after_median"] = round(statistics.median(a / b for a, b in zip(times[name], times["after"])), 3)
        result[name] = entry
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for k, v in result.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
