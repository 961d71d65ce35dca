"""Advantage-weighted NLL over an ``export dataset --tokenized`` file, in plain PyTorch.

    hcapo-store export dataset train.jsonl --tokenized --tokenizer MODEL_DIR --credits default
    python examples/train_weighted.py train.jsonl --model MODEL_DIR --steps 3

The loss of one batch is ``sum_t A_t * NLL_t / (number of weighted tokens)`` where ``A_t`` is
the row's per-token ``advantages`` (each credited step's Eq. 8 weight on its action tokens)
and ``NLL_t`` the token's negative log-likelihood; tokens whose label is -100 add nothing.
This repeats the step on one batch (a smoke test of the data path, not a training recipe).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

IGNORE_INDEX = -100


def load_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=["input_ids", "labels", "advantages"]).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collate(rows: list[dict], pad_id: int, max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded tensors; padding gets label -100 and advantage 0."""
    rows = [{k: r[k][:max_length] for k in ("input_ids", "labels", "advantages")} for r in rows]
    width = max(len(r["input_ids"]) for r in rows)

    def pad(key: str, value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r[key] + [value] * (width - len(r[key])) for r in rows], dtype=dtype)

    ids = pad("input_ids", pad_id, torch.long)
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": pad("labels", IGNORE_INDEX, torch.long),
        "advantages": pad("advantages", 0.0, torch.float32),
    }


def weighted_nll(logits: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Token t is predicted from position t - 1: shift, weight, average over weighted tokens."""
    logits, labels, adv = logits[:, :-1], labels[:, 1:], advantages[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(adv)
    weighted = labels != IGNORE_INDEX
    return (nll * adv * weighted).sum() / weighted.sum().clamp(min=1)


def train(
    rows: list[dict], model_dir: str, *, steps: int, lr: float, max_length: int | None, seed: int = 0
) -> list[float]:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batch = collate(rows, pad_id, max_length)
    if int(batch["input_ids"].max()) >= model.config.vocab_size:
        raise SystemExit("token ids exceed the model's vocabulary: export with this model's tokenizer")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = weighted_nll(out.logits, batch["labels"], batch["advantages"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="an `export dataset --tokenized` file (.jsonl or .parquet)")
    parser.add_argument("--model", required=True, help="model directory (the scorer's tokenizer vocabulary)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=1024, help="truncate rows to this many tokens")
    parser.add_argument("--json", action="store_true", help="print the losses as JSON")
    args = parser.parse_args()
    rows = load_rows(args.data)[: args.batch_size]
    if not rows:
        raise SystemExit(f"{args.data}: no rows")
    losses = train(rows, args.model, steps=args.steps, lr=args.lr, max_length=args.max_length)
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"loss is not finite: {losses}")
    if args.json:
        print(json.dumps({"rows": len(rows), "losses": losses}))
    else:
        for i, loss in enumerate(losses):
            print(f"step {i}: weighted NLL {loss:.4f}")


if __name__ == "__main__":
    main()
