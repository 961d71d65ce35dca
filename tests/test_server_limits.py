"""The server's input limit is read before the first request (issue 22): a --max-context the
server cannot take is refused before anything is sent; without --max-context the budget is the
default or the server's limit, whichever is smaller; a request the server refuses as it is does
not suggest --retry-failed. A real reference server that enforces its context as SGLang does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 400  # the server takes at most 399 input tokens


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir, context_length=CONTEXT) as server:
        yield server


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "x.db"
    with Store.open(str(path)) as store:
        ingest(store, [REPO / "examples" / "trajectories"])
    return path


def _score(db: Path, server: ReferenceServer, tokenizer: Path, *extra: str):
    argv = ["--db", str(db), "score", "--server", server.url, "--tokenizer", str(tokenizer), *extra]
    return CliRunner().invoke(cli, argv)


def test_a_max_context_the_server_cannot_take_is_refused_before_anything_is_sent(db, small, tiny_model_dir):
    before = small.requests
    r = _score(db, small, tiny_model_dir, "--max-context", str(CONTEXT))
    assert r.exit_code == 1, r.output
    assert r.output.strip() == (
        f"Error: --max-context {CONTEXT} is more than the server accepts ({CONTEXT - 1} input tokens): "
        f"pass --max-context {CONTEXT - 1} or less, or leave it out to use the server's limit"
    )
    assert small.requests == before


def test_without_max_context_the_servers_limit_is_the_budget_and_every_step_scores(db, small, tiny_model_dir):
    r = _score(db, small, tiny_model_dir, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{") :])
    assert report["failed"] == 0 and report["scored"] > 0
    with Store.open(str(db), create=False) as store:
        (spec,) = [json.loads(row[0]) for row in store.query("SELECT spec FROM scorers", read_only=True)[1]]
        longest = store.query("SELECT max(input_tokens) FROM scores", read_only=True)[1][0][0]
    assert spec["max_context"] == CONTEXT - 1
    assert longest <= CONTEXT - 1


def test_a_request_refused_as_it_is_does_not_suggest_retry_failed(db, small, tiny_model_dir):
    small.advertise_context = False  # enforced, not advertised: the client cannot know before sending
    try:
        r = _score(db, small, tiny_model_dir, "--max-context", "4096", "--grouping", "per-step")
    finally:
        small.advertise_context = True
    assert r.exit_code == 1, r.output
    assert "http_400" in r.output
    assert "--retry-failed would send the same requests again" in r.output
    assert "rerun with --retry-failed" not in r.output
