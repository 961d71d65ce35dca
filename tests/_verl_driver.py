"""Runs inside the verl 0.9.1 venv (tests/test_verl.py starts it): a verl batch through the
real ``compute_advantage`` (legacy) and ``compute_advantage_for_multi_trajectories`` (v1)
with ``hcapo_store.training.verl`` registered, and the bad inputs. Reads the case JSON the
test wrote (argv[1]), prints one JSON object: each case's advantages or its error line."""

from __future__ import annotations

import json
import math
import sys
import traceback

import numpy as np


def main() -> None:
    case = json.loads(open(sys.argv[1]).read())
    out: dict = {}

    # version drift first: a verl whose names moved is refused naming the supported version
    import verl.trainer.ppo.core_algos as core_algos

    saved = core_algos.register_adv_est
    del core_algos.register_adv_est
    try:
        import hcapo_store.training.verl  # noqa: F401

        out["drift"] = {"error": None}
    except ImportError as exc:
        out["drift"] = {"error": str(exc)}
    finally:
        core_algos.register_adv_est = saved
        sys.modules.pop("hcapo_store.training.verl", None)

    import torch
    from tensordict import TensorDict
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    import hcapo_store.training.verl as hv

    out["registered"] = [
        get_reward_manager_cls("hcapo").__name__,
        get_adv_estimator_fn("hcapo").__name__,
        __import__("verl").__version__,
    ]

    def proto(prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], uids: list[str]):
        """A verl batch: prompts left-padded, responses right-padded, as the rollout makes them."""
        width = max(len(p) for p in prompts)
        length = max(len(r) for r in responses) + 2  # padding beyond the longest response
        p = torch.zeros(len(prompts), width, dtype=torch.long)
        r = torch.zeros(len(prompts), length, dtype=torch.long)
        m = torch.zeros(len(prompts), length, dtype=torch.long)
        att = torch.zeros(len(prompts), width + length, dtype=torch.long)
        for i, (pi, ri, mi) in enumerate(zip(prompts, responses, masks)):
            p[i, width - len(pi) :] = torch.tensor(pi)
            r[i, : len(ri)] = torch.tensor(ri)
            m[i, : len(mi)] = torch.tensor(mi)
            att[i, width - len(pi) : width + len(ri)] = 1
        batch = TensorDict(
            {"prompts": p, "responses": r, "response_mask": m, "attention_mask": att}, batch_size=len(prompts)
        )
        return DataProto(batch=batch, non_tensor_batch={"uid": np.array(uids, dtype=object)})

    def rewards(data) -> None:
        """What the trainers do between the reward manager and the estimator (no KL in reward)."""
        scores = hv.HcapoRewardManager.assemble_rm_scores(data, [0.0] * len(data))
        data.batch["rm_scores"] = scores
        data.batch["token_level_scores"] = scores
        data.batch["token_level_rewards"] = scores

    def attempt(name: str, fn) -> None:
        try:
            out[name] = {"value": fn()}
        except Exception as exc:  # the line a trainer's log would show
            out[name] = {"error": str(exc), "type": type(exc).__name__, "trace": traceback.format_exc()[-600:]}

    hv.configure(case["db"], tokenizer=case["tokenizer"], weight_version=case["weight_version"])
    good = case["good"]

    def legacy():
        data = proto(good["prompts"], good["responses"], good["masks"], good["uids"])
        rewards(data)
        data = compute_advantage(data, adv_estimator="hcapo")
        return {
            "advantages": data.batch["advantages"].tolist(),
            "returns": data.batch["returns"].tolist(),
            "rm_scores": data.batch["rm_scores"].tolist(),
        }

    def v1():
        data = proto(good["prompts"], good["responses"], good["masks"], good["uids"])
        rewards(data)
        keys = [f"{u}_{k}_0" for k, u in enumerate(good["uids"])]  # {uid}_{session}_{index}
        data = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator="hcapo", num_repeat=2)
        return {"advantages": data.batch["advantages"].tolist()}

    attempt("legacy", legacy)
    # each group's hindsight signal as the hand-off inside verl saw it (credits/signal.py)
    out["signals"] = {run: signal.as_dict() for run, signal in hv.handoff().signals.items()}
    attempt("v1", v1)
    # the samples in another order: each still finds its own member, never by uid alone
    order = case["shuffle"]

    def shuffled():
        pick = {k: [good[k][i] for i in order] for k in ("prompts", "responses", "masks", "uids")}
        data = proto(pick["prompts"], pick["responses"], pick["masks"], pick["uids"])
        rewards(data)
        return compute_advantage(data, adv_estimator="hcapo").batch["advantages"].tolist()

    attempt("shuffled", shuffled)

    for bad in ("one_token", "unknown_uid"):
        b = case[bad]
        attempt(bad, lambda b=b: rewards(proto(b["prompts"], b["responses"], b["masks"], b["uids"])))

    hv.configure(case["db"], tokenizer=case["tokenizer"], weight_version="some-other-version")
    attempt("other_version", lambda: rewards(proto(good["prompts"], good["responses"], good["masks"], good["uids"])))
    hv.configure(case["db"], tokenizer=case["tokenizer"], weight_version=case["weight_version"])

    def estimator_sees(change) -> object:
        data = proto(good["prompts"], good["responses"], good["masks"], good["uids"])
        rewards(data)
        change(data)
        return compute_advantage(data, adv_estimator="hcapo").batch["advantages"].tolist()

    def nan(data) -> None:
        row = int(np.flatnonzero(data.batch["token_level_rewards"].abs().sum(-1).numpy())[0])
        col = int(np.flatnonzero(data.batch["token_level_rewards"][row].numpy())[0])
        data.batch["token_level_rewards"][row, col] = math.nan

    def kl(data) -> None:  # algorithm.use_kl_in_reward=True folds a penalty into the rewards
        data.batch["token_level_rewards"] = data.batch["token_level_rewards"] - 0.01 * data.batch["response_mask"]

    def naive(data) -> None:  # another reward manager: one scalar at each response's last token
        scalar = torch.zeros_like(data.batch["token_level_rewards"])
        ends = data.batch["response_mask"].sum(-1) - 1
        scalar[torch.arange(len(data)), ends] = 1.0
        data.batch["token_level_rewards"] = scalar

    def without_uid():  # v1's colocated reward path: prompts, responses, attention_mask, no uid
        data = proto(good["prompts"], good["responses"], good["masks"], good["uids"])
        data.non_tensor_batch.pop("uid")
        del data.batch["response_mask"]
        scores = hv.HcapoRewardManager.assemble_rm_scores(data, [0.0] * len(data))
        return {"rm_scores": scores.tolist(), "uids": [s.uid for s in hv.handoff().last]}

    attempt("no_uid", without_uid)
    hv.configure(case["db"], tokenizer=case["tokenizer"])  # no weight version: a row without uid is refused
    attempt("no_uid_no_version", without_uid)
    hv.configure(case["db"], tokenizer=case["tokenizer"], weight_version=case["weight_version"])

    def rejected(data) -> None:  # rollout correction's rejection sampling: a sample's mask zeroed
        data.batch["response_mask"][0] = 0

    attempt("rejected", lambda: estimator_sees(rejected))
    attempt("nan", lambda: estimator_sees(nan))
    attempt("kl_in_reward", lambda: estimator_sees(kl))
    attempt("naive_rewards", lambda: estimator_sees(naive))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
