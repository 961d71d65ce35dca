"""The TRL hand-off's placements alone: ``Handoff.advantages`` over a GRPO group's stored rows, as
``StoreAdvantages`` places them (each row TRL's ids: the prompt through the chat template with
``enable_thinking=False`` and the generation prompt, then the completion and its end token; with
Qwen3 such a row equals neither rendering, so every row is placed by search).

The rows come from a work folder of ``bench/hindsight_pass.py`` (it prints ``work: DIR``): its
store holds each call's batch, ingested, scored and credited. A fresh ``Handoff`` per credit run,
its episodes read first (as ``StoreAdvantages`` prefetches them); then each row placed, timed::

    python bench/hindsight_pass.py --layout episode --profile 0       # prints work: DIR
    python bench/handoff_rows.py DIR --repeats 5
    PYTHONPATH=/tmp/before python bench/handoff_rows.py DIR            # a checkout to compare with

Prints the median milliseconds per row (and the fastest round's) over every run and repeat."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "qwen3"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", help="a bench/hindsight_pass.py work folder (its store.db)")
    p.add_argument("--repeats", type=int, default=5, help="rounds over every credit run: 5")
    p.add_argument("--tokenizer", default=str(SHARED_TOKENIZER), help="the Qwen3 tokenizer directory")
    args = p.parse_args()

    from sqlalchemy import text
    from transformers import AutoTokenizer

    import hcapo_store
    from hcapo_store.storage.store import Store
    from hcapo_store.training.handoff import Handoff

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    per_round: list[float] = []
    with Store.open(str(Path(args.work) / "store.db")) as store:
        with store.engine.connect() as conn:
            runs = [r[0] for r in conn.execute(text("SELECT name FROM credit_runs ORDER BY id"))]
        rows: dict[str, list[tuple[int, list[int]]]] = {}
        for run in runs:  # TRL's ids of each row, made once
            h = Handoff(store, run, tokenizer=args.tokenizer, allow_zero_hindsight=True, loaded_tokenizer=tok)
            rows[run] = []
            for ep in h._names:
                messages = h._episode(ep)[0]
                prompt = tok.apply_chat_template(
                    messages[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=False
                )
                completion = tok(messages[-1]["content"], add_special_tokens=False)["input_ids"]
                rows[run].append(
                    (ep, [*tok(prompt, add_special_tokens=False)["input_ids"], *completion, tok.eos_token_id])
                )
        for _ in range(args.repeats):
            for run in runs:
                h = Handoff(store, run, tokenizer=args.tokenizer, allow_zero_hindsight=True, loaded_tokenizer=tok)
                h.prefetch(ep for ep, _ in rows[run])
                t = time.perf_counter()
                for ep, ids in rows[run]:
                    h.advantages(ep, ids, strict=False)
                per_round.append((time.perf_counter() - t) / len(rows[run]) * 1e3)
    print(
        f"{Path(hcapo_store.__file__).parent}: {len(per_round)} rounds of {len(rows[runs[0]])} rows: "
        f"median {statistics.median(per_round):.1f} ms per row, fastest round {min(per_round):.1f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
