"""Log-ratio runs on the online paths (issue 42): ``follow --variant log-ratio`` and TRL's
``StoreAdvantages(variant="log-ratio")`` compute each batch's run as teacher − student, and the
advantages that reach the trainer carry that signal: non-zero where the two logprobs differ,
equal to a plain subtraction of the stored scores, and moved when a stored teacher logprob
moves. A real follower over real files, a real server over a tiny real model, real SQLite."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.credits.log_ratio import LogRatioParams, compute_log_ratio
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.online.follow import FollowConfig, Follower
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _line(i: int, reward: float) -> str:
    return json.dumps(
        {
            "episode_id": f"ep-{i}",
            "reward": reward,
            "messages": [
                {"role": "user", "content": f"task {i}"},
                {"role": "assistant", "content": f"I will look {i}."},
                {"role": "user", "content": "ok"},
                {"role": "assistant", "content": f"done {i}"},
            ],
        }
    )


def _scores(store: Store, scorer: str) -> dict[int, np.ndarray]:
    """step id -> the scorer's stored per-token logprobs (float32), read plainly."""
    rows = store.query("SELECT step_id, token_logprobs FROM scores WHERE scorer_id = :s", {"s": scorer})[1]
    return {int(s): np.frombuffer(bytes(b), dtype="<f4") for s, b in rows}


def _steps(store: Store) -> dict[tuple[str, int], int]:
    rows = store.query("SELECT e.name, s.step_index, s.id FROM steps s JOIN episodes e ON e.id = s.episode_id")[1]
    return {(n, int(i)): int(sid) for n, i, sid in rows}


def _placed(store: Store, run: str, tokenizer: Path) -> dict[tuple[str, int], np.ndarray]:
    """What the trainers' hand-off places on each step's own tokens of each episode."""
    from hcapo_store.training.handoff import Handoff

    handoff = Handoff(store, run, tokenizer=tokenizer)
    names = [n for (n,) in store.query("SELECT name FROM episodes WHERE is_current")[1]]
    out = {}
    for name in names:
        credit = handoff.advantages(name, handoff.rendered_ids(name))
        assert not credit.refused, credit.refused
        for index, (a, b) in credit.spans.items():
            out[(name, int(index))] = np.asarray(credit.advantages[a:b], dtype=np.float32)
    return out


def test_follow_publishes_log_ratio_batches_whose_handoff_is_teacher_minus_student(
    tmp_path: Path, ref: ReferenceServer, tiny_model_dir: Path
) -> None:
    root = tmp_path / "jsonl"
    root.mkdir()
    (root / "eps.jsonl").write_text(_line(0, 1.0) + "\n" + _line(1, 0.0) + "\n")
    with Store.open(str(tmp_path / "s.db")) as store:
        cfg = ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048, action_span="policy")
        teacher = prepare(store, cfg)
        student = prepare(store, dataclasses.replace(cfg, hindsight=False))
        follow_cfg = FollowConfig(paths=[root], group_size=2, log_ratio=LogRatioParams(), against="no-hindsight")
        follower = Follower(store, teacher, follow_cfg, RunOptions(), student=student)
        (batch,) = follower.cycle().published
        assert batch.status == "ready" and batch.credit_run is not None, batch
        run = store.query("SELECT variant, scorer_id, params FROM credit_runs WHERE name = :n", {"n": batch.credit_run})
        variant, scorer_id, params = run[1][0]
        assert (variant, scorer_id, json.loads(params)["against"]) == (
            "log-ratio",
            teacher.scorer_id,
            student.scorer_id,
        )
        t, s = _scores(store, teacher.scorer_id), _scores(store, student.scorer_id)
        steps = _steps(store)
        assert len(t) == len(s) == len(steps) == 4
        placed = _placed(store, batch.credit_run, tiny_model_dir)
        assert set(placed) == set(steps)
        for key, step_id in steps.items():
            want = t[step_id].astype(np.float64) - s[step_id].astype(np.float64)  # kl_coef 1, no gate, A_i 0
            np.testing.assert_allclose(placed[key], want, rtol=0, atol=1e-6)
        every = np.concatenate(list(placed.values()))
        assert np.count_nonzero(every) > len(every) // 2  # the hindsight block moves the logprobs: a signal
        # a second cycle publishes nothing again
        assert follower.cycle().published == []

        # the signal follows the stored teacher logprob: move one token's by +0.75, recompute the batch's run
        key = min(steps)
        step_id = steps[key]
        moved = t[step_id].copy()
        moved[0] += 0.75
        with db.write(store.engine) as conn:
            conn.execute(
                text("UPDATE scores SET token_logprobs = :b WHERE step_id = :s AND scorer_id = :t"),
                {"b": moved.astype("<f4").tobytes(), "s": step_id, "t": teacher.scorer_id},
            )
        ids = [int(i) for (i,) in store.query("SELECT id FROM episodes WHERE is_current")[1]]
        again = compute_log_ratio(
            store, LogRatioParams(), scorer=teacher.scorer_id, against=student.scorer_id, episodes=ids, replace=True
        )
        assert again.run.name == batch.credit_run  # the same batch run, recomputed
        after = _placed(store, batch.credit_run, tiny_model_dir)
        assert after[key][0] == pytest.approx(placed[key][0] + 0.75, abs=1e-5)
        np.testing.assert_array_equal(after[key][1:], placed[key][1:])
        for other in set(steps) - {key}:
            np.testing.assert_array_equal(after[other], placed[other])


