"""The README's first command: the main job end to end on the built-in tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hcapo_store.cli import cli
from hcapo_store.credits.diagnose import diagnose_run
from hcapo_store.storage.store import Store


def test_demo_end_to_end(runner, tmp_path):
    db = tmp_path / "demo.db"
    r = runner.invoke(cli, ["--db", str(db), "demo", "--dir", str(tmp_path / "d"), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["ingest"]["new"] == 4 and out["ingest"]["failed"] == 0
    assert out["score"]["failed"] == 0 and out["score"]["scored"] == out["ingest"]["steps"]
    assert {row["subtask"] for row in out["subtasks"]} >= {"planning", "S1", "S2"}
    assert sum(row["steps"] for row in out["subtasks"]) == out["ingest"]["steps"]
    assert all(row["mean_logprob"] < 0 for row in out["subtasks"])
    # a rerun resumes: nothing is missing, so nothing is scored again
    r = runner.invoke(cli, ["--db", str(db), "demo", "--dir", str(tmp_path / "d"), "--json"], catch_exceptions=False)
    again = json.loads(r.output)
    assert again["ingest"]["unchanged"] == 4 and again["score"]["scored"] == 0
    # Where the tiny model is, and ready commands to score against it by hand.
    r = runner.invoke(cli, ["--db", str(db), "demo", "--dir", str(tmp_path / "d")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    model_dir = out["model_dir"]
    assert (
        Path(model_dir) / "config.json"
    ).is_file() and f"tiny model (weights and tokenizer): {model_dir}" in r.output
    assert f"hcapo-store serve-reference --model {model_dir} --port 30000" in r.output
    assert (
        f"hcapo-store --db {db} score --server http://127.0.0.1:30000 --tokenizer {model_dir} --max-context 8192"
    ) in r.output
    assert again["commands"][1].startswith(f"hcapo-store --db {db} score")
    # It ends with diagnose's verdict on the run it computed, not with ρ per subtask.
    verdict = diagnose_run(Store.open(str(db), create=False), "default")["verdict"]
    assert verdict.startswith("verdict: ") and out["verdict"] == again["verdict"] == verdict
    last = r.output.strip().splitlines()[-1]
    assert last.startswith(verdict + " (run 'default'") and "diagnose" in last


@pytest.mark.slow  # the demo a second time; test_demo_end_to_end stays fast
def test_demo_without_db_makes_its_own_folder(runner, tmp_path, monkeypatch):
    """`hcapo-store demo` on a fresh machine: no --db, a folder that does not exist yet. A missing
    --db folder is refused elsewhere; the demo's own folder is made by the demo."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HCAPO_STORE_DB", raising=False)
    r = runner.invoke(cli, ["demo", "--dir", "new/nested", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["score"]["failed"] == 0
    assert (tmp_path / "new" / "nested" / "demo.db").is_file()
