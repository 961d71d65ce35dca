"""Scoring against a fault-injecting server (tests/faultserver.py) over real HTTP.

The clean value of every step is computed first by calling the reference server's
``generate`` directly, one request per step. Then, with grouped requests (the default):
no wrong value is ever stored, retryable faults are retried and end scored, permanent ones
end failed with the right kind and one ``attempt_errors`` row per failed attempt of every
step of the request, the counts are reported correctly, and ``--retry-failed`` against a
clean server completes the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faultserver import (
    ERROR_KIND,
    FAULTS,
    PERMANENT,
    FaultServer,
    plan_schedule,
    random_schedule,
    request_key,
    step_prompts,
    step_requests,
    stored_scores,
)
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.backends.sglang import build_payload, parse_response
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store

MAX_CONTEXT = 2048
MAX_ATTEMPTS = 4
# A "timeout" fault holds its request until the client gives up, so each costs this much;
# every other request of the planned run must answer well within it, also on a loaded
# machine. The other tests inject no timeouts and keep the client's default (300 s).
CLIENT_TIMEOUT = 10.0
OPTIONS = RunOptions(concurrency=4, max_attempts=MAX_ATTEMPTS, backoff_base=0.01, backoff_cap=0.1)

# Per request (cyclically): the faults of its first attempts; later attempts are answered.
PLANS: list[list[str]] = [
    ["http_500"],
    ["http_503", "http_503"],
    ["http_429"],
    ["timeout"],
    ["drop"],
    ["abort"],
    ["abort_503"],
    ["drop", "http_500", "timeout"],  # three retries, scored at the last attempt
    ["malformed_json"],
    ["missing_logprobs"],
    ["wrong_ids"],
    ["wrong_count"],
    ["http_400"],
    ["null_logprob"],
    ["positive_logprob"],
    ["http_503", "wrong_ids"],  # retried, then a permanent fault
    ["http_503"] * MAX_ATTEMPTS,  # retryable, but the attempts run out
    [],
    [],
]


def _expected_outcome(plan: list[str]) -> tuple[str, list[str]]:
    """('done' | 'failed', the error kinds recorded, in order)."""
    kinds = []
    for fault in plan[:MAX_ATTEMPTS]:
        kinds.append(ERROR_KIND[fault])
        if fault in PERMANENT:
            return "failed", kinds
    return ("failed" if len(kinds) == MAX_ATTEMPTS else "done"), kinds


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:  # also serves the clean runs
        yield server


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 3, seed=7, steps_per_subtask=1, output_words=20)
    return root


@pytest.fixture(scope="module")
def fault_server(ref: ReferenceServer) -> Iterator[FaultServer]:
    with FaultServer(ref) as server:
        yield server


@pytest.fixture(scope="module")
def clean(tmp_path_factory, episodes_dir, ref, tiny_model_dir) -> dict[str, Any]:
    """Prompts and clean logprobs of every step, straight from ``ReferenceServer.generate``."""
    store = Store.open(str(tmp_path_factory.mktemp("clean") / "x.db"))
    ingest(store, [episodes_dir])
    prep = prepare(store, _cfg(ref.url, tiny_model_dir))
    prompts = step_prompts(store, prep.builder)
    values = {
        key: np.asarray(parse_response(p, ref.generate(build_payload(p))).logprobs, dtype="<f4")
        for key, p in prompts.items()
    }
    requests = step_requests(store, prep.builder)
    assert len(requests) < len(prompts), "the episodes should give grouped requests"
    store.close()
    return {"prompts": prompts, "values": values, "scorer_id": prep.scorer_id, "requests": requests}


def _cfg(url: str, tiny_model_dir: Path) -> ScoreConfig:
    return ScoreConfig(backend="sglang", server=url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT)


def _score_through(
    store: Store, url: str, tiny_model_dir: Path, options: RunOptions = OPTIONS, *, client_timeout: float | None = None
):
    prep = prepare(store, _cfg(url, tiny_model_dir))
    prep.backend.timeout = client_timeout
    return prep, run_scoring(store, prep, options)


def _assert_no_wrong_value(store: Store, scorer_id: str, clean: dict[str, Any]) -> int:
    stored = stored_scores(store, scorer_id)
    for key, (mean, blob, token_count) in stored.items():
        expected = clean["values"][key]
        got = np.frombuffer(blob, "<f4")
        assert token_count == len(got) == len(expected) > 0, key
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0, err_msg=str(key))
        assert mean == pytest.approx(float(expected.astype(np.float64).mean()), abs=1e-5), key
    return len(stored)


def _attempts(store: Store, scorer_id: str) -> dict[tuple[str, int], dict[str, Any]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT e.name, a.step_index, a.id, a.status, a.attempt_count, a.last_error_kind, a.last_error "
                "FROM attempts a JOIN episodes e ON e.id = a.episode_id WHERE a.scorer_id = :s"
            ),
            {"s": scorer_id},
        ).all()
        errors: dict[int, list[str]] = {}
        for attempt_id, kind in conn.execute(text("SELECT attempt_id, kind FROM attempt_errors ORDER BY id")):
            errors.setdefault(attempt_id, []).append(kind)
    return {
        (name, idx): {"status": status, "attempt_count": n, "kind": kind, "error": err, "errors": errors.get(aid, [])}
        for name, idx, aid, status, n, kind, err in rows
    }


def _status(runner, db: str) -> dict[str, Any]:
    r = runner.invoke(cli, ["--db", db, "status", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (scorer,) = json.loads(r.output)["scorers"]
    return scorer


@pytest.mark.slow
def test_planned_faults(tmp_path, runner, episodes_dir, ref, fault_server, clean, tiny_model_dir):
    db = str(tmp_path / "x.db")
    store = Store.open(db)
    ingest(store, [episodes_dir])
    requests = clean["requests"]  # request key -> the steps it scores
    keys = sorted(clean["prompts"])
    assert len(requests) >= len(PLANS)
    plans = {rk: PLANS[i % len(PLANS)] for i, rk in enumerate(sorted(requests))}
    fault_server.reset(plan_schedule(plans))

    prep, report = _score_through(store, fault_server.url, tiny_model_dir, client_timeout=CLIENT_TIMEOUT)
    assert prep.scorer_id == clean["scorer_id"]

    # Every step of a request shares the request's outcome.
    expected = {step: _expected_outcome(plans[rk]) for rk, steps in requests.items() for step in steps}
    plan_of = {step: plans[rk] for rk, steps in requests.items() for step in steps}
    assert sorted(expected) == keys
    n_failed = sum(state == "failed" for state, _ in expected.values())
    assert 0 < n_failed < len(keys)
    assert (report.scored, report.failed) == (len(keys) - n_failed, n_failed)
    assert report.retried == sum(len(kinds) for state, kinds in expected.values() if state == "done") + sum(
        len(kinds) - 1 for state, kinds in expected.values() if state == "failed"
    )

    attempts = _attempts(store, prep.scorer_id)
    for rk, steps in requests.items():
        # The server saw exactly the planned faults, then (when scored) one good answer.
        state, kinds = _expected_outcome(plans[rk])
        assert fault_server.faults_for(rk) == plans[rk][: len(kinds)] + ([None] if state == "done" else []), steps
    for key, (state, kinds) in expected.items():
        row = attempts[key]
        assert row["status"] == state, (key, plan_of[key], row)
        assert row["errors"] == kinds, (key, plan_of[key], row)  # one attempt_errors row per failed attempt
        if state == "failed":
            assert row["kind"] == kinds[-1] and row["attempt_count"] == len(kinds) and row["error"]
    assert _assert_no_wrong_value(store, prep.scorer_id, clean) == len(keys) - n_failed
    assert report.failure_kinds == {
        k: sum(1 for s, ks in expected.values() if s == "failed" and ks[-1] == k)
        for k in {ks[-1] for s, ks in expected.values() if s == "failed"}
    }

    counts = _status(runner, db)
    assert (counts["scored"], counts["failed"], counts["missing"], counts["leased"]) == (
        len(keys) - n_failed,
        n_failed,
        0,
        0,
    )
    r = runner.invoke(cli, ["--db", db, "status"], catch_exceptions=False)
    assert f"scored {len(keys) - n_failed} / failed {n_failed} / missing 0" in r.output

    # A plain rerun leaves failed steps alone; --retry-failed against a clean server completes them,
    # regrouped into the requests that failed (their steps fail together).
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
    r = runner.invoke(cli, base, catch_exceptions=False)
    assert "scored 0, failed 0" in r.output and ref.requests == before
    r = runner.invoke(cli, [*base, "--retry-failed"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"scored {n_failed}, failed 0" in r.output
    assert ref.requests == before + sum(_expected_outcome(plans[rk])[0] == "failed" for rk in requests)
    assert _assert_no_wrong_value(store, prep.scorer_id, clean) == len(keys)
    counts = _status(runner, db)
    assert (counts["scored"], counts["failed"], counts["missing"]) == (len(keys), 0, 0)
    assert {row["status"] for row in _attempts(store, prep.scorer_id).values()} == {"done"}
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_random_faults(tmp_path, runner, episodes_dir, ref, fault_server, clean, tiny_model_dir, seed):
    db = str(tmp_path / "x.db")
    store = Store.open(db)
    ingest(store, [episodes_dir])
    # Timeouts are slow to inject; keep them rare by leaving them out of the random pool.
    fault_server.reset(random_schedule(seed, 0.35, [f for f in FAULTS if f != "timeout"]))
    prep, report = _score_through(store, fault_server.url, tiny_model_dir)
    keys = sorted(clean["prompts"])

    scored = _assert_no_wrong_value(store, prep.scorer_id, clean)
    attempts = _attempts(store, prep.scorer_id)
    failed = [k for k, row in attempts.items() if row["status"] == "failed"]
    assert scored + len(failed) == len(keys) == len(attempts)
    assert (report.scored, report.failed) == (scored, len(failed))
    request_of = {step: rk for rk, steps in clean["requests"].items() for step in steps}
    for key, row in attempts.items():
        seen = fault_server.faults_for(request_of[key])
        faults = [f for f in seen if f is not None]
        # Every faulty answer is one recorded failed attempt, with the fault's kind, in order.
        assert row["errors"] == [ERROR_KIND[f] for f in faults], (key, seen, row)
        if row["status"] == "done":
            assert seen[-1] is None and all(f not in PERMANENT for f in faults)
        else:
            assert seen[-1] is not None
            assert seen[-1] in PERMANENT or len(seen) == MAX_ATTEMPTS
            assert row["kind"] == ERROR_KIND[seen[-1]] and row["attempt_count"] == len(seen)
    counts = _status(runner, db)
    assert (counts["scored"], counts["failed"], counts["missing"]) == (scored, len(failed), 0)

    r = runner.invoke(
        cli,
        [
            "--db",
            db,
            "score",
            "--server",
            ref.url,
            "--tokenizer",
            str(tiny_model_dir),
            "--max-context",
            str(MAX_CONTEXT),
            "--retry-failed",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    assert f"scored {len(failed)}, failed 0" in r.output
    assert _assert_no_wrong_value(store, prep.scorer_id, clean) == len(keys)
    assert _status(runner, db)["failed"] == 0
    store.close()


@pytest.mark.slow
def test_retry_after_is_honoured_and_unreachable_server_is_a_clean_error(
    tmp_path, episodes_dir, ref, fault_server, clean, tiny_model_dir
):
    """429 with Retry-After 0.1 waits 0.1 s (not the tiny backoff); a dead server fails to start cleanly."""
    store = Store.open(str(tmp_path / "x.db"))
    ingest(store, [episodes_dir])
    key = sorted(clean["prompts"])[0]
    fault_server.reset(plan_schedule({request_key(clean["prompts"][key]): ["http_429"] * 3}))
    prep, report = _score_through(
        store,
        fault_server.url,
        tiny_model_dir,
        RunOptions(
            concurrency=1,
            max_attempts=4,
            backoff_base=0.001,
            backoff_cap=1.0,
            filters=__import__("hcapo_store.scoring.work_queue", fromlist=["Filters"]).Filters(episodes=(key[0],)),
            limit=1,
        ),
    )
    assert (report.scored, report.retried) == (1, 3)
    times = [e.at for e in sorted(fault_server.log, key=lambda e: e.n)]
    assert len(times) == 4
    assert all(b - a >= 0.09 for a, b in zip(times, times[1:]))
    _assert_no_wrong_value(store, prep.scorer_id, clean)

    from hcapo_store.errors import ScoringError

    dead = FaultServer(ref)
    url = dead.url
    dead.httpd.server_close()  # bound, then closed: nothing listens there
    with pytest.raises(ScoringError, match="cannot reach"):
        prepare(store, _cfg(url, tiny_model_dir))
    store.close()


@pytest.mark.parametrize(
    "bad, kind",
    [
        (lambda e: e.__setitem__(2, [False, e[2][1], None]), "bad_response"),  # bool is not a logprob
        (lambda e: e.__setitem__(2, ["-0.5", e[2][1], None]), "bad_response"),  # nor is a string
        (lambda e: e.__setitem__(2, [float("nan"), e[2][1], None]), "bad_response"),
        (lambda e: e.__setitem__(2, "ab"), "bad_response"),
        (lambda e: e.__setitem__(1, [-0.1]), "bad_response"),
        (lambda e: e.__setitem__(0, [None, e[0][1] + 1, None]), "mismatch"),  # the unscored entry is checked too
        (lambda e: e.append([-0.1, 5, None]), "mismatch"),
    ],
)
def test_parse_response_rejects_what_the_fast_path_must_not_accept(bad, kind):
    from hcapo_store.errors import InferenceError
    from hcapo_store.rendering.requests import StepPrompt

    prompt = StepPrompt(
        step_index=0,
        input_ids=[7, 8, 9, 10, 11],
        first_scored=2,
        total_action_tokens=3,
        skipped_action_tokens=0,
        truncated_prefix_tokens=0,
        flattened=False,
    )
    entries = [[None, 8, None], (-0.25, 9, None), [0, 10, None], [-1e-6, 11, "x"]]
    assert parse_response(prompt, {"meta_info": {"input_token_logprobs": entries}}).logprobs == [-0.25, 0.0, -1e-6]
    bad(entries)
    with pytest.raises(InferenceError) as info:
        parse_response(prompt, {"meta_info": {"input_token_logprobs": entries}})
    assert info.value.kind == kind and not info.value.retryable
