"""Advantage-weighted fine-tuning on an ``export dataset --tokenized`` file, with TRL.

    hcapo-store export dataset train.jsonl --tokenized --tokenizer MODEL_DIR
    python examples/train_weighted.py train.jsonl --model MODEL_DIR --steps 3

It first checks that the rows were exported with this model's tokenizer and chat template
(the fingerprint in each row's provenance against the files in MODEL_DIR), then trains
``hcapo_store.training.trl_sft.WeightedSFTTrainer``: the loss of a batch is
``sum_t A_t * NLL_t`` over the credited tokens, divided by their number (``--normalize
tokens``) or by the sum of their advantages (``--normalize weights``, as the original
``train_hcapo.py``). With one batch of every row it is a smoke test of the data path, not a
training recipe. The defaults fit a CPU with a 151k vocabulary (Qwen's): rows of at most 1024
tokens, one row per forward pass (``--micro-batch-size``), the batch accumulated over them.
Negative advantages (a ``paper`` run's signed ones) are refused unless ``--signed``: then it
says "unlikelihood on N steps", as the loss pushes those steps' log-probabilities down.
Needs ``pip install 'hcapo-store[trl]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

from trl import SFTConfig

from hcapo_store.errors import TrainingDataError
from hcapo_store.training.data import read_rows, rows_fingerprint
from hcapo_store.training.trl_sft import WeightedSFTTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="an `export dataset --tokenized` file (.jsonl or .parquet)")
    parser.add_argument("--model", required=True, help="model directory (its tokenizer must be the scorer's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per batch (and rows used)")
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="rows per forward pass (the batch is accumulated over them): with a 151k vocabulary one row of "
        "1024 tokens already holds 0.6 GB of logits",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=1024, help="cut rows to this many tokens")
    parser.add_argument("--normalize", choices=("tokens", "weights"), default="tokens")
    parser.add_argument(
        "--signed",
        action="store_true",
        help="train on negative advantages too (a paper run's signed ones): unlikelihood on those steps, "
        "refused without this flag",
    )
    parser.add_argument("--output-dir", default=None, help="checkpoints (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the losses as JSON")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    rows = read_rows(args.data)[: args.batch_size]
    if not rows:
        sys.exit(f"{args.data}: no rows")
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    import tempfile

    from datasets import Dataset

    micro = max(1, min(args.micro_batch_size, len(rows)))
    if len(rows) % micro:
        sys.exit(f"--micro-batch-size {micro} must divide the {len(rows)} row(s) of a batch")
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=args.output_dir or tmp,
            max_steps=args.steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=len(rows) // micro,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            max_length=args.max_length,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            shuffle_dataset=False,
            disable_tqdm=args.json,
        )
        try:  # the trainer refuses rows of another tokenizer (or signed ones) before it loads the model
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UserWarning)
                trainer = WeightedSFTTrainer(
                    args.model,
                    args=config,
                    train_dataset=Dataset.from_list(rows),
                    processing_class=tokenizer,
                    normalize=args.normalize,
                    signed=args.signed,
                )
        except TrainingDataError as exc:
            sys.exit(f"{args.data}: {exc}")
        except ValueError as exc:  # e.g. a --max-length that keeps no trained token: one line
            sys.exit(f"{args.data}: {exc}".replace("max_length=", "--max-length "))
        for w in caught:  # e.g. "--max-length cut N trained tokens": one line each, on stderr
            if "max_length" in str(w.message):
                print(f"warning: {w.message}".replace("max_length=", "--max-length "), file=sys.stderr)
        if trainer.negative_steps:
            print(f"--signed: unlikelihood on {trainer.negative_steps} steps (negative advantages)", file=sys.stderr)
        if not args.json:
            name = rows_fingerprint(rows)["tokenizer"]
            print(f"rows: {len(rows)}, exported with tokenizer {name!r} = the model's ({args.model})")
        if args.json:  # stdout is the JSON alone
            from transformers import PrinterCallback

            trainer.remove_callback(PrinterCallback)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if not all(math.isfinite(x) for x in losses):
        sys.exit(f"loss is not finite: {losses}")
    if args.json:
        print(json.dumps({"rows": len(rows), "losses": losses, "truncated_tokens": trainer.truncated_tokens}))
    else:
        for i, loss in enumerate(losses):
            print(f"step {i}: weighted NLL {loss:.4f}")


if __name__ == "__main__":
    main()
