"""Benchmark: the time the verl hand-off adds to a training step (issue 33).

    python bench/verl_handoff.py --workdir /tmp/vh --groups 16 --group-size 8      # build, then measure
    python bench/verl_handoff.py --workdir /tmp/vh --measure-only --json
    python bench/verl_handoff.py --workdir /tmp/vh --measure-only --skip-handoff    # the paired baseline

One training step's rollouts (``--groups`` GRPO groups of ``--group-size`` multi-turn episodes,
written by ``write_rollout`` as verl's agent loop would) are followed into a store once (one
``follow`` cycle, scored in process by the tiny demo model: its time is reported beside, as
``follow_s``, but it runs beside the trainer, not in its step).

Measured: what verl's driver runs in ``HcapoRewardManager.assemble_rm_scores`` for that step,
``VerlHandoff.advantages`` over the whole batch (B = groups x group size samples): a new
hand-off each round, as each step brings new uids, so every group's batch is looked up, its
credit run loaded and each sample matched by its own ids (``cold``); and the same call again
on the same object (``warm``: renderings cached). ``--skip-handoff`` does everything but the
call, for a paired whole-process comparison (farm-bench --vs). ``--ids turns``: each sample's
ids as a multi-turn agent loop accumulates them (the template's render up to the last turn's
end-of-turn token: the store's ``turns`` rendering) instead of the template's render of the
whole conversation; ``matched`` reports which rendering each sample's ids were found as.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VERSION = "step-1"


def _words(rng: random.Random, n: int) -> str:
    from hcapo_store.devkit.synth import words

    return words(rng, n)


def build(work: Path, groups: int, group_size: int, turns: int, seed: int) -> dict:
    """Rollouts for one step, followed and scored by the tiny model (in process)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hcapo_store.credits.equations import CreditParams
    from hcapo_store.devkit.tiny_model import build_demo_tokenizer, build_tiny_model
    from hcapo_store.online.follow import FollowConfig, Follower, follow
    from hcapo_store.scoring.backends.inprocess import LiveModelBackend
    from hcapo_store.scoring.job import ScoreConfig, prepare
    from hcapo_store.scoring.scheduler import RunOptions
    from hcapo_store.storage.store import Store
    from hcapo_store.training.verl_batch import write_rollout

    model_dir = build_tiny_model(work / "model", build_demo_tokenizer(work / "tokenizer"))
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        uid = f"u{g:03d}"
        for k in range(group_size):
            messages = [{"role": "user", "content": f"Task: {_words(rng, 30)}"}]
            for t in range(turns):
                messages.append({"role": "assistant", "content": _words(rng, rng.randint(20, 60))})
                if t < turns - 1:
                    messages.append({"role": "user", "content": f"tool: {_words(rng, rng.randint(20, 80))}"})
            write_rollout(work / "rollouts", 1, uid, f"{uid}-{k}", round(rng.random(), 3), messages)
            samples.append({"uid": uid, "messages": messages})
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    started = time.perf_counter()
    with Store.open(str(work / "store.db")) as store:
        backend = LiveModelBackend(model, weight_version=VERSION)
        cfg = ScoreConfig(backend=LiveModelBackend.kind, tokenizer=str(model_dir), weight_version=VERSION)
        prep = prepare(store, cfg, backend)
        paper = CreditParams(variant="paper")
        fcfg = FollowConfig([work / "rollouts" / "step_0001"], group_size, "field:uid", params=paper)
        result = follow(Follower(store, prep, fcfg, RunOptions(concurrency=1)), once=True)
    follow_s = time.perf_counter() - started
    if result.batches != groups:
        sys.exit(f"follow published {result.batches} of {groups} batches: {result.status.failures[:3]}")
    (work / "samples.json").write_text(json.dumps(samples))
    return {"follow_s": round(follow_s, 3), "batches": result.batches}


