"""TRL's ``SFTTrainer`` with per-token advantages from a tokenized export.

    from hcapo_store.training.trl_sft import WeightedSFTTrainer, load_tokenized_export
    rows = load_tokenized_export("train.jsonl")
    trainer = WeightedSFTTrainer(model=MODEL_DIR, args=SFTConfig(output_dir="out"), train_dataset=rows)
    trainer.train()

Before training it checks that the rows were exported with the model's tokenizer and chat
template (the fingerprint in each row's provenance), then trains on ``labels`` weighted by
``advantages`` (``hcapo_store.training.loss.weighted_nll``). TRL's own dataset preparation
is skipped: it would cut ``input_ids``/``labels`` to ``max_length`` and leave the advantages
uncut; here the three are cut together (``SFTConfig.max_length``, ``truncation_mode``).
Packing and padding-free batches are refused (the advantages would need the same treatment).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from hcapo_store.errors import TrainingDataError
from hcapo_store.rendering.token_format import COLUMNS, IGNORE_INDEX
from hcapo_store.training.data import as_model_inputs, check_tokenizer, read_rows
from hcapo_store.training.loss import NORMALIZE, weighted_nll


def load_tokenized_export(path: str | Path) -> Dataset:
    """A tokenized export file as a ``datasets.Dataset`` (all its columns). Not named
    ``load_dataset``: that would shadow ``datasets.load_dataset`` in a trainer script."""
    return Dataset.from_list(read_rows(path))


class WeightedCollator:
    """Right-padded batches: pad id / label -100 / advantage 0 on padding."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of

        def pad(key: str, value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([list(e[key]) + [value] * (width - len(e[key])) for e in examples], dtype=dtype)

        return {
            "input_ids": pad("input_ids", self.pad_token_id, torch.long),
            "attention_mask": torch.tensor(
                [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples]
            ),
            "labels": pad("labels", IGNORE_INDEX, torch.long),
            "advantages": pad("advantages", 0.0, torch.float32),
        }


def negative_steps(dataset: Any) -> int:
    """Steps of a tokenized export with a negative advantage (``step_advantages``; rows without
    the column count each run of negative-advantage tokens as one step)."""
    columns = getattr(dataset, "column_names", None) or []
    if "step_advantages" in columns:
        return sum(1 for row in dataset["step_advantages"] for w in row if w < 0)
    count = 0
    for row in dataset["advantages"]:
        count += sum(1 for i, a in enumerate(row) if a < 0 and (i == 0 or row[i - 1] >= 0))
    return count


class WeightedSFTTrainer(SFTTrainer):
    """``SFTTrainer`` whose loss is the advantage-weighted NLL of a tokenized export.

    ``normalize``: ``tokens`` (divide by the number of trained tokens of the accumulated
    batch; right for signed advantages) or ``weights`` (divide by the sum of the advantages
    of each micro-batch, at least 1, as the original ``train_hcapo.py``). ``tokenizer_dir``: where the
    tokenizer's files are, when ``processing_class.name_or_path`` is not that directory.
    ``signed``: train on negative advantages too (unlikelihood on ``negative_steps`` steps);
    without it a dataset with one is refused (``TrainingDataError``).
    """

    def __init__(
        self,
        model: Any,
        args: SFTConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        *,
        normalize: str = "tokens",
        tokenizer_dir: str | Path | None = None,
        signed: bool = False,
        **kwargs: Any,
    ) -> None:
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}, not {normalize!r}")
        if train_dataset is None:
            raise ValueError("train_dataset is required: the rows of `export dataset --tokenized`")
        if "data_collator" in kwargs:
            raise ValueError("WeightedSFTTrainer brings its own collator (it pads the advantages too)")
        if args is None:
            args = SFTConfig(output_dir="hcapo-weighted-sft")
        if args.packing or args.padding_free:
            raise ValueError("packing and padding_free are not supported: the advantages would not follow the tokens")
        if processing_class is None:
            from transformers import AutoTokenizer

            if not isinstance(model, (str, Path)):
                raise ValueError("pass processing_class= (the tokenizer) with a model object")
            processing_class = AutoTokenizer.from_pretrained(str(model))
        if tokenizer_dir is None and isinstance(model, (str, Path)):
            tokenizer_dir = model
        datasets = {"train": train_dataset, **({"eval": eval_dataset} if eval_dataset is not None else {})}
        for ds in datasets.values():
            check_tokenizer(ds, processing_class, tokenizer_dir)
        # signed advantages (a paper run's) make negative weights: unlikelihood on those steps, whose
        # log-probabilities the loss pushes down without bound. A choice, never a default.
        self.negative_steps = sum(negative_steps(ds) for ds in datasets.values())
        if self.negative_steps and not signed:
            raise TrainingDataError(
                f"{self.negative_steps} step(s) have a negative advantage (a paper run's signed advantages): "
                "weighted SFT would push their log-probabilities down without bound; pass signed=True "
                "(train_weighted.py --signed) to train unlikelihood on them, or export an original run "
                "(Eq. 8 weights >= 0)"
            )
        self.signed = signed
        self.normalize = normalize
        self.truncated_tokens = 0  # trained tokens cut by max_length (reported once, never silent)
        prepared = {name: self._prepare(ds, args) for name, ds in datasets.items()}
        given = args.dataset_kwargs if isinstance(args.dataset_kwargs, dict) else {}
        args.dataset_kwargs = {**given, "skip_prepare_dataset": True}
        args.remove_unused_columns = False
        pad = processing_class.pad_token_id
        if pad is None:
            pad = processing_class.eos_token_id
        if not isinstance(pad, int):
            raise ValueError("the tokenizer has neither a pad nor an end-of-sequence token id")
        super().__init__(
            model,
            args=args,
            train_dataset=prepared["train"],
            eval_dataset=prepared.get("eval"),
            processing_class=processing_class,
            data_collator=WeightedCollator(
                pad, args.pad_to_multiple_of if isinstance(args.pad_to_multiple_of, int) else None
            ),
            **kwargs,
        )
        vocab = self.model.get_input_embeddings().num_embeddings
        top = max(max(ids) for ids in prepared["train"]["input_ids"])
        if top >= vocab:
            raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab}: another tokenizer's rows")
        if normalize == "weights":
            # a per-micro-batch denominator: the Trainer must average over accumulation steps itself
            self.model_accepts_loss_kwargs = False

    def _prepare(self, dataset: Dataset, args: SFTConfig) -> Dataset:
        keep = "start" if args.truncation_mode == "keep_start" else "end"
        rows, cut = [], 0
        for row in dataset:
            inputs = as_model_inputs(row, args.max_length, keep)
            cut += sum(1 for x in row["labels"] if x != IGNORE_INDEX) - sum(
                1 for x in inputs["labels"] if x != IGNORE_INDEX
            )
            if any(x != IGNORE_INDEX for x in inputs["labels"]):
                rows.append(inputs)
        if cut:
            import warnings

            warnings.warn(
                f"max_length={args.max_length} cut {cut} trained tokens (truncation_mode={args.truncation_mode}); "
                "raise max_length to train on every credited step",
                stacklevel=3,
            )
        self.truncated_tokens += cut
        if not rows:
            raise ValueError(f"no row keeps a trained token within max_length={args.max_length}")
        return Dataset.from_list(rows)

    def compute_loss(
        self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs["labels"]
        advantages = inputs["advantages"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        loss = weighted_nll(
            outputs.logits,
            labels,
            advantages,
            normalize=self.normalize,
            num_items=num_items_in_batch if self.normalize == "tokens" else None,
        )
        if (
            self.args.average_tokens_across_devices
            and self.model_accepts_loss_kwargs
            and num_items_in_batch is not None
        ):
            loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss: gradients are averaged later
        return (loss, outputs) if return_outputs else loss


__all__ = ["COLUMNS", "WeightedCollator", "WeightedSFTTrainer", "load_tokenized_export"]
