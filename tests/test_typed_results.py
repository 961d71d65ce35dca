"""The public results are typed dataclasses, and each ``as_dict()`` is exactly the JSON the
CLI prints with ``--json`` (an interface scripts rely on: it must not change with the types)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_credits import add_scorer, add_scores

import hcapo_store as hs
from hcapo_store import formatting
from hcapo_store.cli import cli
from hcapo_store.credits.equations import CreditParams
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store


@pytest.fixture
def credited(store: Store, samples: Path) -> Store:
    ingest(store, [samples])
    add_scorer(store, "sc", "test-scorer")
    add_scores(store, "sc", seed=5)
    hs.compute_credits(store)  # "default"
    hs.compute_credits(store, CreditParams(alpha=0.9, c_max=1.5), name="b")
    return store


def _stdout(runner: CliRunner, db_path: Path, *args: str) -> str:
    r = runner.invoke(cli, ["--db", str(db_path), *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def _printed(result: hs.RunDetails | hs.RunDiff) -> str:
    return formatting.dumps(result.as_dict()) + "\n"


def test_credits_show_json_is_run_details_as_dict(credited: Store, db_path: Path, runner: CliRunner) -> None:
    shown = hs.show_run(credited, "default")
    assert _stdout(runner, db_path, "credits", "show", "default", "--json") == _printed(shown)
    # The run's own fields stay flat at the top of the JSON, as before the result was typed.
    flat = shown.run.as_dict()
    assert list(shown.as_dict())[: len(flat)] == list(flat)
    assert all(isinstance(s, hs.SubtaskSummary) and isinstance(s.steps, int) for s in shown.subtasks)
    assert [s["subtask"] for s in shown.as_dict()["subtasks"]] == [s.subtask for s in shown.subtasks]
    text = _stdout(runner, db_path, "credits", "show", "default")
    assert f"clipped_low          {shown.clipped_low}" in text and shown.subtasks[-1].subtask in text


def test_credits_diff_json_is_run_diff_as_dict(credited: Store, db_path: Path, runner: CliRunner) -> None:
    diff = hs.diff_runs(credited, "default", "b", top=3)
    assert _stdout(runner, db_path, "credits", "diff", "default", "b", "--top", "3", "--json") == _printed(diff)
    assert len(diff.top_moved) == 3 and all(isinstance(m, hs.MovedStep) for m in diff.top_moved)
    # plain floats, not numpy scalars: a caller's arithmetic and type checks see Python numbers
    assert {type(getattr(m, f)) for m in diff.top_moved for f in ("rho_a", "delta_rho", "q_h_smoothed_b")} == {float}
    assert json.loads(_printed(diff))["top_moved"][0]["episode"] == diff.top_moved[0].episode
    none = hs.diff_runs(credited, "b", "b", top=0)
    assert none.top_moved == [] and none.as_dict()["top_moved"] == []
