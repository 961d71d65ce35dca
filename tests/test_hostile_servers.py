"""Servers that misbehave on purpose (issue 21): a body trickling one byte at a time, values
no model computes, a body without end, and a gateway echoing the API key it was sent.

Real HTTP to tests/faultserver.py over the real reference server and tiny model; real
SQLite made by the migrations. Each fault hits one planned request; the other requests
of the same run must be stored with their clean values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faultserver import ERROR_KIND, FaultServer, plan_schedule, step_prompts, step_requests, stored_scores
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
OPTIONS = RunOptions(concurrency=4, max_attempts=3, backoff_base=0.01, backoff_cap=0.1)
SECRET = "sk-hostile-0123456789abcdef"


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 2, seed=11, steps_per_subtask=1, output_words=12)
    return root


@pytest.fixture
def fault_server(ref: ReferenceServer) -> Iterator[FaultServer]:
    with FaultServer(ref) as server:
        yield server


def _store(tmp_path: Path, episodes_dir: Path) -> Store:
    store = Store.open(str(tmp_path / "x.db"))
    ingest(store, [episodes_dir])
    return store


def _cfg(url: str, tiny_model_dir: Path, **kw: Any) -> ScoreConfig:
    return ScoreConfig(backend="sglang", server=url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT, **kw)


def _errors(store: Store, scorer_id: str) -> dict[tuple[str, int], tuple[str, list[str], list[str]]]:
    """Per step: its status, the kinds and the messages of its failed attempts."""
    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT e.name, a.step_index, a.id, a.status, a.last_error FROM attempts a "
                "JOIN episodes e ON e.id = a.episode_id WHERE a.scorer_id = :s"
            ),
            {"s": scorer_id},
        ).all()
        kinds: dict[int, list[str]] = {}
        messages: dict[int, list[str]] = {}
        for aid, kind, message in conn.execute(
            text("SELECT attempt_id, kind, message FROM attempt_errors ORDER BY id")
        ):
            kinds.setdefault(aid, []).append(kind)
            messages.setdefault(aid, []).append(message or "")
    return {
        (name, idx): (status, kinds.get(aid, []), [*messages.get(aid, []), last or ""])
        for name, idx, aid, status, last in rows
    }


def _clean_values(store: Store, prep: Any, ref: ReferenceServer) -> dict[Any, np.ndarray]:
    return {
        key: np.asarray(parse_response(p, ref.generate(build_payload(p))).logprobs, dtype="<f4")
        for key, p in step_prompts(store, prep.builder).items()
    }


def test_wrong_values_and_endless_bodies_are_refused_and_the_rest_is_stored(
    tmp_path, episodes_dir, ref, fault_server, tiny_model_dir
):
    store = _store(tmp_path, episodes_dir)
    prep = prepare(store, _cfg(fault_server.url, tiny_model_dir))
    requests = step_requests(store, prep.builder)
    faults = ["tiny_logprob", "huge_cached", "huge_body"]
    assert len(requests) > len(faults), "the episodes should give more requests than faults"
    plans = {rk: [faults[i]] * OPTIONS.max_attempts if i < len(faults) else [] for i, rk in enumerate(sorted(requests))}
    fault_server.reset(plan_schedule(plans))
    clean = _clean_values(store, prep, ref)

    report = run_scoring(store, prep, OPTIONS)

    rows = _errors(store, prep.scorer_id)
    stored = stored_scores(store, prep.scorer_id)
    for rk, steps in requests.items():
        for step in steps:
            status, kinds, _ = rows[step]
            if plans[rk]:  # refused at the first answer (a permanent kind), never stored
                assert (status, kinds) == ("failed", [ERROR_KIND[plans[rk][0]]]), (step, plans[rk])
                assert step not in stored
            else:
                assert status == "done", step
                got = np.frombuffer(stored[step][1], "<f4")
                np.testing.assert_allclose(got, clean[step], atol=1e-5, rtol=0, err_msg=str(step))
    assert report.failed == sum(len(requests[rk]) for rk in plans if plans[rk])
    for _, blob, _ in stored.values():
        assert np.isfinite(np.frombuffer(blob, "<f4")).all()
    store.close()


# waits out a 10 s request timeout; a request cut by --request-timeout and retried stays fast in
# tests/test_loud.py::test_request_timeout_and_a_hung_request_do_not_fail_steps_of_a_live_server
@pytest.mark.slow
def test_a_trickling_answer_is_cut_by_the_request_timeout_and_retried(
    tmp_path, episodes_dir, ref, fault_server, tiny_model_dir
):
    store = _store(tmp_path, episodes_dir)
    prep = prepare(store, _cfg(fault_server.url, tiny_model_dir, request_timeout=10.0))
    requests = step_requests(store, prep.builder)
    trickled = sorted(requests)[0]
    fault_server.reset(plan_schedule({trickled: ["trickle"]}))

    report = run_scoring(store, prep, OPTIONS)  # before the fix: hours (each read is quick)

    rows = _errors(store, prep.scorer_id)
    for step in requests[trickled]:
        status, kinds, messages = rows[step]
        assert status == "done" and kinds[:1] == ["timeout"], (step, rows[step])
        assert "no complete answer within 10 s" in messages[0]
    assert report.failed == 0
    assert fault_server.faults_for(trickled)[:2] == ["trickle", None]
    store.close()


def test_credentials_go_in_the_header_and_an_echoed_key_is_masked(
    tmp_path, episodes_dir, ref, fault_server, tiny_model_dir
):
    store = _store(tmp_path, episodes_dir)
    url = f"{fault_server.url}?api_key={SECRET}"  # the README's old form: the key must not travel in paths
    prep = prepare(store, _cfg(url, tiny_model_dir))
    requests = step_requests(store, prep.builder)
    echoed = sorted(requests)[0]
    fault_server.reset(plan_schedule({echoed: ["echo_key"]}))

    report = run_scoring(store, prep, OPTIONS)

    assert fault_server.seen and all(auth == f"Bearer {SECRET}" for _, auth in fault_server.seen)
    assert not [path for path, _ in fault_server.seen if SECRET in path]
    assert report.failed == len(requests[echoed])
    rows = _errors(store, prep.scorer_id)
    for step in requests[echoed]:
        status, kinds, messages = rows[step]
        assert (status, kinds) == ("failed", ["http_401"])
        assert all(SECRET not in m for m in messages) and "Bearer ***" in messages[0], messages
    with store.engine.connect() as conn:  # nothing stored anywhere carries the key
        for table in ("attempts", "attempt_errors", "scorers"):
            dump = repr(conn.execute(text(f"SELECT * FROM {table}")).all())
            assert SECRET not in dump, table
    assert SECRET not in report.summary() and SECRET not in repr(report.as_dict())
    store.close()


def test_a_model_label_the_server_does_not_serve_is_refused_before_any_request(
    tmp_path, runner, episodes_dir, ref, fault_server, tiny_model_dir
):
    db = str(tmp_path / "x.db")
    _store(tmp_path, episodes_dir).close()
    base = ["--db", db, "score", "--server", fault_server.url, "--max-context", str(MAX_CONTEXT)]
    r = runner.invoke(cli, [*base, "--model", "Qwen/Qwen3-8B"])
    assert r.exit_code == 1, r.output
    (line,) = r.output.strip().splitlines()
    assert "'Qwen/Qwen3-8B'" in line and repr(ref.model_info()["model_path"]) in line, line
    assert fault_server.requests == 0
    with Store.open(db) as store, store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM scores")).scalar_one() == 0

    # The served model's own name is accepted, and labels the scores.
    r = runner.invoke(cli, [*base, "--model", Path(ref.model_info()["model_path"]).name], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert fault_server.requests > 0


def test_framing_faults_and_an_encoding_never_asked_for_end_at_once_as_failures(
    tmp_path, episodes_dir, ref, fault_server, tiny_model_dir
):
    """Issue 34 item 4, in a real run: each hostile answer is a failed attempt of its own kind,
    recorded at once (the request timeout is far above the test's life), and retried where a
    retry can help; a connection that carried stray bytes is closed before reuse: no other
    request fails on them."""
    from _waiting import HANG_GUARD_S
    from faultserver import STRAY

    store = _store(tmp_path, episodes_dir)
    prep = prepare(store, _cfg(fault_server.url, tiny_model_dir, request_timeout=HANG_GUARD_S))
    requests = step_requests(store, prep.builder)
    faults = ["te_identity", "endless_trailers", "lenient_chunk", "gzip_bomb", STRAY]
    assert len(requests) > len(faults), "the episodes should give more requests than faults"
    plans = {rk: [faults[i]] if i < len(faults) else [] for i, rk in enumerate(sorted(requests))}
    fault_server.reset(plan_schedule(plans))
    clean = _clean_values(store, prep, ref)

    report = run_scoring(store, prep, OPTIONS)

    rows = _errors(store, prep.scorer_id)
    stored = stored_scores(store, prep.scorer_id)
    stray_errors = []
    for rk, steps in requests.items():
        fault = plans[rk][0] if plans[rk] else None
        for step in steps:
            status, kinds, messages = rows[step]
            if fault == "gzip_bomb":  # permanent: refused unread, never stored
                assert (status, kinds) == ("failed", ["bad_encoding"]), (step, rows[step])
                assert "Content-Encoding 'gzip, gzip' was not asked for" in messages[0]
                assert step not in stored
                continue
            assert status == "done", (step, fault, rows[step])
            got = np.frombuffer(stored[step][1], "<f4")
            np.testing.assert_allclose(got, clean[step], atol=1e-5, rtol=0, err_msg=str(step))
            if fault in ("te_identity", "endless_trailers", "lenient_chunk"):
                assert kinds == ["connect"], (step, fault, rows[step])  # then answered on retry
                reason = {
                    "te_identity": "Only Transfer-Encoding: chunked",
                    "endless_trailers": "Receive buffer too long",
                    "lenient_chunk": "illegal chunk header",
                }[fault]
                assert reason in messages[0], messages
            else:  # answered; the stray bytes' own answer is kept, and no later request sees them
                if any(k == "connect" and "illegal status line" in m for k, m in zip(kinds, messages)):
                    stray_errors.append(rk)
                assert set(kinds) <= {"connect"}, (step, rows[step])
    assert not stray_errors, stray_errors
    assert report.failed == len(requests[next(rk for rk in plans if plans[rk] == ["gzip_bomb"])])
    store.close()
