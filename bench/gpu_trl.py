"""The trainer's share: one TRL GRPO step with the store's advantages, and the hindsight pass's
part of it (issue 43, item 4), beside the paper's 8.3 % of an iteration (docs/PAPER.md).

    bash bench/gpu_wheels.sh --trl            # here: .gpu/wheels (TRL's too) and .gpu/qwen3.tar.gz (carry .gpu)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hcapo/site-packages .gpu/wheels/*.whl
    export PYTHONPATH=/tmp/hcapo/site-packages  # a folder named site-packages: see below
    PYTHONUNBUFFERED=1 python3 bench/gpu_trl.py --out "$OUT/trl.json"
    python bench/gpu_trl.py --size tiny --out /tmp/trl.json   # the CPU check (tests)

The policy: a random-weight Qwen3-0.6B shape (``--shape 1.7b``: the 1.7B), bf16 on the GPU, built
as bench/gpu.py builds it. The prompt: a synthetic 99-step episode (``EpisodeBuilder(...).standard(
steps_per_subtask=22)``, as bench/gpu.py's) up to its last assistant turn, as a conversational
prompt (~9k Qwen3 tokens); TRL's ``HCAPOGRPOTrainer`` generates ``--rollouts`` (8) completions of it
(one GRPO group; the policy may write only digits and its end token, which re-tokenize to
themselves: a random policy's text would not; every other row of its embedding, the ids past the
tokenizer's included, is suppressed), rewards them (the sum of the digits), and asks
``StoreAdvantages`` for per-token advantages: the rollouts written and ingested (``ingest``), scored
by the policy itself (``score_live``), credited (``compute_credits``) and handed back (``Handoff``).
``mask_truncated_completions``: a completion cut at ``--max-completion-length`` has no end token,
so the store's rendering of it (which ends its turn) is not the policy's ids: only completions that
ended are trained (with 11 tokens allowed, ~95 % of 32-token completions end).

Per ``--layouts`` entry (the prompt layout ``score_live`` is called with: StoreAdvantages calls it
with the library's default, ``per-step``; this script's timer around it passes the step's layout)
two steps: a warm-up (``warm_up``: kernels, and the preparing processes, which scoring ends when the
layout changes) and the measured one (``--no-warm-up``: the measured one only, as the CPU check runs). Per step:
the step's wall time (a trainer callback, the GPU synchronised), TRL's generate-and-score part
(generation, rewards and the advantage source), the advantage source, and in it ``ingest``,
``score_live``, ``compute_credits`` and the hand-off (the rest of the source: writing the
rollouts' files, the Handoff's tokenizer load, reads and placements); ``hindsight_share`` =
(score_live + credits + hand-off) / step, beside ``paper_hindsight_share`` 0.083, and
``with_ingest_share`` adding the store's writes. And the signal that reached the trainer (the
project's rule: zero signal is a failure, not a pass): ``trained_rows`` (completions the loss
trains), ``reward_std`` (TRL's, within the group), and from the trainer's own log
``advantage_abs_max`` / ``advantage_mean`` over the trained tokens and ``hindsight_nonzero_share``
(the share of the batch's credited steps whose hindsight term is non-zero); a step whose
``advantage_abs_max`` or ``hindsight_nonzero_share`` is 0 is named in ``zero_signal_steps`` and
makes the run's ``error``.

The site folder's name matters: ``datasets`` (which TRL imports) hashes with ``dill``, which
pickles by value any module outside a ``site-packages`` folder, and then fails on pyarrow's types.
bench/gpu_wheels.sh --trl brings TRL, accelerate, datasets, pyarrow and pandas wheels for
CPython 3.12 (pyarrow without its Flight and S3 libraries, pandas without its tests: the carried
folder stays under 60 MiB).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_common as common

PAPER_HINDSIGHT_SHARE = 0.083  # docs/PAPER.md: hindsight scoring, 8.3 % of an iteration


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    out, device, doc = common.start(args, "gpu_trl", "trl.json")
    doc.update(
        shape="tiny" if args.size == "tiny" else args.shape,
        rollouts=args.rollouts,
        warm_up=args.warm_up,
        paper_hindsight_share=PAPER_HINDSIGHT_SHARE,
        steps=[],
    )

    def flush(what: str) -> None:
        common.save(out, doc)
        print(f"[{time.monotonic() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    flush("start")
    try:
        run(args, device, doc, flush)
    except Exception as exc:  # what was measured stays in the JSON, with the error
        doc["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        doc["traceback"] = traceback.format_exc()[-4000:]
    doc["seconds"] = round(time.monotonic() - started, 1)
    doc["summary"] = summary(doc)
    common.save(out, doc)
    for line in doc["summary"]:
        print(line, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    common.add_common_args(p, out="trl.json", budget_s=300.0)
    p.add_argument("--shape", choices=["0.6b", "1.7b"], default="0.6b", help="the policy's Qwen3 shape")
    p.add_argument("--rollouts", type=int, default=8, help="completions of the prompt (one GRPO group)")
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--layouts", nargs="+", default=["per-step", "episode"], choices=["per-step", "episode"],
                   help="score_live's prompt layout, one measured step each (after its own warm-up step)")  # fmt: skip
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="no warm-up step before each layout's measured one (the CPU check: nothing to warm)")  # fmt: skip
    args = p.parse_args()
    if args.size == "tiny":
        args.steps_per_subtask = min(args.steps_per_subtask, 1)
        # the CPU: TRL's log-probabilities over the vocabulary at every prompt position, per rollout (its main
        # cost); completions as long as the GPU's: ~95 % end (see above), and they cost little beside the prompt
        args.rollouts = min(args.rollouts, 2)
    args.tokenizer = common.resolve_tokenizer(p, args.tokenizer)
    return args


class Timers:
    """Seconds of the wrapped functions, per training step (``step`` is set by the callback)."""

    def __init__(self) -> None:
        self.step = 0
        self.in_source = False  # inside the advantage source (watch_gc)
        self.seconds: dict[int, dict[str, float]] = {}
        self.rows: dict[int, dict[str, int]] = {}  # step -> the batch's rows and the rows the loss trains

    def add(self, name: str, seconds: float) -> None:
        row = self.seconds.setdefault(self.step, {})
        row[name] = row.get(name, 0.0) + seconds

    def watch_gc(self) -> None:
        """The garbage collector's pauses inside the advantage source, as ``gc_in_advantages``
        (a full collection over a trainer's objects can take a large part of a second)."""
        import gc

        started: list[float] = []

        def pause(phase: str, _info: dict[str, Any]) -> None:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started and self.in_source:
                self.add("gc_in_advantages", time.perf_counter() - started[0])

        gc.callbacks.append(pause)

    def wrap(self, owner: Any, attribute: str, name: str, before: Any = None) -> None:
        """Time ``owner.attribute`` (a module function or a bound method), as ``name``."""
        inner = getattr(owner, attribute)

        @functools.wraps(inner)
        def timed(*a: Any, **kw: Any) -> Any:
            if before is not None:
                kw = before(kw)
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t)

        setattr(owner, attribute, timed)