def test_follow_cli_log_ratio_options_and_one_line_refusals(
    tmp_path: Path, runner, ref: ReferenceServer, tiny_model_dir: Path
) -> None:
    root = tmp_path / "jsonl"
    root.mkdir()
    (root / "eps.jsonl").write_text(_line(0, 1.0) + "\n" + _line(1, 0.5) + "\n")
    db_ = str(tmp_path / "s.db")
    base = ["--db", db_, "follow", str(root), "--server", ref.url, "--tokenizer", str(tiny_model_dir)]
    base += ["--max-context", "2048", "--action-span", "policy", "--group-size", "2", "--once"]
    for extra, message in (
        (["--variant", "log-ratio"], "--variant log-ratio needs --against SCORER"),
        (["--variant", "log-ratio", "--against", "base"], "use --against no-hindsight or --against rollout"),
        (["--variant", "log-ratio", "--against", "rollout", "--omega", "2"], "--omega does not apply"),
        (["--against", "no-hindsight"], "--against applies to --variant log-ratio only"),
        (["--variant", "log-ratio", "--against", "rollout", "--gate-temperature", "0"], "gate_temperature"),
    ):
        r = runner.invoke(cli, [*base, *extra])
        assert r.exit_code == 2 or r.exit_code == 1, r.output
        assert message in r.output, r.output
        assert len([ln for ln in r.output.splitlines() if ln.startswith("Error")]) == 1, r.output
    with Store.open(db_) as store:
        assert store.query("SELECT COUNT(*) FROM batches")[1][0][0] == 0  # nothing published by a refused command
    r = runner.invoke(
        cli,
        [*base, "--variant", "log-ratio", "--against", "no-hindsight", "--gate", "sigmoid", "--grpo", "--json"],
    )
    assert r.exit_code == 0, r.output
    (published,) = [json.loads(ln) for ln in r.output.splitlines() if ln.startswith("{")]
    with Store.open(db_) as store:
        (params,) = store.query(
            "SELECT params FROM credit_runs WHERE name = :n AND variant = 'log-ratio'", {"n": published["credit_run"]}
        )[1][0]
        values = store.query("SELECT advantage FROM step_credits WHERE run = :n", {"n": published["credit_run"]})[1]
    p = json.loads(params)
    assert (p["gate"], p["grpo"], p["kl_coef"]) == ("sigmoid", True, LogRatioParams().kl_coef)
    assert len(values) == 4 and any(v != 0 for (v,) in values)


# ---- TRL's StoreAdvantages ------------------------------------------------------------------------


def _rollouts(tok, model):
    from _rollout_batches import sign_batch

    return sign_batch(tok, model)


