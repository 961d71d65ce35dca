"""HCAPO in verl 0.9.1: verl trains on the store's per-token credits (algorithm.adv_estimator=hcapo).

1. The agent loop writes each finished rollout (e.g. at the end of your AgentLoop's ``run``):
       write_rollout("rollouts", step, uid, episode_id, reward, messages)   # hcapo_store.training.verl_batch
2. The store follows them and scores each GRPO group (a uid) against the rollout server:
       hcapo-store --db rollouts.db follow rollouts --batch-by field:uid --group-size 8 \\
           --server http://127.0.0.1:30000 --tokenizer /models/Qwen3-8B --variant paper
3. verl runs from this entry point: the plug is registered in every Ray process, and each
   batch's advantages come from the store (its group by uid, each sample by its own ids; a group
   whose hindsight term is zero on every step is refused unless ``--allow-zero-hindsight``):
       python examples/verl_hcapo.py --store rollouts.db --tokenizer /models/Qwen3-8B -- \\
           data.train_files=... actor_rollout_ref.model.path=/models/Qwen3-8B ...

Without a GPU verl's inference engine cannot start and verl would wait for one silently: the
example then goes through verl's own ``ray.init`` (the run's runtime_env and setup hook), checks
in a Ray worker that ``hcapo`` is registered as verl's estimator and reward manager, prints what
that worker saw as one JSON line, and stops with one line saying so (exit status 1).
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
    # v1 streams each rollout's scalar reward and gives no reward manager the whole batch: the
    # replay buffer puts the store's advantages into each sampled training batch instead
    "trainer.v1.sampler.custom_sampler.path=pkg://hcapo_store.training.verl",
    "trainer.v1.sampler.custom_sampler.name=replay_buffer",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="the store `hcapo-store follow` writes (path or URL)")
    parser.add_argument("--tokenizer", required=True, help="the policy's tokenizer directory (the scorer's)")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for a group's batch")
    parser.add_argument("--weight-version", help="the weight version every batch must be scored under")
    parser.add_argument(
        "--allow-zero-hindsight",
        action="store_true",
        help="train groups whose hindsight term is zero on every step (plain GRPO); refused by default",
    )
    args, verl_args = parser.parse_known_args()
    env = {"HCAPO_STORE": args.store, "HCAPO_TOKENIZER": args.tokenizer, "HCAPO_WAIT": str(args.wait)}
    if args.weight_version:
        env["HCAPO_WEIGHT_VERSION"] = args.weight_version
    if args.allow_zero_hindsight:
        env["HCAPO_ALLOW_ZERO_HINDSIGHT"] = "1"
    os.environ.update(env)  # this process, and (below) every Ray worker of the run
    # Ray takes runtime_env env_vars as strings only: quoted, Hydra keeps 600.0 or 1 a string
    forwarded = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={hydra_string(v)}" for k, v in env.items()]
    import verl.trainer.main_ppo as main_ppo

    import hcapo_store.training.verl  # noqa: F401  (registers hcapo here as well)

    missing = missing_engine()
    if missing:  # verl would wait for GPUs forever: check the plug in a Ray worker, then say why it stops
        run_ppo = main_ppo.run_ppo
        main_ppo.run_ppo = lambda config, task_runner_class: preflight(run_ppo, config, missing)
    sys.argv = [sys.argv[0], *PLUG, *forwarded, *[a for a in verl_args if a != "--"]]
    main_ppo.main()


def hydra_string(value: str) -> str:
    """``value`` as a quoted Hydra override value: always a string, whatever it looks like."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def missing_engine() -> str | None:
    """Why verl's rollout cannot run here (no GPU for its inference engine), or None."""
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    return "no GPU for verl's inference engine (vLLM or SGLang)"


class Preflight:
    """In place of verl's TaskRunner on a machine without an inference engine: what a Ray worker
    of this run sees (the setup hook ran there: hcapo is registered in verl's two registries)."""

    def run(self, config) -> dict:
        from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
        from verl.utils.import_utils import load_extern_type

        sampler = config.trainer.v1.sampler.custom_sampler  # loaded as verl's v1 trainer loads it
        return {
            "pid": os.getpid(),
            "estimator": "hcapo" in ADV_ESTIMATOR_REGISTRY,
            "reward_manager": "hcapo" in REWARD_MANAGER,
            "sampler": load_extern_type(sampler.path, sampler.name).__qualname__,
            "env": {k: v for k, v in os.environ.items() if k.startswith("HCAPO_")},
        }


def preflight(run_ppo, config, missing: str) -> None:
    """verl's own ``run_ppo`` (its ``ray.init`` with the run's runtime_env and setup hook), with a
    ``Preflight`` actor for its TaskRunner; then one line saying why nothing is trained."""
    import json

    import ray

    worker = ray.remote(num_cpus=0)(Preflight)
    run_ppo(config, task_runner_class=worker)  # ray.init as verl does it, then a worker of the run
    found = ray.get(worker.remote().run.remote(config))
    registered = found.get("estimator") and found.get("reward_manager") and found.get("sampler") == "replay_buffer"
    print(json.dumps({"ray_worker": found}), flush=True)
    ray.shutdown()
    if not registered:
        sys.exit(f"hcapo is not registered in verl's Ray worker (pid {found.get('pid')}): {json.dumps(found)}")
    sys.exit(
        f"verl_hcapo: {missing}: the plug is registered in a Ray worker (estimator and reward manager hcapo, "
        "v1 sampler replay_buffer), nothing is trained here; run it on a machine with a GPU"
    )


if __name__ == "__main__":
    main()