def run(args: argparse.Namespace, device: Any, doc: dict[str, Any], flush: Any) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    import hcapo_store.credits.compute as credits_module
    import hcapo_store.ingestion.pipeline as ingest_module
    import hcapo_store.scoring.live as live_module
    import hcapo_store.training.handoff as handoff_module
    import hcapo_store.training.trl_grpo as trl_module
    from hcapo_store.storage.store import Store
    from hcapo_store.training.trl_grpo import HCAPOGRPOTrainer, StoreAdvantages

    tiny = args.size == "tiny"
    work = Path(tempfile.mkdtemp(prefix="hcapo-trl-"))
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    prompt, steps = common.episode_prompt(work, args.steps_per_subtask, args.size == "tiny")
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    doc["prompt"] = {"messages": len(prompt), "tokens": len(prompt_ids), "episode_steps": steps}
    flush(f"prompt: {doc['prompt']}")

    t = time.perf_counter()
    vocab = max(common.VOCAB, len(tok)) if not tiny else -(-len(tok) // 64) * 64
    model = common.build_model(
        "tiny" if tiny else args.shape, vocab, device, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    if tiny:
        model = model.float()  # the CPU trains in float32
    model.train()
    common.sync(device)
    doc["build_s"] = round(time.perf_counter() - t, 2)
    doc["parameters"] = sum(p.numel() for p in model.parameters())
    flush("policy built")

    timers = Timers()
    kinds = ("warm-up", "measured") if args.warm_up else ("measured",)
    layouts = [layout for layout in args.layouts for _ in kinds]

    def layout_of_step(kw: dict[str, Any]) -> dict[str, Any]:
        return {**kw, "prompt_layout": layouts[min(timers.step, len(layouts) - 1)]}

    timers.wrap(live_module, "score_live", "score_live", before=layout_of_step)
    timers.wrap(credits_module, "compute_credits", "credits")
    timers.wrap(ingest_module, "ingest", "ingest")
    # the hand-off's parts (its figure is the source's rest): the rollouts' files, the Handoff's
    # opening, the rows' placements; and the garbage collector's pauses inside the source
    timers.wrap(trl_module.StoreAdvantages, "_write", "handoff.write_jsonl")
    timers.wrap(handoff_module.Handoff, "__init__", "handoff.open")
    timers.wrap(trl_module.HandoffAdvantages, "row", "handoff.rows")
    timers.watch_gc()

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            common.sync(device)
            self.t = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            common.sync(device)
            timers.add("step", time.perf_counter() - self.t)
            timers.step += 1
            if made:  # the steps so far in the JSON: a run stopped at its time limit keeps them
                record_steps(made[0])
            flush(f"step {timers.step - 1} done ({layouts[min(timers.step - 1, len(layouts) - 1)]})")

        def on_log(self, *_: Any, logs: dict[str, Any] | None = None, **__: Any) -> None:
            if logs and "reward_std" in logs:  # the step just ended (logging_steps=1): what reached the trainer
                if made:
                    record_steps(made[0])
                flush(f"step {timers.step - 1} signal: {trainer_signal(logs)} {timers.rows.get(timers.step - 1)}")

    # every other id suppressed, up to the model's embedding rows: the 0.6B's 151,936 rows past the
    # tokenizer's 151,669 ids decode to nothing (a completion of them is empty, or not its ids re-tokenized)
    digits = {tok.convert_tokens_to_ids(c) for c in "0123456789"} | {tok.eos_token_id}
    rows = model.get_output_embeddings().weight.shape[0]
    config = GRPOConfig(
        output_dir=str(work / "out"),
        use_cpu=tiny,
        bf16=not tiny,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=args.rollouts,
        num_generations=args.rollouts,
        max_completion_length=args.max_completion_length,
        max_steps=len(layouts),
        logging_steps=1,
        disable_tqdm=True,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        mask_truncated_completions=True,
        seed=0,
        chat_template_kwargs={"enable_thinking": False},
        generation_kwargs={"suppress_tokens": [i for i in range(rows) if i not in digits]},
    )
    made: list[Any] = []  # the trainer, once made

    def record_steps(trainer: Any) -> None:
        """doc["steps"]: a row per step ended so far (its timers, refusals, shares and what reached
        the trainer, as far as the trainer has logged it)."""
        logged = {int(e["step"]) - 1: e for e in trainer.state.log_history if "reward_std" in e}
        doc["steps"] = []
        for step in range(timers.step):
            warm_up = args.warm_up and step % 2 == 0
            row: dict[str, Any] = {"index": step, "warm_up": warm_up, "layout": layouts[step]}
            row.update({k: round(v, 4) for k, v in timers.seconds.get(step, {}).items()})
            row["refused_rows"] = sum(1 for s, _ in source.refused if s == step)
            row["skipped_rows"] = sum(1 for s, _ in source.skipped if s == step)
            shares(row)
            row.update(timers.rows.get(step, {}))
            row.update(trainer_signal(logged.get(step, {})))
            doc["steps"].append(row)

    with Store.open(str(work / "store.db")) as store:
        source = StoreAdvantages(
            store, tokenizer=args.tokenizer, workdir=work / "rollouts", run_id="bench", strict=False,
            allow_zero_hindsight=True,
        )  # fmt: skip
        trainer = HCAPOGRPOTrainer(
            model=model,
            reward_funcs=digit_sum,
            args=config,
            train_dataset=Dataset.from_list([{"prompt": prompt}] * len(layouts)),
            processing_class=tok,
            advantages=TimedSource(timers, source, lambda: common.sync(device)),
            callbacks=[StepClock()],
        )
        timers.wrap(trainer, "_generate_and_score_completions", "generate_and_score")
        made.append(trainer)
        flush("trainer made")
        trainer.train()
        record_steps(trainer)
        doc["scorers"] = {str(step): sid for step, sid in source.scorers.items()}
        zero = [r["index"] for r in doc["steps"] if not (r["advantage_abs_max"] and r["hindsight_nonzero_share"])]
        if zero:
            doc["zero_signal_steps"] = zero
            doc["error"] = (
                f"no hindsight signal reached the trainer on step(s) {zero} (advantage_abs_max or "
                "hindsight_nonzero_share 0): zero signal is a failure, not a pass"
            )
    if device.type == "cuda":
        doc["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)


def digit_sum(completions: list[Any], **_: Any) -> list[float]:
    """The sum of a completion's digits: a random policy's completions almost never tie (the count
    of one digit did at the tiny run's lengths: all zero, no advantage to place)."""
    return [float(sum(int(ch) for ch in c[0]["content"] if ch.isdigit())) for c in completions]


class TimedSource:
    """``source`` (StoreAdvantages) timed as ``advantages``, with the rows the loss trains per step;
    its ``signals`` and ``last_signal`` are the source's own (the trainer logs
    ``hcapo/hindsight_nonzero_share`` from them: a bare function in its place would hide them)."""

    def __init__(self, timers: Timers, source: Any, sync: Any = None) -> None:
        self.timers, self.source, self.sync = timers, source, sync
        self.signals = source.signals

    @property
    def last_signal(self) -> Any:
        """The last batch's signal (what the trainer logs), the source's own."""
        return self.source.last_signal

    def __call__(self, batch: Any) -> Any:
        self.timers.rows[self.timers.step] = {
            "rows": len(batch.completion_ids),
            "trained_rows": sum(1 for mask in batch.loss_mask if any(mask)),
        }
        if self.sync is not None:  # the GPU's queued work (TRL's) waited for here, not inside the source
            t = time.perf_counter()
            self.sync()
            self.timers.add("gpu_wait_before_advantages", time.perf_counter() - t)
        t = time.perf_counter()
        self.timers.in_source = True
        try:
            return self.source(batch)
        finally:
            self.timers.in_source = False
            self.timers.add("advantages", time.perf_counter() - t)


def trainer_signal(logged: dict[str, Any]) -> dict[str, Any]:
    """What reached the trainer on a step, from its log: the advantages on the trained tokens (0
    when no token was trained) and the hindsight term's non-zero share (0 when not logged)."""

    def number(key: str) -> float:
        value = logged.get(key)
        return 0.0 if value is None else round(float(value), 6)

    return {
        "reward_std": number("reward_std"),
        "clipped_ratio": number("completions/clipped_ratio"),
        "advantage_abs_max": number("hcapo/advantage_abs_max"),
        "advantage_mean": number("hcapo/advantage_mean"),
        "hindsight_nonzero_share": number("hcapo/hindsight_nonzero_share"),
    }


def shares(row: dict[str, Any]) -> None:
    """The hindsight pass (score_live + credits + hand-off) and its parts over the step."""
    if "step" not in row or "advantages" not in row:
        return
    inside = row.get("ingest", 0.0) + row.get("score_live", 0.0) + row.get("credits", 0.0)
    row["handoff"] = round(max(row["advantages"] - inside, 0.0), 4)  # the source's rest: write, Handoff
    parts = sum(row.get(k, 0.0) for k in ("handoff.write_jsonl", "handoff.open", "handoff.rows"))
    if parts:  # the rest of the rest: the source's reads, signal, batching (and what the timers missed)
        row["handoff.other"] = round(max(row["handoff"] - parts, 0.0), 4)
    hindsight = row.get("score_live", 0.0) + row.get("credits", 0.0) + row["handoff"]
    step = row["step_s"] = row.pop("step")
    row["hindsight_s"] = round(hindsight, 4)
    row["hindsight_share"] = round(hindsight / step, 4)
    row["with_ingest_share"] = round((hindsight + row.get("ingest", 0.0)) / step, 4)
    if "generate_and_score" in row:
        row["generation_and_rewards_share"] = round((row["generate_and_score"] - row["advantages"]) / step, 4)
        row["update_share"] = round((step - row["generate_and_score"]) / step, 4)


def summary(doc: dict[str, Any]) -> list[str]:
    lines = []
    for row in doc.get("steps", []):
        if "advantage_abs_max" in row:
            lines.append(
                f"{doc['shape']} step {row['index']} ({row['layout']}{', warm-up' if row['warm_up'] else ''}): "
                f"signal: advantage_abs_max {row['advantage_abs_max']:.4g}, advantage_mean {row['advantage_mean']:.4g}, "
                f"hindsight_nonzero_share {row['hindsight_nonzero_share']:.3g} over {row.get('trained_rows', 0)} "
                f"trained of {row.get('rows', 0)} rows (reward_std {row['reward_std']:.3g}, refused "
                f"{row['refused_rows']}, skipped {row['skipped_rows']})"
            )
        if row.get("warm_up") or "hindsight_share" not in row:
            continue
        lines.append(
            f"{doc['shape']} {row['layout']}: step {row['step_s']:.2f} s, hindsight {row['hindsight_s']:.2f} s"
            f" = {row['hindsight_share']:.1%} of the step (paper {PAPER_HINDSIGHT_SHARE:.1%}); score_live"
            f" {row.get('score_live', 0):.2f} s, credits {row.get('credits', 0):.2f} s, hand-off {row['handoff']:.2f} s"
            f" (files {row.get('handoff.write_jsonl', 0):.2f}, open {row.get('handoff.open', 0):.2f}, rows"
            f" {row.get('handoff.rows', 0):.2f}, other {row.get('handoff.other', 0):.2f}; garbage collector"
            f" {row.get('gc_in_advantages', 0):.2f}), ingest {row.get('ingest', 0):.2f} s; the GPU's queue before the"
            f" source {row.get('gpu_wait_before_advantages', 0):.2f} s"
        )
    if "error" in doc:
        lines.append(f"error: {doc['error']}")
    return lines


if __name__ == "__main__":  # score_live's preparing processes and ingest's workers import this module
    from hcapo_store import worker_processes

    # the application names its workers' imports (the library never sets the forkserver's list)
    worker_processes.preload(worker_processes.PREPARE)  # the hook ingests in process (jobs=1)
    main()