def test_store_advantages_log_ratio_reach_the_trainer_as_grpo_plus_teacher_minus_student(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hcapo_store.training.handoff import Handoff
    from hcapo_store.training.trl_grpo import HandoffAdvantages, StoreAdvantages, place

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).float().eval()
    batch = _rollouts(tok, model)
    width = max(map(len, batch.completion_ids))
    with Store.open(str(tmp_path / "s.db")) as store:
        source = StoreAdvantages(
            store,
            tokenizer=tiny_model_dir,
            workdir=tmp_path / "r",
            run_id="lr",
            variant="log-ratio",
            against="no-hindsight",
        )
        trained = place(batch, source(batch), width).numpy()  # what the trainer's loss gets
        run, teacher, student = source.runs[0], source.scorers[0], source.students[0]
        specs = dict(store.query("SELECT id, spec FROM scorers")[1])
        assert json.loads(specs[student])["hindsight"] is False and teacher != student
        assert store.query("SELECT variant FROM credit_runs WHERE name = :n", {"n": run})[1] == [("log-ratio",)]
        t, s = _scores(store, teacher), _scores(store, student)
        step_of = {name: sid for (name, _), sid in _steps(store).items()}
        grpo = [1.0, -1.0, 1.0, -1.0]  # the group's rewards 1, 0, 1, 0 normalised (the default grpo=True)
        for i, ids in enumerate(batch.completion_ids):
            step_id = step_of[source.episodes[0][i]]
            d = t[step_id].astype(np.float64) - s[step_id].astype(np.float64)
            assert len(d) == len(ids)  # the completion's own tokens, scored by both (action_span policy)
            np.testing.assert_allclose(trained[i, : len(ids)], grpo[i] + d, rtol=0, atol=1e-5)
            assert not trained[i, len(ids) :].any()
        signal = trained[:, :width] - np.asarray(grpo)[:, None]
        assert np.count_nonzero(np.abs(signal) > 1e-6) > signal.size // 3

        # move one stored teacher logprob: the batch's run recomputed, the trainer's values move there only
        step_id = step_of[source.episodes[0][2]]
        moved = t[step_id].copy()
        moved[1] -= 0.5
        with db.write(store.engine) as conn:
            conn.execute(
                text("UPDATE scores SET token_logprobs = :b WHERE step_id = :s AND scorer_id = :t"),
                {"b": moved.astype("<f4").tobytes(), "s": step_id, "t": teacher},
            )
        ids = [int(i) for (i,) in store.query("SELECT id FROM episodes WHERE is_current")[1]]
        compute_log_ratio(store, source.log_ratio, scorer=teacher, against=student, episodes=ids, replace=True)
        lookup = HandoffAdvantages(Handoff(store, run, tokenizer=tiny_model_dir), source.episode_name)
        after = place(batch, lookup(batch), width).numpy()
        delta = after - trained
        assert delta[2, 1] == pytest.approx(-0.5, abs=1e-5)
        delta[2, 1] = 0.0
        assert not np.abs(delta).max() > 1e-6


def test_store_advantages_log_ratio_refusals(tmp_path: Path) -> None:
    from hcapo_store.credits.params import CreditParams
    from hcapo_store.training.trl_grpo import StoreAdvantages

    with Store.open(str(tmp_path / "s.db")) as store:
        kw = {"tokenizer": tmp_path, "workdir": tmp_path}
        for extra, message in (
            ({"variant": "log-ratio"}, "needs against='no-hindsight'"),
            ({"variant": "log-ratio", "against": "rollout"}, "needs against='no-hindsight'"),
            ({"variant": "log-ratio", "against": "no-hindsight", "params": CreditParams()}, "params= are HCAPO's"),
            ({"against": "no-hindsight"}, "apply to variant='log-ratio' only"),
            ({"variant": "grpo"}, "variant must be None"),
        ):
            with pytest.raises(ValueError, match=message):
                StoreAdvantages(store, **kw, **extra)  # type: ignore[arg-type]
        source = StoreAdvantages(store, **kw, variant="log-ratio", against="no-hindsight")  # type: ignore[arg-type]
        assert source.log_ratio == LogRatioParams(grpo=True, group_by="group")
        assert source.log_ratio.kl_coef == LogRatioParams().kl_coef  # the library's defaults otherwise


