"""Scoring end to end: real SQLite files, the real reference server over real HTTP (in a
thread), the library and the CLI; stored values checked against an independent forward
pass of the same tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from faultserver import step_prompts, step_requests, stored_scores
from sqlalchemy import text
from transformers import AutoModelForCausalLM, AutoTokenizer

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.prompts import PromptBuilder, hindsight_text
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.scoring.scorer import scorer_label
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store, count

MAX_CONTEXT = 2048
EPISODES = 3


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, EPISODES, steps_per_subtask=1, output_words=20)
    return root


def _cfg(ref: ReferenceServer, tiny_model_dir: Path, **kw: Any) -> ScoreConfig:
    return ScoreConfig(backend="sglang", server=ref.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT, **kw)


def _new_store(path: Path, episodes_dir: Path) -> Store:
    store = Store.open(str(path))
    report = ingest(store, [episodes_dir])
    assert report.new == EPISODES and report.failed == 0
    return store


def _steps(store: Store) -> int:
    return count(store, "SELECT COUNT(*) FROM steps")


def _attempt_states(store: Store, scorer_id: str) -> dict[str, int]:
    with store.engine.connect() as conn:
        return dict(
            conn.execute(
                text("SELECT status, COUNT(*) FROM attempts WHERE scorer_id = :s GROUP BY status"), {"s": scorer_id}
            ).all()
        )


@pytest.fixture(scope="module")
def scored(
    tmp_path_factory: pytest.TempPathFactory, episodes_dir: Path, ref: ReferenceServer, tiny_model_dir: Path
) -> Iterator[tuple[Store, Any, Any]]:
    """A database scored once through the library against the reference server."""
    store = _new_store(tmp_path_factory.mktemp("scored") / "x.db", episodes_dir)
    prep = prepare(store, _cfg(ref, tiny_model_dir))
    report = run_scoring(store, prep, RunOptions(concurrency=4))
    yield store, prep, report
    store.close()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()


def _normalize(message: dict[str, Any]) -> dict[str, Any]:
    """Written here from docs/SCORING.md (arguments as mappings), independently of hcapo_store.rendering.prompts."""
    out = {k: v for k, v in message.items() if v is not None}
    calls = []
    for call in out.get("tool_calls") or []:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"])
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
            except json.JSONDecodeError:
                pass
        calls.append({**call, "function": function})
    if calls:
        out["tool_calls"] = calls
    return out


def _expected_by_hand(tokenizer: Any, messages: list[dict], outcome: Any, step: Any) -> tuple[list[int], int]:
    """(full ids, first scored position) for an untruncated step, straight from the chat template."""
    m = step.message_index
    msgs = [_normalize(x) for x in messages[: m + 1]]
    msgs[0] = {**msgs[0], "content": (msgs[0].get("content") or "") + "\n\n" + hindsight_text(outcome, step)}
    prefix = tokenizer.apply_chat_template(msgs[:m], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert full_ids[: len(prefix_ids)] == prefix_ids
    action = len(full_ids) - len(prefix_ids)
    assert 0 < action and len(full_ids) <= MAX_CONTEXT, "pick an untruncated step"
    return full_ids, len(full_ids) - min(action, 2048)


def _forward_logprobs(model: Any, ids: list[int], first_scored: int) -> np.ndarray:
    with torch.inference_mode():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    positions = torch.arange(first_scored, len(ids))
    return logp[positions - 1, torch.tensor(ids[first_scored:])].numpy()


def test_library_scores_every_step_with_values_of_a_direct_forward_pass(scored, tiny_model_dir, model):
    store, prep, report = scored
    n = _steps(store)
    assert n == 15 * EPISODES
    assert (report.planned, report.scored, report.failed, report.retried) == (n, n, 0, 0)
    assert count(store, "SELECT COUNT(*) FROM scores WHERE scorer_id = :s", s=prep.scorer_id) == n
    assert _attempt_states(store, prep.scorer_id) == {"done": n}

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    reference_builder = PromptBuilder(tokenizer, max_context=MAX_CONTEXT)
    stored = stored_scores(store, prep.scorer_id)
    checked = {"by_hand": 0, "truncated": 0}
    with store.engine.connect() as conn:
        episode_ids = [r for (r,) in conn.execute(text("SELECT id FROM episodes ORDER BY id"))]
        episodes = [load_episode(conn, e) for e in episode_ids]
    for episode in episodes[:2]:
        for step in (episode.steps[0], episode.steps[len(episode.steps) // 2], episode.steps[-1]):
            mean, blob, token_count = stored[(episode.name, step.step_index)]
            # The fast builder's prompt agrees with the straightforward one...
            ref_prompt = reference_builder.build_step_reference(episode.messages, episode.outcome, step)
            if ref_prompt.truncated_prefix_tokens == 0:
                # ... and, untruncated, with the chat template applied by hand.
                ids, first = _expected_by_hand(tokenizer, episode.messages, episode.outcome, step)
                assert (ids, first) == (ref_prompt.input_ids, ref_prompt.first_scored)
                checked["by_hand"] += 1
            else:
                ids, first = ref_prompt.input_ids, ref_prompt.first_scored
                assert len(ids) <= MAX_CONTEXT
                checked["truncated"] += 1
            expected = _forward_logprobs(model, ids, first)
            values = np.frombuffer(blob, dtype="<f4")
            assert token_count == len(values) == len(expected) > 0
            np.testing.assert_allclose(values, expected, atol=1e-4, rtol=0)
            assert mean == pytest.approx(float(expected.astype(np.float64).mean()), abs=1e-4)
            assert mean == pytest.approx(float(values.astype(np.float64).mean()), abs=1e-12)
    assert checked["by_hand"] >= 2


def test_rerun_sends_no_request(scored, ref, tiny_model_dir):
    store, prep, _ = scored
    before = ref.requests
    again = prepare(store, _cfg(ref, tiny_model_dir))
    assert again.scorer_id == prep.scorer_id  # same options, same scorer: the run resumes
    report = run_scoring(store, again, RunOptions(concurrency=4))
    assert (report.planned, report.scored, report.failed) == (0, 0, 0)
    assert ref.requests == before


def test_cli_dry_run_limit_resume(tmp_path, runner, episodes_dir, ref, tiny_model_dir, scored):
    db = str(tmp_path / "x.db")
    store = _new_store(tmp_path / "x.db", episodes_dir)
    n = _steps(store)
    base = [
        "--db",
        db,
        "score",
        "--server",
        ref.url,
        "--tokenizer",
        str(tiny_model_dir),
        "--max-context",
        str(MAX_CONTEXT),
    ]

    before = ref.requests
    r = runner.invoke(cli, [*base, "--dry-run", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    dry = json.loads(r.output)
    assert ref.requests == before  # nothing sent
    assert (dry["steps"], dry["episodes"], dry["prompt_failures"]) == (n, EPISODES, 0)
    prompts = step_prompts(store, scored[1].builder)
    requests = step_requests(store, scored[1].builder)
    groups = {rk: [prompts[k] for k in keys] for rk, keys in requests.items()}
    assert dry["requests"] == len(requests) < n  # grouped by default
    assert dry["prompt_tokens"] == sum(len(members[-1].input_ids) for members in groups.values())
    assert dry["scored_tokens"] == sum(p.scored_tokens for p in prompts.values())
    r = runner.invoke(cli, [*base, "--dry-run", "--json", "--grouping", "per-step"], catch_exceptions=False)
    per_step = json.loads(r.output)
    assert per_step["requests"] == n and per_step["prompt_tokens"] == sum(len(p.input_ids) for p in prompts.values())
    assert count(store, "SELECT COUNT(*) FROM scores") == 0
    r = runner.invoke(cli, [*base, "--dry-run"], catch_exceptions=False)
    assert f"{n} step(s) in {EPISODES} episode(s)" in r.output and "nothing was sent" in r.output
    assert ref.requests == before

    # --limit with several workers in flight: at most N steps, at most N requests (grouped).
    r = runner.invoke(cli, [*base, "--limit", "5", "--concurrency", "4", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["scored"] == 5
    assert count(store, "SELECT COUNT(*) FROM scores") == 5
    assert before < ref.requests <= before + 5
    r = runner.invoke(cli, [*base, "--dry-run", "--json"], catch_exceptions=False)
    assert json.loads(r.output)["steps"] == n - 5

    # The rest, resumed one request per step: exactly the missing steps are requested.
    limited = ref.requests
    r = runner.invoke(cli, [*base, "--grouping", "per-step"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"scored {n - 5}, failed 0" in r.output
    assert ref.requests == limited + n - 5
    r = runner.invoke(cli, base, catch_exceptions=False)
    assert "scored 0, failed 0" in r.output
    assert ref.requests == limited + n - 5

    # Same scorer as the library run (grouping is not part of it), same values.
    library_store, library_prep, _ = scored
    sid = store.query("SELECT id FROM scorers")[1]
    assert sid == [(library_prep.scorer_id,)]
    _assert_same_values(
        stored_scores(store, library_prep.scorer_id), stored_scores(library_store, library_prep.scorer_id)
    )
    r = runner.invoke(cli, ["--db", db, "status"], catch_exceptions=False)
    assert f"scored {n} / failed 0 / missing 0" in r.output
    store.close()


def _assert_same_values(got: dict, expected: dict, atol: float = 1e-5) -> None:
    """Per step: the same token count, per-token values and mean within float tolerance
    (grouped and per-step requests differ only in the server's reduction order)."""
    assert got.keys() == expected.keys()
    for key, (mean, blob, token_count) in expected.items():
        assert got[key][2] == token_count, key
        np.testing.assert_allclose(np.frombuffer(got[key][1], "<f4"), np.frombuffer(blob, "<f4"), atol=atol, rtol=0)
        assert got[key][0] == pytest.approx(mean, abs=atol), key


def test_transformers_backend_stores_the_same_values(scored, tiny_model_dir, runner):
    store, server_prep, _ = scored
    n = _steps(store)
    prep = prepare(store, ScoreConfig(backend="transformers", model=str(tiny_model_dir), max_context=MAX_CONTEXT))
    assert prep.scorer_id != server_prep.scorer_id  # another backend kind is another scorer
    report = run_scoring(store, prep, RunOptions(concurrency=2))
    assert (report.scored, report.failed) == (n, 0)
    local, served = stored_scores(store, prep.scorer_id), stored_scores(store, server_prep.scorer_id)
    assert local.keys() == served.keys() and len(local) == n
    for key, (mean, blob, token_count) in served.items():
        assert local[key][2] == token_count
        np.testing.assert_allclose(np.frombuffer(local[key][1], "<f4"), np.frombuffer(blob, "<f4"), atol=1e-5, rtol=0)
        assert local[key][0] == pytest.approx(mean, abs=1e-5)

    r = runner.invoke(
        cli, ["--db", store.url[len("sqlite:///") :], "scorers", "list", "--json"], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    rows = {row["scorer_id"]: row for row in json.loads(r.output)}
    for sid in (prep.scorer_id, server_prep.scorer_id):
        assert (rows[sid]["scored"], rows[sid]["failed"], rows[sid]["missing"]) == (n, 0, 0)
    assert rows[prep.scorer_id]["spec"]["backend"]["kind"] == "transformers"
    r = runner.invoke(cli, ["--db", store.url[len("sqlite:///") :], "scorers", "list"], catch_exceptions=False)
    assert prep.scorer_id[:12] in r.output and server_prep.scorer_id[:12] in r.output


def test_policy_action_span_scores_exactly_the_policys_tokens(scored, ref, tiny_model_dir, runner):
    """--action-span policy: a scorer of its own whose logprobs are the rendered span's, less the
    tokens the template adds after the end-of-turn token (the demo ChatML template inserts no
    wrapper before the text, and its "\n" after <|im_end|> is the only token left out)."""
    store, prep, _ = scored
    own = prepare(store, _cfg(ref, tiny_model_dir, action_span="policy"))
    assert own.scorer_id != prep.scorer_id and own.spec["action_span"] == "policy"
    assert "span=policy" in scorer_label(own.spec) and "action_span" not in prep.spec
    report = run_scoring(store, own, RunOptions(concurrency=2))
    n = _steps(store)
    assert (report.scored, report.failed) == (n, 0)
    rendered, policy = stored_scores(store, prep.scorer_id), stored_scores(store, own.scorer_id)
    assert rendered.keys() == policy.keys()
    for key, (mean, blob, token_count) in policy.items():
        want = np.frombuffer(rendered[key][1], "<f4")
        assert token_count == rendered[key][2] - 1, key
        # The two scorers' requests group differently, so the server's float32 reductions differ
        # slightly; a one-token shift would differ by tenths.
        np.testing.assert_allclose(np.frombuffer(blob, "<f4"), want[:-1], atol=2e-3, rtol=0)
        assert mean == pytest.approx(float(want[:-1].astype(np.float64).mean()), abs=2e-3)


def test_scorer_identity_and_max_logprob_tokens(scored, ref, tiny_model_dir):
    store, prep, _ = scored
    assert prepare(store, _cfg(ref, tiny_model_dir)).scorer_id == prep.scorer_id
    short = prepare(store, _cfg(ref, tiny_model_dir, max_logprob_tokens=8))
    assert short.scorer_id != prep.scorer_id and short.spec["max_logprob_tokens"] == 8
    report = run_scoring(store, short, RunOptions(concurrency=4))
    n = _steps(store)
    assert report.scored == n
    full, tail = stored_scores(store, prep.scorer_id), stored_scores(store, short.scorer_id)
    for key, (_mean, blob, token_count) in tail.items():
        assert token_count == 8
        # Same input ids (truncation depends on max_context only): the last 8 values agree.
        np.testing.assert_allclose(
            np.frombuffer(blob, "<f4"), np.frombuffer(full[key][1], "<f4")[-8:], atol=1e-5, rtol=0
        )
    with store.engine.connect() as conn:
        skipped = conn.execute(
            text("SELECT MIN(skipped_action_tokens) FROM scores WHERE scorer_id = :s"), {"s": short.scorer_id}
        ).scalar_one()
    assert skipped > 0


def test_template_token_weight_of_a_rendered_scorer(scored, ref, tiny_model_dir):
    """The demo template's only template token in a rendered action is the newline after
    <|im_end|>: one per step, and the shift is the step's mean minus the mean without it."""
    from hcapo_store.scoring.template_weight import template_token_weight

    store, prep, _ = scored
    got = template_token_weight(store, prep.scorer_id, tiny_model_dir)
    stored = stored_scores(store, prep.scorer_id)
    n = _steps(store)
    assert (got["steps"], got["not_comparable"], got["template_tokens"]) == (n, 0, n)
    assert got["scored_tokens"] == sum(v[2] for v in stored.values())
    shifts = []
    for _mean, blob, _count in stored.values():
        values = np.frombuffer(blob, "<f4").astype(np.float64)
        shifts.append(values.mean() - values[:-1].mean())
    assert got["mean_shift"] == pytest.approx(float(np.mean(shifts)), abs=1e-12)
    assert got["max_abs_shift"] == pytest.approx(float(np.max(np.abs(shifts))), abs=1e-12)
    own = prepare(store, _cfg(ref, tiny_model_dir, action_span="policy"))
    run_scoring(store, own, RunOptions(concurrency=2))
    assert template_token_weight(store, own.scorer_id, tiny_model_dir)["template_token_share"] == 0.0


def test_no_hindsight_is_a_baseline_scorer_without_the_outcome(scored, ref, tiny_model_dir):
    """score --no-hindsight: the same conversation without the hindsight block, a scorer of its own."""
    store, prep, _ = scored
    base = prepare(store, _cfg(ref, tiny_model_dir, hindsight=False))
    assert base.scorer_id != prep.scorer_id and base.spec["hindsight"] is False
    assert "hindsight_template_sha256" not in base.spec and "no-hindsight" in scorer_label(base.spec)
    before = len(ref.sequences_seen)
    report = run_scoring(store, base, RunOptions(concurrency=2))
    n = _steps(store)
    assert (report.scored, report.failed) == (n, 0)
    sent = ref.sequences_seen[before:]
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert sent and not any("HINDSIGHT" in tok.decode(p) for p in sent)
    assert all("HINDSIGHT" in tok.decode(p) for p in ref.sequences_seen[:before])
    # The same action tokens are scored: equal counts per step, different values.
    hind, plain = stored_scores(store, prep.scorer_id), stored_scores(store, base.scorer_id)
    assert {k: v[2] for k, v in hind.items()} == {k: v[2] for k, v in plain.items()}
    assert any(abs(hind[k][0] - plain[k][0]) > 1e-4 for k in hind)


def test_a_held_database_lock_does_not_stop_requests(tmp_path, ref, tiny_model_dir, monkeypatch):
    """Results are written off the event loop: while another process holds the write lock
    for a long time, requests go on (the results wait in memory) and every one is stored after."""
    import sqlite3
    import threading

    from _waiting import wait_until

    monkeypatch.setenv("HCAPO_STORE_BUSY_TIMEOUT", "3600")  # a writer would wait, not fail
    root = tmp_path / "eps"
    write_standard_episodes(root, 1, steps_per_subtask=8, output_words=10)
    path = tmp_path / "locked.db"
    store = Store.open(str(path))
    ingest(store, [root])
    total = _steps(store)
    assert total >= 20
    prep = prepare(store, _cfg(ref, tiny_model_dir))
    reports: list[Any] = []
    runner = threading.Thread(
        target=lambda: reports.append(run_scoring(store, prep, RunOptions(concurrency=1, grouping="none"))),
        daemon=True,
    )
    runner.start()
    wait_until(lambda: count(store, "SELECT COUNT(*) FROM scores") >= 1, "a first result is stored")
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # another writer holds the database from now on
    try:
        stored, served = count(store, "SELECT COUNT(*) FROM scores"), ref.requests
        assert total - stored >= 8
        wait_until(lambda: ref.requests >= served + 5, "requests go on while the lock is held", timeout=600)
        assert count(store, "SELECT COUNT(*) FROM scores") == stored  # nothing written meanwhile
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    runner.join(timeout=600)
    assert not runner.is_alive() and reports, "the run finishes once the lock is gone"
    assert reports[0].scored == total and reports[0].failed == 0
    assert count(store, "SELECT COUNT(*) FROM scores") == total
    store.close()


def test_a_run_leaves_the_processs_gc_freeze_as_it_found_it(tmp_path, episodes_dir, ref, tiny_model_dir):
    """The run freezes the heap it starts with (its full collections cost more than the
    bookkeeping) and unfreezes it after; where the process froze its own heap first (a trainer
    before it forks), the run neither adds to that freeze nor ends it."""
    import gc

    assert gc.get_freeze_count() == 0
    for froze in (False, True):
        store = _new_store(tmp_path / f"{froze}.db", episodes_dir)
        prep = prepare(store, _cfg(ref, tiny_model_dir))
        frozen_before = 0
        if froze:
            gc.freeze()
            frozen_before = gc.get_freeze_count()
            assert frozen_before > 0
        try:
            report = run_scoring(store, prep, RunOptions(concurrency=2))
            assert report.scored == _steps(store) > 0 and report.failed == 0
            # as found: none frozen, or the process's freeze still on and nothing added to it (frozen
            # objects freed meanwhile leave it, so the count may only go down)
            assert 0 < gc.get_freeze_count() <= frozen_before if froze else gc.get_freeze_count() == 0
        finally:
            gc.unfreeze()
            store.close()
