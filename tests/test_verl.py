"""HCAPO inside the real verl 0.9.1 (issue 33): rollouts written as JSONL by uid, followed and
scored against the reference server, a verl batch built from them, and verl's own
``compute_advantage`` (legacy) and ``compute_advantage_for_multi_trajectories`` (v1) with
``algorithm.adv_estimator=hcapo`` — equal to ``Handoff.advantages`` on every token, 0 on
every token that is not an action. verl pins transformers<5.11, so it runs in its own venv
(built once under the temp dir, like tests/test_notorch.py; ``HCAPO_VERL_VENV`` names a
ready one) with this checkout on its path."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import _verl_venv
import numpy as np
import pytest
from _hindsight import assert_advantage_moves_with_logprob, assert_advantages_follow_hindsight
from click.testing import CliRunner
from transformers import AutoTokenizer

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import words
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import Handoff

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow]
VERSION = "step-1"  # the weight version the step's rollouts (and their scores) come from


@pytest.fixture(scope="module")
def verl_python() -> Path:
    return _verl_venv.verl_python()


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        server.weight_version = VERSION
        yield server


def _rollout(rng: random.Random, turns: int) -> list[dict]:
    """A multi-turn conversation as an agent loop writes it: task, then action / tool result."""
    messages = [{"role": "user", "content": f"Task: {words(rng, 6)}"}]
    for t in range(turns):
        messages.append({"role": "assistant", "content": words(rng, rng.randint(2, 7))})
        if t < turns - 1:
            messages.append({"role": "user", "content": f"tool: {words(rng, 4)}"})
    return messages


def write_step(root: Path, groups: dict[str, int], seed: int) -> dict[str, dict]:
    """One training step's rollouts as the agent loop writes them: one JSONL line per sample
    (``episode_id``, ``uid``, ``reward``, ``messages``), a file per GRPO group."""
    rng = random.Random(seed)
    step = root / "step_0001"
    step.mkdir(parents=True, exist_ok=True)
    written = {}
    for uid, n in groups.items():
        lines = []
        for k in range(n):
            line = {
                "episode_id": f"{uid}-{k}",
                "uid": uid,
                "reward": round(rng.random(), 3),
                "messages": _rollout(rng, rng.randint(2, 3)),
            }
            written[line["episode_id"]] = line
            lines.append(json.dumps(line))
        (step / f"{uid}.jsonl").write_text("\n".join(lines) + "\n")
    return written


def verl_sample(tok, messages: list[dict]) -> tuple[list[int], list[int], list[int]]:
    """What verl's multi-turn agent loop holds for a conversation: the first prompt's ids, then
    the response's ids (every turn after it) and its mask, 0 on what the policy did not write
    (tool results and the next generation prompt), from prefix renders of the chat template."""

    def ids(msgs: list[dict], gen: bool) -> list[int]:
        return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False))

    full = ids(messages, False)
    prompt = ids(messages[:1], True)
    assert full[: len(prompt)] == prompt
    mask = [1] * (len(full) - len(prompt))
    for j in range(2, len(messages)):
        if messages[j]["role"] == "user":  # a tool result and the generation prompt after it
            a, b = len(ids(messages[:j], False)), len(ids(messages[: j + 1], True))
            assert full[:b] == ids(messages[: j + 1], True)
            for t in range(a, b):
                mask[t - len(prompt)] = 0
    return prompt, full[len(prompt) :], mask


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory, ref: ReferenceServer, tiny_model_dir: Path) -> dict:
    """A step of 3 GRPO groups (2, 2 and 3 samples) followed and scored by uid."""
    tmp = tmp_path_factory.mktemp("verl")
    root = tmp / "rollouts"
    written = write_step(root, {"u-a": 2, "u-b": 2, "u-c": 3}, seed=5)
    db = tmp / "store.db"
    r = CliRunner().invoke(
        cli,
        ["--db", str(db), "follow", str(root), "--batch-by", "field:uid", "--group-size", "2", "--once"]
        + ["--variant", "paper", "--server", ref.url, "--tokenizer", str(tiny_model_dir), "--max-context", "2048"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    # follow's line per published batch says how much of its run carries the hindsight term
    assert r.output.count("hindsight term non-zero on") == 3, r.output
    r = CliRunner().invoke(cli, ["--db", str(db), "batches", "--json"])
    batches = json.loads(r.output)
    assert {b["key"] for b in batches} == {"u-a", "u-b", "u-c"}
    assert all(b["status"] == "ready" and b["weight_version"] == VERSION for b in batches)
    assert {b["key"]: b["episodes"] for b in batches} == {"u-a": 2, "u-b": 2, "u-c": 3}
    return {"db": db, "written": written, "batches": {b["key"]: b for b in batches}}


def _case(scored: dict, tok_dir: Path, tmp: Path) -> tuple[Path, dict]:
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    good: dict = {"prompts": [], "responses": [], "masks": [], "uids": [], "ids": [], "expected": []}
    with Store.open(str(scored["db"])) as store:
        for eid, line in sorted(scored["written"].items()):
            prompt, response, mask = verl_sample(tok, line["messages"])
            handoff = Handoff(store, scored["batches"][line["uid"]]["credit_run"], tokenizer=tok_dir)
            credit = handoff.advantages(eid, prompt + response)  # by the collector's own id
            good["prompts"].append(prompt)
            good["responses"].append(response)
            good["masks"].append(mask)
            good["uids"].append(line["uid"])
            good["ids"].append(eid)
            good["expected"].append(
                {"advantages": credit.advantages[len(prompt) :].tolist(), "mask": credit.mask[len(prompt) :].tolist()}
            )
    one = {
        k: [list(v) if isinstance(v, list) else v for v in good[k]] for k in ("prompts", "responses", "masks", "uids")
    }
    # sample 1's second action token +1: a rollout whose ids differ from the stored episode by one token
    at = next(t for t, a in enumerate(good["expected"][1]["mask"]) if a)
    one["responses"][1][at] += 1
    unknown = {k: list(good[k][:2]) for k in ("prompts", "responses", "masks")}
    unknown["uids"] = ["u-a", "u-never-seen"]
    case = {
        "db": str(scored["db"]),
        "tokenizer": str(tok_dir),
        "weight_version": VERSION,
        "good": {k: good[k] for k in ("prompts", "responses", "masks", "uids")},
        "shuffle": list(reversed(range(len(good["uids"])))),
        "one_token": one,
        "unknown_uid": unknown,
    }
    path = tmp / "case.json"
    path.write_text(json.dumps(case))
    return path, good


def _run_verl(verl_python: Path, case: Path, driver: str = "_verl_driver.py") -> dict:
    r = subprocess.run(
        [str(verl_python), str(ROOT / "tests" / driver), str(case)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_verl_venv.run_env(),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_verl_trains_on_the_stores_advantages(
    verl_python: Path, scored: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    case, good = _case(scored, tiny_model_dir, tmp_path)
    out = _run_verl(verl_python, case)
    assert out["registered"] == ["HcapoRewardManager", "hcapo_advantage", "0.9.1"]

    # version drift: a verl whose names moved is refused by an ImportError naming 0.9.1
    assert "supports verl 0.9.1" in out["drift"]["error"] and "register_adv_est" in out["drift"]["error"]

    # legacy and v1: every token equal to Handoff.advantages, 0 off the actions and the padding
    for path in ("legacy", "v1"):
        assert "value" in out[path], out[path]
        adv = out[path]["value"]["advantages"]
        for i, want in enumerate(good["expected"]):
            row = np.array(adv[i], dtype=np.float32)
            n = len(want["advantages"])
            assert np.array_equal(row[:n], np.array(want["advantages"], dtype=np.float32)), (path, i)
            assert not row[n:].any()
            assert not row[:n][~np.array(want["mask"], dtype=bool)].any()  # non-action tokens: 0
            assert row[:n][np.array(want["mask"], dtype=bool)].any() or not want["mask"]
    assert out["legacy"]["value"]["returns"] == out["legacy"]["value"]["advantages"]
    # the paper's signed advantages reached the trainer: some negative, some positive
    flat = np.concatenate([np.array(r) for r in out["legacy"]["value"]["advantages"]])
    assert flat.min() < 0 < flat.max()
    # outcome-only rollouts: the hindsight term is in most steps of every group, as the hand-off inside
    # verl measured it, and the advantages verl trains on vary within a sample (its steps differ)
    assert set(out["signals"]) == {b["credit_run"] for b in scored["batches"].values()}
    for signal in out["signals"].values():
        assert signal["hindsight_nonzero_steps"] > signal["steps"] / 2, signal
    varying = 0
    for i, want in enumerate(good["expected"]):
        row = np.array(out["legacy"]["value"]["advantages"][i], dtype=np.float32)[: len(want["mask"])]
        varying += len(set(row[np.array(want["mask"], dtype=bool)].tolist())) > 1
    assert varying > len(good["expected"]) / 2

    # the same samples in reverse order: each finds its own member within its group
    order = list(reversed(range(len(good["uids"]))))  # the permutation the driver applied
    assert out["shuffled"]["value"] == [out["legacy"]["value"]["advantages"][i] for i in order]

    # bad input: one line each, naming the sample (its row, its uid) and the step
    e = out["one_token"]["error"]
    assert e.startswith("sample 1 (uid ") and "step " in e and "differ from the stored episode" in e, e
    assert "\n" not in e
    e = out["unknown_uid"]["error"]
    assert e.startswith("sample 1 (uid u-never-seen): the store has no batch for this uid"), e
    e = out["other_version"]["error"]
    assert e.startswith("sample 0 (uid ") and f"weight version '{VERSION}'" in e and "some-other-version" in e, e
    assert "(+2 more: sample 2 (uid u-b)" in e  # every group of the step is named, not only the first
    # v1's colocated reward path drops the uid: each row found by its ids among the step's batches
    no_uid = out["no_uid"]["value"]
    assert no_uid["uids"] == good["uids"]
    for i, want in enumerate(good["expected"]):
        row = np.array(no_uid["rm_scores"][i], dtype=np.float32)
        n = len(want["advantages"])
        # without a response_mask the attention mask trains every response id: the actions alone carry values
        assert np.array_equal(row[:n], np.array(want["advantages"], dtype=np.float32)) and not row[n:].any()
    e = out["no_uid_no_version"]["error"]
    assert e.startswith("sample 0 (no uid): a row without its uid is looked up") and "give weight_version" in e, e
    # the estimator passes on nothing it did not get from the store, and never a NaN
    assert "token-level reward is nan: refused" in out["nan"]["error"]
    # a sample rejected by verl's rollout correction (its mask zeroed since) trains on nothing; the rest as before
    rejected = out["rejected"]["value"]
    assert not any(rejected[0]) and rejected[1:] == out["legacy"]["value"]["advantages"][1:]
    for case_name in ("kl_in_reward", "naive_rewards"):
        e = out[case_name]["error"]
        assert e.startswith("sample 0 (uid ") and "not the advantages the hcapo plug wrote" in e, e
        assert "custom_sampler.path=pkg://hcapo_store.training.verl" in e, e
    # last (it changes the store): the advantages follow the stored hindsight logprobs
    runs = [b["credit_run"] for b in scored["batches"].values()]
    with Store.open(str(scored["db"])) as store:
        assert_advantages_follow_hindsight(store, runs)
        assert_advantage_moves_with_logprob(store, runs)


def test_verl_v1_trains_on_the_stores_advantages_through_its_replay_buffer(
    verl_python: Path, scored: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """verl 0.9.1's v1 trainer streams each trajectory's scalar reward into TransferQueue and calls
    no reward manager on the whole batch (that is the colocated reward model's path only), so the
    estimator would see scalars. The custom sampler puts the store's advantages into the sampled
    batch's rm_scores: on a real TransferQueue, v1's own advantage step then gives every token
    Handoff.advantages, signed, varying within a sample; a validation batch keeps its scalar."""
    case, good = _case(scored, tiny_model_dir, tmp_path)
    out = _run_verl(verl_python, case, "_verl_tq_driver.py")
    assert out["sampled"] == list(range(len(good["expected"])))
    varying = 0
    for i, want in enumerate(good["expected"]):
        row = np.array(out["advantages"][i], dtype=np.float32)
        n, mask = len(want["advantages"]), np.array(want["mask"], dtype=bool)
        assert np.array_equal(row[:n], np.array(want["advantages"], dtype=np.float32)), i
        assert not row[n:].any() and not row[:n][~mask].any()
        varying += len(set(row[:n][mask].tolist())) > 1
    flat = np.concatenate([np.array(r) for r in out["advantages"]])
    assert flat.min() < 0 < flat.max() and varying > len(good["expected"]) / 2
    assert set(out["signals"]) == {b["credit_run"] for b in scored["batches"].values()}
    # validation is scored, not trained: its reward stays the scalar on the last token
    assert out["val"]["keys"] and out["val"]["rm_scores"][0][-1] == 0.75 and not any(out["val"]["rm_scores"][0][:-1])


def test_the_plug_is_refused_without_verl() -> None:
    """This environment has no verl: the import names the version the plug supports."""
    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed in this environment")
    with pytest.raises(ImportError, match=r"supports verl 0\.9\.1 \(installed: none\)"):
        import hcapo_store.training.verl  # noqa: F401


def test_the_example_composes_into_verls_own_config(verl_python: Path, tmp_path: Path) -> None:
    """examples/verl_hcapo.py's overrides are valid in verl 0.9.1's Hydra config (printed by
    ``--cfg job``, nothing is trained), and the Ray setup hook it names is importable there."""
    # one process of that venv (its imports cost ~10 s): the example as `python verl_hcapo.py ARGS` runs
    # it, then the hook's own import by name, as Ray's worker_process_setup_hook does it
    r = subprocess.run(
        [str(verl_python), "-c", _EXAMPLE_THEN_HOOK, str(ROOT / "examples" / "verl_hcapo.py")]
        + ["--store", str(tmp_path / "s.db"), "--tokenizer", str(tmp_path), "--weight-version", "v7", "--"]
        + ["--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_verl_venv.run_env(),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    config, _, hook = r.stdout.rpartition(_HOOK_MARK)
    for line in (
        "adv_estimator: hcapo",
        "use_kl_in_reward: false",
        "worker_process_setup_hook: hcapo_store.training.verl.setup",
        f"HCAPO_STORE: {tmp_path / 's.db'}",
        "HCAPO_WEIGHT_VERSION: v7",
    ):
        assert line in config, line
    assert "RewardManagerConfig\n    source: register\n    name: hcapo\n" in config
    assert hook.strip() == "True", r.stderr[-2000:]


# `python SCRIPT ARGS` (argv, __main__; a status 0 exit goes on), then the setup hook imported by name
_HOOK_MARK = "\n--- setup hook callable: "
_EXAMPLE_THEN_HOOK = f"""
import importlib, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, __import__("os").path.dirname(sys.argv[0]))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    if exc.code not in (None, 0):
        raise
