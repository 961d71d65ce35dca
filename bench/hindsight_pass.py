"""The hindsight pass's host costs per TRL step, on the CPU (issue 43 item 4).

    python bench/hindsight_pass.py                       # 8 rows, per-step layout, the 99-step episode
    python bench/hindsight_pass.py --layout episode --json /tmp/pass.json
    python bench/hindsight_pass.py --tiny                # ~15 s: one subtask, 2 rows (a smoke run)

One ``StoreAdvantages`` call on a hand-made ``RolloutBatch`` like TRL's (bench/gpu_trl.py's
prompt: ``EpisodeBuilder(seed=1, episode_id=1, reward=0.5).standard(steps_per_subtask=22)`` up
to its last assistant turn, rendered with the Qwen3 tokenizer; ``--rows`` rows of short digit
completions ending in EOS, all trained, rewards that differ), scored by a tiny random Qwen3-shaped
policy on the CPU (hidden 64, 2 layers: its forwards cost little, so the host's work shows).
The call is made twice, each step a new batch: the first loads the tokenizer and starts what is
kept; the second is the steady state (its phases are the numbers to quote). ``--profile N``
(default 25, 0: none): a third call, the same as the second, under cProfile (its N top lines by
cumulative and by own time; cProfile sees this thread only, not the threads that prepare prompts,
and its overhead inflates the template's many small calls: its phases are not the steady ones).

Per phase, wall and CPU seconds (CPU: the thread's own ``time.thread_time``; a phase run in
several threads is summed over them, so its wall can exceed the call's):
ingest, score_live (within it: ``setup`` = ``job.prepare``, ``prepare`` = building the steps'
prompts, ``forward`` = the model's forwards, ``write`` = the score rows' writes), credits,
``handoff_open`` (``Handoff(...)``), ``handoff_rows`` (every row's placing), and ``rest`` (the
call's wall less the phases: writing the JSONL, the SQL around them).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this tree's hcapo_store before any installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_common as common  # noqa: E402 - beside this file

SHARED_TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "qwen3"


class PhaseClock:
    """Wall and CPU seconds of the wrapped callables, per phase; nested phases count in both."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()
        self.undo: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.wall, self.cpu, self.calls = {}, {}, {}

    def add(self, name: str, wall: float, cpu: float) -> None:
        with self.lock:
            self.wall[name] = self.wall.get(name, 0.0) + wall
            self.cpu[name] = self.cpu.get(name, 0.0) + cpu
            self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, owner: Any, attribute: str, name: str, before: Any = None) -> None:
        inner = getattr(owner, attribute)
        self.undo.append((owner, attribute, inner))

        @functools.wraps(inner)
        def timed(*a: Any, **kw: Any) -> Any:
            if before is not None:
                kw = before(kw)
            w, c = time.perf_counter(), time.thread_time()
            try:
                return inner(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - w, time.thread_time() - c)

        setattr(owner, attribute, timed)

    def unwrap(self) -> None:
        for owner, attribute, inner in reversed(self.undo):
            setattr(owner, attribute, inner)
        self.undo.clear()


def make_batch(
    step: int, tok: Any, prompt: list[dict[str, Any]], prompt_ids: list[int], rows: int, model: Any, edges: bool = False
) -> Any:
    """``rows`` rollouts of one prompt as TRL hands them over: digit completions ending in EOS,
    all trained, rewards that differ (the sum of the digits), one GRPO group. ``edges``: the
    first row's completion is EOS alone (trained, no text) and the second's is cut at the length
    limit (no EOS; untrained, as ``mask_truncated_completions=True`` leaves it), as GPU steps held."""
    from hcapo_store.training.trl_grpo import RolloutBatch

    texts = [str(1000 + 37 * (i + 1) + 101 * step)[-(2 + i % 3) :] for i in range(rows)]
    if edges:
        texts[0] = ""
    completion_ids = [[*tok(t, add_special_tokens=False)["input_ids"], tok.eos_token_id] for t in texts]
    loss_mask = [[1] * len(c) for c in completion_ids]
    if edges and rows > 1:
        completion_ids[1] = completion_ids[1][:-1]
        loss_mask[1] = [0] * len(completion_ids[1])
    rewards = [float(sum(int(ch) for ch in t)) for t in texts]
    return RolloutBatch(
        step=step,
        prompts=[prompt] * rows,
        completions=[[{"role": "assistant", "content": t}] for t in texts],
        prompt_ids=[list(prompt_ids) for _ in range(rows)],
        completion_ids=completion_ids,
        loss_mask=loss_mask,
        rewards=rewards,
        groups=[0] * rows,
        trl_advantages=[0.0] * rows,
        inputs=[{}] * rows,
        model=model,
    )


def build_policy(vocab: int, tok: Any) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        max_position_embeddings=40960,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **common.SHAPES["tiny"],  # gpu.py's tiny shape, in float32 here
    )
    return Qwen3ForCausalLM(config).float().eval()


