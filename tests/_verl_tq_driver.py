"""Runs inside the verl 0.9.1 venv (tests/test_verl.py starts it): verl's v1 trainer path on a
real TransferQueue (a local Ray, CPU). The step's trajectories go in as v1's agent loop puts
them (one key ``{uid}_{session}_0`` each, its reward a scalar on the last response token, a
prompt key per uid); ``hcapo_store.training.verl.replay_buffer`` (the custom sampler) samples
the step; then v1's ``_compute_advantage`` as verl 0.9.1 writes it reads ``rm_scores`` and runs
``compute_advantage_for_multi_trajectories`` with ``adv_estimator=hcapo``. A validation batch
is sampled too (its scalar rewards stay). Prints one JSON object."""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    case = json.loads(open(sys.argv[1]).read())
    import ray

    # TransferQueue's controller and two storage units take one logical CPU each
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    import torch
    import transfer_queue as tq
    from tensordict import NonTensorStack, TensorDict
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    import hcapo_store.training.verl as hv

    tq.init()
    hv.configure(case["db"], tokenizer=case["tokenizer"], weight_version=case["weight_version"], wait=60)
    good = case["good"]

    def put(partition: str, rows: list[int], reward: float) -> list[str]:
        """As AgentLoopWorkerTQ: a finished prompt key per uid, then each session's trajectory."""
        keys, sessions = [], {}
        for i in rows:
            uid = good["uids"][i]
            sessions[uid] = sessions.get(uid, -1) + 1
            keys.append(f"{uid}_{sessions[uid]}_0")
        for uid in sessions:
            tq.kv_put(key=uid, partition_id=partition, tag={"is_prompt": True, "global_steps": 1, "status": "finished"})

        def nested(values: list[list[float]], dtype) -> torch.Tensor:
            return torch.nested.as_nested_tensor([torch.tensor(v, dtype=dtype) for v in values], layout=torch.jagged)

        scalar = [[0.0] * (len(good["responses"][i]) - 1) + [reward] for i in rows]  # AgentLoopOutput.as_dict
        fields = TensorDict(
            {
                "prompts": nested([good["prompts"][i] for i in rows], torch.int64),
                "responses": nested([good["responses"][i] for i in rows], torch.int64),
                "response_mask": nested([good["masks"][i] for i in rows], torch.int64),
                "rm_scores": nested(scalar, torch.float32),
                "uid": NonTensorStack(*[good["uids"][i] for i in rows]),
            },
            batch_size=len(rows),
        )
        tags = [{"status": "success", "global_steps": 1} for _ in rows]
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=fields, tags=tags)
        return keys

    rows = list(range(len(good["uids"])))
    keys = put("train", rows, 0.5)
    by_key = dict(zip(keys, rows))
    buffer = hv.replay_buffer(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        refill_fn=None,
    )
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=len(set(good["uids"])))

    # v1's _compute_advantage (verl 0.9.1, trainer_base.py), use_kl_in_reward=False
    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "response_mask", "rm_scores"]
    )
    data = DataProto(batch=data.to_padded_tensor())
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data = compute_advantage_for_multi_trajectories(data, batch_keys=batch.keys, adv_estimator="hcapo", num_repeat=2)
    advantages = {by_key[k]: data.batch["advantages"][j].tolist() for j, k in enumerate(batch.keys)}

    val_keys = put("val", rows[:1], 0.75)
    val, _ = buffer.sample(global_steps=1, partition_id="val", batch_size=1)
    kept = tq.kv_batch_get(keys=val.keys, partition_id="val", select_fields=["rm_scores"])
    out = {
        "sampled": sorted(by_key[k] for k in batch.keys),
        "advantages": [advantages[i] for i in sorted(advantages)],
        "signals": {run: signal.as_dict() for run, signal in hv.handoff().signals.items()},
        "val": {"keys": list(val.keys) == val_keys, "rm_scores": kept["rm_scores"].to_padded_tensor(0.0).tolist()},
    }
    tq.close()
    ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
