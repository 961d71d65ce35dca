"""A score is always from the scorer it is stored under: another model put behind the same
URL mid-run stops the run, and nothing it answered is stored.

The swap is done by tests/faultserver.py as a restarted server would do it: the old
connections die, new ones reach the other model. A weight update in place (SGLang's
``weight_version``) is seen in the very next response.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _waiting import wait_until
from faultserver import FaultServer
from sqlalchemy import text

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import ScoringError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store, count

MAX_CONTEXT = 2048
WAIT = 120.0


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    server = make_server(tiny_model_dir)  # not started: the proxy calls it in-process
    yield server
    server.httpd.server_close()


@pytest.fixture
def other(ref: ReferenceServer) -> Iterator[ReferenceServer]:
    """Another model as the server reports it (its path differs; the weights do not matter here)."""
    server = ReferenceServer(ref.scorer, ref.tokenizer, tokenizer_path=ref.tokenizer_path, host="127.0.0.1", port=0)
    server.model_path = "/models/another-model"
    yield server
    server.httpd.server_close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    root = tmp_path / "episodes"
    write_standard_episodes(root, 2, seed=4, steps_per_subtask=1, output_words=15)
    s = Store.open(str(tmp_path / "store.db"))
    ingest(s, [root])
    yield s
    s.close()


def _run_with_change(store: Store, proxy: FaultServer, tiny_model_dir: Path, change) -> BaseException | None:
    """Score in a thread; once the first request is at the server, ``change()`` the server."""
    prep = prepare(
        store, ScoreConfig(backend="sglang", server=proxy.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT)
    )
    proxy.hold_answers = threading.Event()
    outcome: list[BaseException | None] = []

    def work() -> None:
        try:
            run_scoring(store, prep, RunOptions(concurrency=2, backoff_base=0.01, backoff_cap=0.05))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    try:
        wait_until(lambda: proxy.requests >= 1, "the first request", timeout=120.0)
        change()
    finally:
        proxy.hold_answers.set()
        thread.join(WAIT)
        proxy.hold_answers = None
    assert not thread.is_alive()
    return outcome[0]


def _errors(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return dict(conn.execute(text("SELECT kind, COUNT(*) FROM attempt_errors GROUP BY kind")).all())


def test_another_model_behind_the_url_stops_the_run(store, ref, other, tiny_model_dir):
    with FaultServer(ref) as proxy:
        error = _run_with_change(store, proxy, tiny_model_dir, lambda: proxy.swap(other))
    assert isinstance(error, ScoringError), error
    assert "another model" in str(error) and "/models/another-model" in str(error)
    assert count(store, "SELECT COUNT(*) FROM scores") == 0  # every request went to the other model
    assert _errors(store).get("model_changed", 0) >= 1
    # The steps stay to be scored (not failed), and the worker gave its leases back.
    assert count(store, "SELECT COUNT(*) FROM attempts WHERE status <> 'pending'") == 0


def test_new_weights_in_place_are_seen_in_the_next_response(store, ref, tiny_model_dir):
    def update_weights() -> None:
        ref.weight_version = "v2"

    try:
        with FaultServer(ref) as proxy:
            error = _run_with_change(store, proxy, tiny_model_dir, update_weights)
    finally:
        ref.weight_version = "default"
    assert isinstance(error, ScoringError), error
    assert "weight_version 'default' -> 'v2'" in str(error)
    assert count(store, "SELECT COUNT(*) FROM scores") == 0


def test_same_model_after_a_reconnect_goes_on(store, ref, tiny_model_dir):
    """A restart with the same model (connections dropped) is re-checked and scoring completes."""
    with FaultServer(ref) as proxy:
        error = _run_with_change(store, proxy, tiny_model_dir, lambda: proxy.swap(ref))
    assert error is None
    steps = count(store, "SELECT COUNT(*) FROM steps")
    assert count(store, "SELECT COUNT(*) FROM scores") == steps