sys.stdout.flush()
print({_HOOK_MARK!r} + str(callable(importlib.import_module("hcapo_store.training.verl").setup)))
"""


def test_the_example_gets_through_ray_init_with_the_hooks_registered(verl_python: Path, tmp_path: Path) -> None:
    """examples/verl_hcapo.py for real on a CPU, past ``--cfg job``: verl's own ``run_ppo`` starts
    Ray with the run's runtime_env (every env var a string: the wait 600.0 included) and the setup
    hook; a worker of the run has ``hcapo`` as verl's estimator and reward manager; then, with no
    GPU for an inference engine, the example stops with one line instead of waiting."""
    minimal = [
        f"actor_rollout_ref.{part}_micro_batch_size_per_gpu=1"
        for part in ("actor.ppo", "rollout.log_prob", "ref.log_prob")
    ]
    r = subprocess.run(
        [str(verl_python), str(ROOT / "examples" / "verl_hcapo.py"), "--store", str(tmp_path / "s.db")]
        + ["--tokenizer", str(tmp_path), "--wait", "600", "--", *minimal],
        capture_output=True,
        text=True,
        # waits for the run to end; the bound is for a hang only: ~30 s here, but under
        # `stress-ng --cpu 4` on 2 cores the Ray worker's setup hook (verl and torch imported)
        # took 9.5 minutes to start the actor
        timeout=1800,
        env={**_verl_venv.run_env(), "CUDA_VISIBLE_DEVICES": "", "RAY_USAGE_STATS_ENABLED": "0"},
        cwd=tmp_path,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    (init,) = [line for line in r.stdout.splitlines() if line.startswith("ray init kwargs")]
    assert "'HCAPO_WAIT': '600.0'" in init and "'worker_process_setup_hook': 'hcapo_store.training.verl.setup'" in init
    (seen,) = [json.loads(line)["ray_worker"] for line in r.stdout.splitlines() if line.startswith('{"ray_worker"')]
    assert seen["estimator"] is True and seen["reward_manager"] is True
    assert seen["env"]["HCAPO_WAIT"] == "600.0" and seen["env"]["HCAPO_STORE"] == str(tmp_path / "s.db")
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("verl_hcapo: no GPU for verl's inference engine") and "registered in a Ray worker" in last
