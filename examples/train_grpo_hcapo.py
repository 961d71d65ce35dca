"""HCAPO inside TRL's GRPOTrainer, on a CPU: each step's rollouts go through the store.

    python examples/train_grpo_hcapo.py --steps 3            # a tiny Qwen3 built here
    python examples/train_grpo_hcapo.py --model DIR --steps 1

Per training step TRL generates ``--group-size`` completions per prompt and rewards them;
``StoreAdvantages`` then adds them to the store (``--workdir``/hcapo.db), scores them with the
policy itself at that step's weights, computes the batch's HCAPO credits per GRPO group (the
paper's estimator) and hands back one advantage per completion token, which
``HCAPOGRPOTrainer`` trains on instead of GRPO's one-per-completion advantage
(``--advantages grpo``: TRL's own advantage instead, the same training as a plain GRPOTrainer).

The toy task: write signs; the reward is the number of ``!`` in the completion. Each prompt
holds an earlier turn of the agent, so an episode has two steps (HCAPO's hindsight ratio compares
an episode's own steps: single-turn episodes have none to compare, and the store refuses them as
plain GRPO). With no model given, the policy is a randomly initialised 2-layer Qwen3 on the demo
tokenizer, writing only a few signs that re-tokenize to themselves (``--signs``), so the store's
rendering of a completion is the policy's own ids. ``--json`` prints one object per step. Needs ``pip install
'hcapo-store[trl]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig

from hcapo_store.errors import HcapoError
from hcapo_store.storage.store import Store
from hcapo_store.training.trl_grpo import HCAPOGRPOTrainer, StoreAdvantages, trl_advantages


def tiny_qwen3(tok, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return Qwen3ForCausalLM(config).float()


def bangs(completions: list, **_: object) -> list[float]:
    return [float(c[0]["content"].count("!")) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny Qwen3 on the demo tokenizer)")
    parser.add_argument("--workdir", type=Path, help="store and rollouts (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt (GRPO's num_generations)")
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--signs", default="!#$%(+", help="the tiny model writes only these (and its end token)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--advantages",
        choices=("hcapo", "grpo"),
        default="hcapo",
        help="hcapo: the store's per-token credits; grpo: TRL's own advantage on every token (the yardstick)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="hcapo-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    generation: dict = {}
    if args.model is None:
        from hcapo_store.devkit.tiny_model import build_demo_tokenizer

        tokenizer_dir = build_demo_tokenizer(work / "tokenizer")
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        model = tiny_qwen3(tok, args.seed)
        keep = {tok.convert_tokens_to_ids(c) for c in args.signs} | {tok.eos_token_id}
        generation = {"suppress_tokens": [t for t in range(len(tok)) if t not in keep]}
    else:
        tokenizer_dir = Path(args.model)
        tok = AutoTokenizer.from_pretrained(args.model)
        model = args.model
    config = GRPOConfig(
        output_dir=str(work / "out"),
        max_steps=args.steps,
        per_device_train_batch_size=args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_completion_length,
        mask_truncated_completions=True,  # a cut completion has no end-of-turn token the store could place
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=args.json,
        generation_kwargs=generation or None,
    )
    # An earlier turn of the agent sits in each prompt, so every episode has two steps: HCAPO's
    # ratio is over an episode's own steps, and on one-step (single-turn) episodes it is 1, the
    # hindsight scores reaching no advantage (the store refuses such a batch as plain GRPO).
    conversation = [
        {"role": "user", "content": "Write some signs."},
        {"role": "assistant", "content": args.signs[:2] * 2},
        {"role": "user", "content": "More."},
    ]
    prompts = Dataset.from_list([{"prompt": conversation}] * (4 * args.steps))
    with Store.open(str(work / "hcapo.db")) as store:
        hcapo = StoreAdvantages(store, tokenizer=tokenizer_dir, workdir=work / "rollouts")
        trainer = HCAPOGRPOTrainer(
            model=model,
            reward_funcs=bangs,
            args=config,
            train_dataset=prompts,
            processing_class=tok,
            advantages=hcapo if args.advantages == "hcapo" else trl_advantages,
        )
        if args.json:
            from transformers import PrinterCallback

            trainer.remove_callback(PrinterCallback)
        try:
            trainer.train()
        except HcapoError as exc:
            sys.exit(f"hcapo: {exc}")
        logs = [h for h in trainer.state.log_history if "loss" in h]
        for step, log in enumerate(logs):
            result = {
                "step": step,
                "credit_run": hcapo.runs.get(step),
                "scorer_id": hcapo.scorers.get(step),
                "loss": log["loss"],
                "reward": log.get("reward"),
                "advantage_abs_max": log.get("hcapo/advantage_abs_max"),
                "skipped": sum(1 for s, _ in hcapo.skipped if s == step),  # rows left at 0, and why: hcapo.skipped
                "skipped_logged": log.get("hcapo/skipped_rows"),  # what the trainer logged of them
                "step_seconds": log.get("step_time"),  # TRL's: generation, rewards, advantages, update
                "advantages_seconds": log.get("hcapo/advantages_seconds"),  # of which the advantage source
            }
            signal = hcapo.signals.get(step)  # whether HCAPO's hindsight term is in this step's advantages
            if signal is not None:
                result |= {
                    "steps": signal.steps,
                    "hindsight_nonzero_steps": signal.hindsight_nonzero_steps,
                    "ratio_varying_steps": signal.ratio_varying_steps,  # where the hindsight scores reach
                    "varying_episodes": signal.varying_episodes,
                    "advantage_spread": signal.advantage_spread,
                    "signal": signal.text(),
                }
            if not math.isfinite(result["loss"]):
                sys.exit(f"step {step}: the loss is not finite: {result['loss']}")
            if args.json:
                print(json.dumps(result))
            else:
                print(
                    f"step {step}: credit run {result['credit_run']}, reward {result['reward']:.2f}, "
                    f"loss {result['loss']:.4f}, |advantage| <= {result['advantage_abs_max']}; "
                    f"{result.get('signal', 'hindsight term: not measured')}"
                )


if __name__ == "__main__":
    from hcapo_store import worker_processes

    # On a GPU, score_live prepares in worker processes: they fork with transformers loaded.
    # The forkserver's list is the application's to set; the library leaves it alone.
    worker_processes.preload(worker_processes.PREPARE)  # the hook ingests in process (jobs=1)
    main()