def _rollout_line(tok, i: int, reward: float) -> tuple[str, list[list[float]]]:
    """An OpenAI-shaped record: ``logprobs`` beside each assistant message (its own tokens and the
    end-of-turn token), as a vLLM server reports them."""
    import random

    from test_rollout_scores import _entries

    rng = random.Random(i)
    messages: list[dict] = [{"role": "user", "content": f"task {i}"}]
    values = []
    for t, content in enumerate(["the cat sat", "then it ran"]):
        entries = _entries(tok, content, rng, end=True)
        values.append([e["logprob"] for e in entries])
        messages.append({"role": "assistant", "content": content, "logprobs": {"content": entries}})
        if t == 0:
            messages.append({"role": "user", "content": "go on"})
    record = {"episode_id": f"r{i}", "reward": reward, "engine": "vllm", "model": "policy", "messages": messages}
    return json.dumps(record), values


@pytest.mark.parametrize("allow_mixed", [False, True])
def test_follow_against_the_rollouts_own_logprobs(
    tmp_path: Path, ref: ReferenceServer, tiny_model_dir: Path, allow_mixed: bool
) -> None:
    from hcapo_store.rendering.tokenizers import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    root = tmp_path / "jsonl"
    root.mkdir()
    lines, values = zip(*(_rollout_line(tok, i, float(i)) for i in range(2)))
    (root / "eps.jsonl").write_text("".join(line + "\n" for line in lines))
    with Store.open(str(tmp_path / "s.db")) as store:
        cfg = ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048, action_span="policy")
        teacher = prepare(store, cfg)
        follow_cfg = FollowConfig(
            paths=[root], group_size=2, log_ratio=LogRatioParams(), against="rollout", allow_mixed=allow_mixed
        )
        follower = Follower(store, teacher, follow_cfg, RunOptions())
        (batch,) = follower.cycle().published
        if not allow_mixed:  # the rollouts were sampled by vLLM, the teacher is another engine: refused, said
            assert batch.status == "failed" and batch.credit_run is None
            assert any("differ in engines" in f and "--allow-mixed" in f for f in follower.status.failures)
            return
        assert batch.status == "ready", (batch, follower.status.failures)
        assert not follower.status.failures
        (student,) = [s for (s,) in store.query("SELECT id FROM scorers WHERE spec LIKE '%\"rollout\"%'")[1]]
        t = _scores(store, teacher.scorer_id)
        steps = _steps(store)
        placed = _placed(store, batch.credit_run, tiny_model_dir)
        names = sorted({n for n, _ in steps})
        for e, name in enumerate(names):
            for index in range(2):
                rollout = np.asarray(values[e][index], dtype=np.float32).astype(np.float64)
                want = t[steps[(name, index)]].astype(np.float64) - rollout
                np.testing.assert_allclose(placed[(name, index)], want, rtol=0, atol=1e-5)
        assert student