def phases(clock: PhaseClock, call_wall: float, call_cpu: float) -> dict[str, dict[str, float]]:
    out = {
        name: {"wall_s": round(clock.wall[name], 4), "cpu_s": round(clock.cpu[name], 4), "calls": clock.calls[name]}
        for name in sorted(clock.wall)
    }
    top = [n for n in ("write_jsonl", "ingest", "score_live", "credits", "handoff_open", "handoff_rows") if n in out]
    out["rest"] = {
        "wall_s": round(call_wall - sum(clock.wall[n] for n in top), 4),
        "cpu_s": round(call_cpu - sum(clock.cpu[n] for n in top), 4),
        "calls": 1,
    }
    out["call"] = {"wall_s": round(call_wall, 4), "cpu_s": round(call_cpu, 4), "calls": 1}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="rollouts in the batch (one GRPO group): 8")
    p.add_argument("--layout", choices=["per-step", "episode"], default="per-step", help="score_live's prompt_layout")
    p.add_argument("--steps-per-subtask", type=int, default=22, help="the synthetic episode's size: 22 (99 steps)")
    p.add_argument("--tokenizer", default=str(SHARED_TOKENIZER), help="the Qwen3 tokenizer directory")
    p.add_argument("--tiny", action="store_true", help="one subtask, 1 step per subtask, 2 rows: a few seconds")
    p.add_argument(
        "--profile", type=int, default=25, help="cProfile lines of a third call, as the second (0: no third call): 25"
    )
    p.add_argument("--json", dest="json_out", help="write the phases (and the profile) here")
    p.add_argument(
        "--edges", action="store_true", help="row 0 an empty completion (EOS alone), row 1 cut at the length limit"
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.steps_per_subtask = min(args.rows, 2), 1
    if not Path(args.tokenizer).is_dir():
        raise SystemExit(f"no tokenizer at {args.tokenizer}: pass --tokenizer DIR (a Qwen3 tokenizer)")

    import torch
    from transformers import AutoTokenizer

    import hcapo_store.credits.compute as credits_module
    import hcapo_store.ingestion.pipeline as ingest_module
    import hcapo_store.scoring.live as live_module
    import hcapo_store.scoring.scheduler as scheduler_module
    import hcapo_store.scoring.writer as writer_module
    import hcapo_store.training.handoff as handoff_module
    import hcapo_store.training.trl_grpo as trl_module
    from hcapo_store.scoring import job as job_module
    from hcapo_store.scoring.forward import LogprobModel
    from hcapo_store.scoring.preparing import close_pools
    from hcapo_store.storage.store import Store

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="hcapo-pass-"))
    print(f"work: {work}", flush=True)  # bench/handoff_rows.py times the hand-off again over its store
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    prompt, steps = common.episode_prompt(work, args.steps_per_subtask, args.tiny)
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    model = build_policy(-(-len(tok) // 64) * 64, tok)
    doc: dict[str, Any] = {
        "command": "python bench/hindsight_pass.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": args.rows,
        "layout": args.layout,
        "prompt": {"messages": len(prompt), "tokens": len(prompt_ids), "episode_steps": steps},
        "torch_threads": 1,
        "calls": [],
    }
    print(f"prompt: {doc['prompt']}, rows {args.rows}, layout {args.layout}", flush=True)

    clock = PhaseClock()
    clock.wrap(trl_module.StoreAdvantages, "_write", "write_jsonl")
    clock.wrap(ingest_module, "ingest", "ingest")
    clock.wrap(live_module, "score_live", "score_live", before=lambda kw: {**kw, "prompt_layout": args.layout})
    clock.wrap(live_module, "prepare", "score_live.setup")
    clock.wrap(live_module, "run_scoring", "score_live.run")
    clock.wrap(scheduler_module.Scheduler, "_requests_for", "score_live.prepare")
    clock.wrap(LogprobModel, "launch", "score_live.forward")
    clock.wrap(LogprobModel, "finish", "score_live.forward_finish")
    clock.wrap(writer_module.ResultWriter, "_write", "score_live.write")
    clock.wrap(credits_module, "compute_credits", "credits")
    clock.wrap(handoff_module.Handoff, "__init__", "handoff_open")
    clock.wrap(trl_module.HandoffAdvantages, "row", "handoff_rows")
    del job_module  # imported so that its module is loaded before the wrapping (live imports from it)

    try:
        with Store.open(str(work / "store.db")) as store:
            source = trl_module.StoreAdvantages(
                store, tokenizer=args.tokenizer, workdir=work / "rollouts", run_id="pass", strict=False,
                allow_zero_hindsight=True,
            )  # fmt: skip
            for step in range(3 if args.profile else 2):
                batch = make_batch(step, tok, prompt, prompt_ids, args.rows, model, args.edges)
                clock.reset()
                profiler = cProfile.Profile() if step == 2 else None
                w, c = time.perf_counter(), time.process_time()
                if profiler is not None:
                    profiler.enable()
                values = source(batch)
                if profiler is not None:
                    profiler.disable()
                call_wall, call_cpu = time.perf_counter() - w, time.process_time() - c
                row = {
                    "step": step,
                    "steady": step >= 1,
                    "profiled": profiler is not None,
                    "phases": phases(clock, call_wall, call_cpu),
                    "advantages": [[round(float(v), 6) for v in r] for r in values],
                    "refused": sum(1 for s, _ in source.refused if s == step),
                    "skipped": sum(1 for s, _ in source.skipped if s == step),
                }
                if profiler is not None:
                    out = io.StringIO()
                    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(args.profile)
                    row["profile_cumulative"] = out.getvalue()
                    out = io.StringIO()
                    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
                    row["profile_tottime"] = out.getvalue()
                doc["calls"].append(row)
                print(
                    f"call {step} ({['first', 'steady', 'profiled'][step]}): wall {call_wall:.3f} s, CPU {call_cpu:.3f} s"
                )
                for name, ph in row["phases"].items():
                    print(f"  {name:26s} wall {ph['wall_s']:8.3f} s  CPU {ph['cpu_s']:8.3f} s  ({ph['calls']} calls)")
                print(f"  refused rows {row['refused']}, skipped rows {row['skipped']}", flush=True)
    finally:
        clock.unwrap()
        close_pools()
    profiled = doc["calls"][-1]
    if "profile_tottime" in profiled and argv is None:
        print(profiled["profile_cumulative"])
        print(profiled["profile_tottime"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return doc


if __name__ == "__main__":
    main()