def verl_batch(work: Path, rendering: str = "whole") -> tuple[list[str], list[list[int]], object, object]:
    """The step as verl holds it: uids, first prompts, right-padded responses and their masks.
    ``rendering``: each sample's ids the chat template's render of its conversation (``whole``)
    or that render up to the last turn's end-of-turn token, as a multi-turn agent loop
    accumulates the policy's turns (``turns``: the store's ``turns`` rendering)."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work / "model"))
    samples = json.loads((work / "samples.json").read_text())
    uids, prompts, responses, masks = [], [], [], []
    for s in samples:
        msgs = s["messages"]

        def ids(m: list[dict], gen: bool) -> list[int]:
            return list(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=gen, return_dict=False))

        full, prompt = ids(msgs, False), ids(msgs[:1], True)
        if rendering == "turns":  # the policy's last turn ends at its end-of-turn token
            full = full[: len(full) - full[::-1].index(tok.eos_token_id)]
        mask = [1] * (len(full) - len(prompt))
        for j in range(2, len(msgs)):
            if msgs[j]["role"] == "user":
                for t in range(len(ids(msgs[:j], False)), len(ids(msgs[: j + 1], True))):
                    mask[t - len(prompt)] = 0
        uids.append(s["uid"])
        prompts.append(prompt)
        responses.append(full[len(prompt) :])
        masks.append(mask)
    width = max(len(r) for r in responses)
    r = np.zeros((len(responses), width), dtype=np.int64)
    m = np.zeros((len(responses), width), dtype=np.int64)
    for i, (ri, mi) in enumerate(zip(responses, masks)):
        r[i, : len(ri)], m[i, : len(mi)] = ri, mi
    return uids, prompts, r, m


def measure(work: Path, repeats: int, skip: bool, rendering: str = "whole") -> dict:
    from hcapo_store.storage.store import Store
    from hcapo_store.training.verl_batch import VerlHandoff

    uids, prompts, responses, masks = verl_batch(work, rendering)
    cold, warm = [], []
    ids = int(sum(len(p) for p in prompts) + (responses != 0).sum())  # every sample's prompt + response ids
    with Store.open(str(work / "store.db"), create=False) as store:
        for _ in range(repeats):
            handoff = VerlHandoff(store, str(work / "model"), weight_version=VERSION)
            if skip:
                continue
            t0 = time.perf_counter()
            out = handoff.advantages(uids, prompts, responses, masks)
            t1 = time.perf_counter()
            handoff.advantages(uids, prompts, responses, masks)
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            warm.append(t2 - t1)
            if len(handoff.last) != len(uids) or not out.any():
                sys.exit("the hand-off placed no advantages: the benchmark measured nothing")
            matched = collections.Counter(str(credit.how) for credit in handoff.last)
    if skip:
        return {"skipped": True, "samples": len(uids)}
    return {
        "samples": len(uids),
        "groups": len(set(uids)),
        "ids": ids,
        "cold_s_median": round(statistics.median(cold), 4),
        "cold_s_min": round(min(cold), 4),
        "cold_s_max": round(max(cold), 4),
        "warm_s_median": round(statistics.median(warm), 4),
        "cold_ms_per_sample": round(1000 * statistics.median(cold) / len(uids), 2),
        "repeats": repeats,
        "matched": dict(sorted(matched.items())),  # how the samples' ids were found: which rendering, or a search
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure-only", action="store_true", help="the store in --workdir is built already")
    parser.add_argument("--skip-handoff", action="store_true", help="everything but the hand-off call (baseline)")
    parser.add_argument(
        "--ids",
        choices=("whole", "turns"),
        default="whole",
        help="each sample's ids: the template's render of its conversation, or as a multi-turn agent loop "
        "accumulates them (up to the last turn's end-of-turn token)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    if not args.measure_only:
        report.update(build(args.workdir, args.groups, args.group_size, args.turns, args.seed))
    report.update(measure(args.workdir, args.repeats, args.skip_handoff, args.ids))
    report["sample_ids"] = args.ids
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
