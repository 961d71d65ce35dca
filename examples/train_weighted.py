"""Advantage-weighted fine-tuning on an ``export dataset --tokenized`` file, with TRL.

    hcapo-store export dataset train.jsonl --tokenized --tokenizer MODEL_DIR
    python examples/train_weighted.py train.jsonl --model MODEL_DIR --steps 3

It first checks that the rows were exported with this model's tokenizer and chat template
(the fingerprint in each row's provenance against the files in MODEL_DIR), then trains
``hcapo_store.training.trl_sft.WeightedSFTTrainer``: the loss of a batch is
``sum_t A_t * NLL_t`` over the credited tokens, divided by their number (``--normalize
tokens``) or by the sum of their advantages (``--normalize weights``, as the original
``train_hcapo.py``). With one batch of every row it is a smoke test of the data path, not a
training recipe. Needs ``pip install 'hcapo-store[trl]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
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
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=4096, help="cut rows to this many tokens")
    parser.add_argument("--normalize", choices=("tokens", "weights"), default="tokens")
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

    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=args.output_dir or tmp,
            max_steps=args.steps,
            per_device_train_batch_size=len(rows),
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
        try:  # the trainer refuses rows of another tokenizer before it loads the model
            trainer = WeightedSFTTrainer(
                args.model,
                args=config,
                train_dataset=Dataset.from_list(rows),
                processing_class=tokenizer,
                normalize=args.normalize,
            )
        except TrainingDataError as exc:
            sys.exit(f"{args.data}: {exc}")
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