@pytest.mark.slow
def test_verl_handoff_places_a_log_ratio_batch_per_token(tmp_path: Path, tiny_model_dir: Path) -> None:
    """verl's side (``VerlHandoff``, what the registered ``hcapo`` estimator calls) on a batch a
    log-ratio follower published: each response token of a step gets teacher − student."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hcapo_store.online.batches import find_batch
    from hcapo_store.scoring.backends.inprocess import LiveModelBackend
    from hcapo_store.training.verl_batch import VerlHandoff, write_rollout

    turns = [["look at the box", "open it"], ["look at the door", "close it"]]
    samples = []
    for k, (a, b) in enumerate(turns):
        msgs = [
            {"role": "user", "content": "Task u0: find the key"},
            {"role": "assistant", "content": a},
            {"role": "user", "content": "tool: nothing"},
            {"role": "assistant", "content": b},
        ]
        write_rollout(tmp_path / "rollouts", 1, "u0", f"u0-{k}", float(k), msgs)
        samples.append(msgs)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with Store.open(str(tmp_path / "s.db")) as store:
        backend = LiveModelBackend(model, weight_version="v1")
        cfg = ScoreConfig(
            backend=LiveModelBackend.kind, tokenizer=str(tiny_model_dir), weight_version="v1", action_span="policy"
        )
        teacher = prepare(store, cfg, backend)
        student = prepare(store, dataclasses.replace(cfg, hindsight=False), backend)
        follow_cfg = FollowConfig(
            [tmp_path / "rollouts"], 2, "field:uid", log_ratio=LogRatioParams(grpo=True), against="no-hindsight"
        )
        follower = Follower(store, teacher, follow_cfg, RunOptions(concurrency=1), student=student)
        (batch,) = follower.cycle().published
        assert batch.credit_run is not None and find_batch(store, "u0") is not None
        prompts, responses, masks = [], [], []
        for msgs in samples:
            full = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
            prompt = list(
                tok.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
            )
            tool_end = len(
                tok.apply_chat_template(msgs[:3], tokenize=True, add_generation_prompt=True, return_dict=False)
            )
            tool_start = len(tok.apply_chat_template(msgs[:2], tokenize=True, return_dict=False))
            mask = [0 if tool_start <= len(prompt) + j < tool_end else 1 for j in range(len(full) - len(prompt))]
            prompts.append(prompt)
            responses.append(full[len(prompt) :])
            masks.append(mask)
        width = max(map(len, responses))
        resp = np.zeros((2, width), dtype=np.int64)
        mask = np.zeros_like(resp)
        for i, (r, m) in enumerate(zip(responses, masks)):
            resp[i, : len(r)], mask[i, : len(m)] = r, m
        got = VerlHandoff(store, tiny_model_dir, weight_version="v1").advantages(["u0", "u0"], prompts, resp, mask)
        t, s = _scores(store, teacher.scorer_id), _scores(store, student.scorer_id)
        steps = _steps(store)
        names = {ext: name for name, ext in store.query("SELECT name, external_id FROM episodes")[1]}
        grpo = [-1.0, 1.0]  # rewards 0 and 1 in one group
        for i in range(2):
            name = names[f"u0-{i}"]
            want = [grpo[i] + t[steps[(name, k)]].astype(np.float64) - s[steps[(name, k)]] for k in range(2)]
            flat = np.concatenate(want)
            placed = got[i][got[i] != 0]
            assert len(placed) == len(flat)  # every action token, nothing else (tool result, headers: 0)
            np.testing.assert_allclose(placed, flat, rtol=0, atol=1e-5)


def test_log_ratio_runs_on_postgresql_scoped_and_whole(tmp_path: Path) -> None:
    """The aggregated first pass, the scoped run and the other-tokens refusal on PostgreSQL."""
    from pg import fresh_database
    from test_log_ratio import _episodes, _score

    from hcapo_store.errors import CreditError
    from hcapo_store.ingestion.pipeline import ingest

    spec = json.dumps({"tokenizer": {"files_sha256": "f" * 64}, "backend": {"kind": "sglang", "model": "m"}})
    with fresh_database("family") as url, Store.open(url) as store:
        assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=3)]).failed == 0
        with db.write(store.engine) as conn:
            for sid in ("teacher", "student"):
                conn.execute(
                    text("INSERT INTO scorers (id, label, spec, created_at) VALUES (:i, :l, :s, '2026-11-27')"),
                    {"i": sid, "l": sid, "s": spec},
                )
            steps = conn.execute(text("SELECT id FROM steps ORDER BY id")).scalars().all()
            for k, sid in enumerate(steps):
                _score(conn, "teacher", sid, [-1.0 - k, -0.5])
                _score(conn, "student", sid, [-1.5, -0.5 - k / 4])
        ids = [int(i) for (i,) in store.query("SELECT id FROM episodes ORDER BY id")[1]]
        scoped = compute_log_ratio(store, scorer="teacher", against="student", episodes=ids[:2]).run
        whole = compute_log_ratio(store, scorer="teacher", against="student").run
        assert (scoped.episodes, whole.episodes) == (2, 3) and scoped.name != whole.name
        values = dict(
            store.query("SELECT step_id, log_ratios FROM token_credits WHERE run_id = :r", {"r": whole.id})[1]
        )
        for k, sid in enumerate(steps):
            want = np.asarray([-1.0 - k, -0.5], np.float32).astype(np.float64) - np.asarray(
                [-1.5, -0.5 - k / 4], np.float32
            )
            np.testing.assert_allclose(np.frombuffer(bytes(values[sid]), "<f4"), want, atol=1e-6)
        with db.write(store.engine) as conn:  # one step scored over another count of tokens by the student
            conn.execute(
                text("UPDATE scores SET total_action_tokens = 7 WHERE scorer_id = 'student' AND step_id = :s"),
                {"s": steps[4]},
            )
        with pytest.raises(CreditError, match=r"episode \S+ step \d+: the two scorers scored other tokens"):
            compute_log_ratio(store, LogRatioParams(kl_coef=2.0), scorer="teacher", against="student")
