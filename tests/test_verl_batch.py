"""VerlHandoff without verl: the fast match (a sample equal to a member's rendering) against
the plain rule (place every member's steps in the sample's ids, keep the one that fits), the
tokenizer shared across a step's runs against fresh hand-offs, write_rollout, and
bench/verl_handoff.py end to end at a small size. Real store, real follow, the tiny model
scoring in process."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hcapo_store.credits.equations import CreditParams
from hcapo_store.devkit.synth import words
from hcapo_store.errors import HandoffError
from hcapo_store.online.batches import find_batch
from hcapo_store.online.follow import FollowConfig, Follower, follow
from hcapo_store.scoring.backends.inprocess import LiveModelBackend
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import Handoff
from hcapo_store.training.verl_batch import VerlHandoff, write_rollout

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow]


def _sample(tok, messages: list[dict]) -> tuple[list[int], list[int], list[int]]:
    def ids(msgs: list[dict], gen: bool) -> list[int]:
        return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False))

    full, prompt = ids(messages, False), ids(messages[:1], True)
    mask = [1] * (len(full) - len(prompt))
    for j in range(2, len(messages)):
        if messages[j]["role"] == "user":
            for t in range(len(ids(messages[:j], False)), len(ids(messages[: j + 1], True))):
                mask[t - len(prompt)] = 0
    return prompt, full[len(prompt) :], mask


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    """3 groups of 3 rollouts, followed by uid; two samples of u1 share their first turn."""
    tmp = tmp_path_factory.mktemp("verl-batch")
    rng = random.Random(3)
    samples = []
    for g in range(3):
        uid = f"u{g}"
        first = {"role": "assistant", "content": words(rng, 5)}
        for k in range(3):
            msgs = [{"role": "user", "content": f"Task {uid}: {words(rng, 8)}"}] if k == 0 else [samples[-1][2][0]]
            msgs = [*msgs, first if (g == 1 and k < 2) else {"role": "assistant", "content": words(rng, 6)}]
            msgs += [
                {"role": "user", "content": f"tool: {words(rng, 5)}"},
                {"role": "assistant", "content": words(rng, 4)},
            ]
            write_rollout(tmp / "rollouts", 1, uid, f"{uid}-{k}", round(rng.random(), 3), msgs)
            samples.append((uid, f"{uid}-{k}", msgs))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    store = Store.open(str(tmp / "s.db"))
    backend = LiveModelBackend(model, weight_version="v1")
    prep = prepare(
        store, ScoreConfig(backend=LiveModelBackend.kind, tokenizer=str(tiny_model_dir), weight_version="v1"), backend
    )
    cfg = FollowConfig([tmp / "rollouts"], 3, "field:uid", params=CreditParams(variant="paper"))
    assert follow(Follower(store, prep, cfg, RunOptions(concurrency=1)), once=True).batches == 3
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [(uid, eid, *_sample(tok, msgs)) for uid, eid, msgs in samples]
    yield {"store": store, "rows": rows, "tmp": tmp}
    store.close()


def _arrays(rows) -> tuple[list, list, np.ndarray, np.ndarray]:
    width = max(len(r[3]) for r in rows) + 4
    resp = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros_like(resp)
    for i, (_, _, _, r, m) in enumerate(rows):
        resp[i, : len(r)], mask[i, : len(m)] = r, m
    return [r[0] for r in rows], [r[2] for r in rows], resp, mask


def test_the_fast_match_agrees_with_placing_every_member(step: dict, tiny_model_dir: Path) -> None:
    store, rows = step["store"], step["rows"]
    uids, prompts, resp, mask = _arrays(rows)
    plug = VerlHandoff(store, tiny_model_dir, weight_version="v1")
    got = plug.advantages(uids, prompts, resp, mask)
    assert [s.external_id for s in plug.last] == [r[1] for r in rows]  # each sample is its own member
    assert plug.last[0].as_dict()["external_id"] == rows[0][1] and plug.last[0].as_dict()["how"] in ("turns", "whole")
    for i, (uid, eid, prompt, response, m) in enumerate(rows):
        info = find_batch(store, uid)
        assert info is not None and info.credit_run
        fresh = Handoff(store, info.credit_run, tokenizer=tiny_model_dir)  # its own tokenizer load
        ids = prompt + response
        # the plain rule: every member's steps placed in the ids; exactly the ones that all fit
        fits = []
        for member in info.members:
            credit = fresh.advantages(member.episode_id, ids, strict=False)
            if credit.spans and not credit.refused:
                fits.append((member.external_id, credit))
        assert [f[0] for f in fits] == [eid], (eid, [f[0] for f in fits])
        want = fits[0][1].advantages[len(prompt) :] * np.asarray(m, dtype=bool)
        assert np.array_equal(got[i, : len(response)], want) and not got[i, len(response) :].any()
        assert np.array_equal(want != 0, fits[0][1].mask[len(prompt) :] & (want != 0))


def test_a_sample_found_in_another_group_is_not_taken(step: dict, tiny_model_dir: Path) -> None:
    """uid u0 with u1's ids: the uid names the group, the ids must be one of its members."""
    rows = step["rows"]
    uids, prompts, resp, mask = _arrays([rows[0], rows[3]])
    uids = ["u0", "u0"]
    with pytest.raises(HandoffError, match=r"^sample 1 \(uid u0\): step 0 is not in its ids for any member"):
        VerlHandoff(step["store"], tiny_model_dir, weight_version="v1").advantages(uids, prompts, resp, mask)


