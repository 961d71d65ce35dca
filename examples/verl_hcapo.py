"""HCAPO in verl 0.9.1: verl trains on the store's per-token credits (algorithm.adv_estimator=hcapo).

1. The agent loop writes each finished rollout (e.g. at the end of your AgentLoop's ``run``):
       write_rollout("rollouts", step, uid, episode_id, reward, messages)   # hcapo_store.training.verl_batch
2. The store follows them and scores each GRPO group (a uid) against the rollout server:
       hcapo-store --db rollouts.db follow rollouts --batch-by field:uid --group-size 8 \\
           --server http://127.0.0.1:30000 --tokenizer /models/Qwen3-8B --variant paper
3. verl runs from this entry point: the plug is registered in every Ray process, and each
   batch's advantages come from the store (its group by uid, each sample by its own ids):
       python examples/verl_hcapo.py --store rollouts.db --tokenizer /models/Qwen3-8B -- \\
           data.train_files=... actor_rollout_ref.model.path=/models/Qwen3-8B ...
"""

from __future__ import annotations

import argparse
import os
import sys

PLUG = [
    "algorithm.adv_estimator=hcapo",  # the registered estimator: passes the store's values on
    "algorithm.use_kl_in_reward=False",  # a KL folded into the rewards would alter them (refused)
    "reward.reward_manager.source=register",
    "reward.reward_manager.name=hcapo",  # writes the store's advantages into rm_scores
    "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=hcapo_store.training.verl.setup",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="the store `hcapo-store follow` writes (path or URL)")
    parser.add_argument("--tokenizer", required=True, help="the policy's tokenizer directory (the scorer's)")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for a group's batch")
    parser.add_argument("--weight-version", help="the weight version every batch must be scored under")
    args, verl_args = parser.parse_known_args()
    env = {"HCAPO_STORE": args.store, "HCAPO_TOKENIZER": args.tokenizer, "HCAPO_WAIT": str(args.wait)}
    if args.weight_version:
        env["HCAPO_WEIGHT_VERSION"] = args.weight_version
    os.environ.update(env)  # this process, and (below) every Ray worker of the run
    forwarded = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={v}" for k, v in env.items()]
    from verl.trainer.main_ppo import main as verl_main

    import hcapo_store.training.verl  # noqa: F401  (registers hcapo here as well)

    sys.argv = [sys.argv[0], *PLUG, *forwarded, *[a for a in verl_args if a != "--"]]
    verl_main()


if __name__ == "__main__":
    main()
