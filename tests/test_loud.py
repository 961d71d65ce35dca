"""Nothing silent (issue 9 §3): exit codes, reasons and messages of ``score``, ``status``,
help texts, scorer labels and the demo — against the real reference server over HTTP."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli import cli
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.local.refserver import ReferenceServer, make_server
from hcapo_store.local.synth import write_standard_episodes
from hcapo_store.storage.store import Store

MAX_CONTEXT = 2048


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 2, steps_per_subtask=1, output_words=12)
    return root


@pytest.fixture
def db(tmp_path: Path, episodes_dir: Path) -> str:
    path = tmp_path / "x.db"
    with Store.open(str(path)) as store:
        assert ingest(store, [episodes_dir]).failed == 0
    return str(path)


def _score_args(db: str, ref: ReferenceServer, tokenizer: Path, *extra: str) -> list[str]:
    return ["--db", db, "score", "--server", ref.url, "--tokenizer", str(tokenizer),
            "--max-context", str(MAX_CONTEXT), *extra]


def _dump(db: str) -> list[str]:
    with sqlite3.connect(db) as conn:
        return list(conn.iterdump())


def test_dry_run_writes_nothing(runner, db, ref, tiny_model_dir):
    before = _dump(db)
    r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir, "--dry-run"), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "nothing was sent" in r.output
    assert _dump(db) == before  # no scorer row, no queue rows: `credits compute` still sees one scorer or none
    r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir, "--dry-run", "--max-logprob-tokens", "8"),
                      catch_exceptions=False)
    assert r.exit_code == 0 and _dump(db) == before