def test_a_mask_that_leaves_out_an_action_is_refused(step: dict, tiny_model_dir: Path) -> None:
    uids, prompts, resp, mask = _arrays(step["rows"][:1])
    mask[0, 0] = 0  # the first response token is the policy's own
    with pytest.raises(HandoffError, match=r"^sample 0 \(uid u0\): step 0's token at response position 0"):
        VerlHandoff(step["store"], tiny_model_dir, weight_version="v1").advantages(uids, prompts, resp, mask)


def test_write_rollout_refuses_a_uid_that_is_no_file_name(tmp_path: Path) -> None:
    path = write_rollout(tmp_path, 7, "abc", "abc-0", 0.5, [{"role": "user", "content": "x"}], extra=1)
    assert path == tmp_path / "step_0007" / "abc.jsonl"
    assert json.loads(path.read_text()) == {
        "episode_id": "abc-0",
        "uid": "abc",
        "reward": 0.5,
        "messages": [{"role": "user", "content": "x"}],
        "extra": 1,
    }
    for bad in ("", "../x", ".hidden"):
        with pytest.raises(HandoffError, match="cannot name a rollout file"):
            write_rollout(tmp_path, 7, bad, "e", 0.5, [])


def test_the_bench_runs_small(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "verl_handoff.py"), "--workdir", str(tmp_path)]
        + ["--groups", "2", "--group-size", "2", "--turns", "2", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["batches"], out["samples"], out["groups"]) == (2, 4, 2) and out["cold_s_median"] > 0
    assert out["matched"] == {"whole": 4}  # the template's render of each conversation
    # as a multi-turn agent loop accumulates them: the store's turns rendering, found as it
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "verl_handoff.py"), "--workdir", str(tmp_path), "--measure-only"]
        + ["--repeats", "1", "--ids", "turns", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["matched"] == {"turns": 4} and out["sample_ids"] == "turns"


def test_exact_refuses_a_sample_whose_tool_result_differs(step: dict, tiny_model_dir: Path) -> None:
    """A token changed inside a tool result: every action is still there (found by search,
    said in ``how``); ``exact=True`` refuses it by sample."""
    rows = step["rows"][:1]
    uids, prompts, resp, mask = _arrays(rows)
    plain = VerlHandoff(step["store"], tiny_model_dir, weight_version="v1")
    before = plain.advantages(uids, prompts, resp, mask)
    assert plain.last[0].how in ("turns", "whole")
    tool = int(np.flatnonzero(mask[0] == 0)[2])  # inside the tool result (mask 0 there)
    resp[0, tool] += 1
    after = plain.advantages(uids, prompts, resp, mask)
    assert plain.last[0].how == "search" and np.array_equal(before, after)
    strict = VerlHandoff(step["store"], tiny_model_dir, weight_version="v1", exact=True)
    with pytest.raises(HandoffError, match=r"^sample 0 \(uid u0\): its ids are no member's rendering"):
        strict.advantages(uids, prompts, resp, mask)


def test_a_long_run_keeps_only_the_current_steps_hand_offs(step: dict, tiny_model_dir: Path) -> None:
    """Every step brings new groups: the hand-offs (and their cached renderings) of groups no
    longer asked for are dropped, the tokenizer loaded once is kept."""
    plug = VerlHandoff(step["store"], tiny_model_dir, weight_version="v1")
    rows = step["rows"]
    for g in range(3):
        group = [r for r in rows if r[0] == f"u{g}"]
        plug.advantages(*_arrays(group))
        assert set(plug._handoffs) == {find_batch(step["store"], f"u{g}").credit_run}
    assert plug._base is not None and all(h.tokenizer is plug._base.tokenizer for h in plug._handoffs.values())


def test_two_identical_rollouts_with_two_rewards_are_refused_not_both_given_one(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A GRPO group whose two members are the same conversation token for token but got rewards 1
    and 0: the ids cannot tell the samples apart, so neither gets the other's advantage (before,
    both got +1.22); a third, different member of the group is still placed."""
    rng = random.Random(11)
    same = [
        {"role": "user", "content": f"Task: {words(rng, 8)}"},
        {"role": "assistant", "content": words(rng, 5)},
        {"role": "user", "content": f"tool: {words(rng, 5)}"},
        {"role": "assistant", "content": words(rng, 4)},
    ]
    other = [*same[:1], {"role": "assistant", "content": words(rng, 6)}]
    for k, (reward, msgs) in enumerate(((1.0, same), (0.0, same), (0.5, other))):
        write_rollout(tmp_path / "rollouts", 1, "g", f"g-{k}", reward, msgs)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with Store.open(str(tmp_path / "s.db")) as store:
        backend = LiveModelBackend(model, weight_version="v1")
        config = ScoreConfig(backend=LiveModelBackend.kind, tokenizer=str(tiny_model_dir), weight_version="v1")
        prep = prepare(store, config, backend)
        cfg = FollowConfig([tmp_path / "rollouts"], 3, "field:uid", params=CreditParams(variant="paper"))
        assert follow(Follower(store, prep, cfg, RunOptions(concurrency=1)), once=True).batches == 1
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        rows = [("g", f"g-{k}", *_sample(tok, m)) for k, m in enumerate((same, same, other))]
        uids, prompts, resp, mask = _arrays(rows)
        plug = VerlHandoff(store, tiny_model_dir, weight_version="v1")
        with pytest.raises(HandoffError) as refused:
            plug.advantages(uids, prompts, resp, mask)
        problems = refused.value.problems  # type: ignore[attr-defined]
        assert [p.split(":")[0] for p in problems] == ["sample 0 (uid g)", "sample 1 (uid g)"]
        assert all("rendering of 2 members of its group with other advantages" in p for p in problems)
        assert "identical rollouts with different rewards cannot be told apart" in problems[0]
        # the different member alone is placed as before
        uids, prompts, resp, mask = _arrays(rows[2:])
        assert plug.advantages(uids, prompts, resp, mask).any() and plug.last[0].external_id == "g-2"


def _follow_group(tmp_path: Path, tiny_model_dir: Path, rollouts: list[tuple[str, float, list[dict]]]) -> Store:
    for eid, reward, msgs in rollouts:
        write_rollout(tmp_path / "rollouts", 1, "g", eid, reward, msgs)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    store = Store.open(str(tmp_path / "s.db"))
    backend = LiveModelBackend(model, weight_version="v1")
    config = ScoreConfig(backend=LiveModelBackend.kind, tokenizer=str(tiny_model_dir), weight_version="v1")
    prep = prepare(store, config, backend)
    cfg = FollowConfig([tmp_path / "rollouts"], len(rollouts), "field:uid", params=CreditParams(variant="paper"))
    assert follow(Follower(store, prep, cfg, RunOptions(concurrency=1)), once=True).batches == 1
    return store


def _turns(task: str, actions: list[str], tools: list[str]) -> list[dict]:
    msgs = [{"role": "user", "content": task}]
    for k, action in enumerate(actions):
        msgs.append({"role": "assistant", "content": action})
        if k < len(actions) - 1:
            msgs.append({"role": "user", "content": tools[k]})
    return msgs


def test_a_member_with_fewer_steps_never_takes_a_samples_place(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Rollout A = [ls, cat a.txt, submit], B = [ls, cat a.txt] (same first turns, reward 0): a
    sample of A whose last turn verl cut (no end-of-turn token) cannot be placed as A, and B's
    steps are all in its ids; B's advantage (of the other sign) must not land on it. Before, it
    did (how="search"). The whole sample of A is still A."""
    task = "Task: find the answer in the files"
    a = _turns(task, ["ls", "cat a.txt", "submit 42 because the file says so"], ["tool: a.txt", "tool: 42"])
    b = _turns(task, ["ls", "cat a.txt"], ["tool: a.txt"])
    c = _turns(task, ["pwd", "ls -la"], ["tool: /"])
    with _follow_group(tmp_path, tiny_model_dir, [("g-A", 1.0, a), ("g-B", 0.0, b), ("g-C", 0.5, c)]) as store:
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        prompt, response, mask = _sample(tok, a)
        plug = VerlHandoff(store, tiny_model_dir, weight_version="v1")
        whole = plug.advantages(*_arrays([("g", "g-A", prompt, response, mask)]))
        assert plug.last[0].external_id == "g-A" and (whole > 0).sum() > 0 and not (whole < 0).any()
        cut = [("g", "g-A", prompt, response[:-4], mask[:-4])]
        with pytest.raises(HandoffError) as refused:
            plug.advantages(*_arrays(cut))
        problem = refused.value.problems[0]  # type: ignore[attr-defined]
        assert problem.startswith("sample 0 (uid g): no member of its group has every policy turn of its response")
        assert "g-B leaves the policy's tokens at response positions" in problem


def test_a_sample_of_a_member_the_batch_could_not_credit_is_refused_naming_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A's line was refused by ingest (a NaN reward): the batch publishes with B and C and names
    A as failed; A's sample, whose first turns are B's, gets neither B's advantage nor a silent
    0 on its last turn: it is refused, naming the failed member and why."""
    task = "Task: find the answer in the files"
    a = _turns(task, ["ls", "cat a.txt", "submit 42 because the file says so"], ["tool: a.txt", "tool: 42"])
    b = _turns(task, ["ls", "cat a.txt"], ["tool: a.txt"])
    c = _turns(task, ["pwd", "ls -la"], ["tool: /"])
    rollouts = [("g-A", float("nan"), a), ("g-B", 0.0, b), ("g-C", 0.5, c)]
    with _follow_group(tmp_path, tiny_model_dir, rollouts) as store:
        info = find_batch(store, "g")
        assert info is not None and [m.external_id for m in info.members] == ["g-B", "g-C"]
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        with pytest.raises(HandoffError) as refused:
            VerlHandoff(store, tiny_model_dir, weight_version="v1").advantages(
                *_arrays([("g", "g-A", *_sample(tok, a))])
            )
        problem = refused.value.problems[0]  # type: ignore[attr-defined]
        assert "g-B leaves the policy's tokens" in problem and "its batch could not credit 1 member(s)" in problem
        assert "reward must be a finite number" in problem
