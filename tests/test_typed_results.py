"""The public results are typed dataclasses, and each ``as_dict()`` is exactly the JSON the
CLI prints with ``--json`` (an interface scripts rely on: it must not change with the types)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_credits import add_scorer, add_scores
from test_tokenized import scored_with

import hcapo_store as hs
from hcapo_store import formatting
from hcapo_store.cli import cli
from hcapo_store.credits.equations import CreditParams
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.work_queue import register_worker
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


def _printed(result: hs.RunDetails | hs.RunDiff | hs.DatasetExport | hs.TokenizedExport) -> str:
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


@pytest.mark.parametrize(
    ("name", "options", "layout", "fmt"),
    [
        ("d.jsonl", [], "steps", "jsonl"),
        ("w.parquet", ["--weights-in-messages", "--format", "parquet"], "weights-in-messages", "parquet"),
    ],
)
def test_export_dataset_json_is_dataset_export_as_dict(
    credited: Store,
    db_path: Path,
    runner: CliRunner,
    tmp_path: Path,
    name: str,
    options: list[str],
    layout: str,
    fmt: str,
) -> None:
    out = tmp_path / name
    result = hs.export_dataset(credited, out, "default", min_reward=0.0, layout=layout, fmt=fmt)
    assert isinstance(result, hs.DatasetExport) and result.path == out
    assert result.summary_path == tmp_path / f"{name}.summary.json"
    # the same export again through the CLI (over the same files): the JSON it prints is as_dict()
    printed = _stdout(
        runner, db_path, "export", "dataset", str(out), "--credits", "default", "--min-reward", "0", *options, "--json"
    )
    assert printed == _printed(result)
    assert json.loads(result.summary_path.read_text()) == json.loads(formatting.dumps(result.summary()))
    assert list(result.as_dict())[:3] == ["path", "summary_path", "total_episodes_loaded"]
    rows = len(out.read_text().splitlines()) if fmt == "jsonl" else pq.read_metadata(out).num_rows
    assert result.episodes_in_dataset == rows > 0
    assert result.config["layout"] == layout and result.total_steps >= result.nonzero_steps > 0


def test_export_tokenized_json_is_tokenized_export_as_dict(
    store: Store, samples: Path, demo_tokenizer_dir: Path, db_path: Path, runner: CliRunner, tmp_path: Path
) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    out = tmp_path / "t.jsonl"
    result = hs.export_dataset(store, out, "r", min_reward=0.0, layout="tokenized", tokenizer=demo_tokenizer_dir)
    assert isinstance(result, hs.TokenizedExport)
    assert hs.export_tokenized(store, out, "r", min_reward=0.0, tokenizer=demo_tokenizer_dir) == result
    printed = _stdout(
        runner, db_path, "export", "dataset", str(out), "--credits", "r", "--min-reward", "0",
        "--tokenized", "--tokenizer", str(demo_tokenizer_dir), "--json",
    )  # fmt: skip
    assert printed == _printed(result)
    assert json.loads(result.summary_path.read_text()) == json.loads(formatting.dumps(result.summary()))
    assert result.episodes_in_dataset == len(out.read_text().splitlines()) > 0
    assert result.episodes_without_weighted_tokens == sum(result.episodes_dropped.values())
    assert result.weighted_tokens <= result.tokens and result.unaligned_steps == sum(result.unaligned_reasons.values())


def test_export_hindsight_json_result(credited: Store, db_path: Path, runner: CliRunner, tmp_path: Path) -> None:
    result = hs.export_hindsight_json(credited, tmp_path / "hs", "b")
    assert result.out_dir == tmp_path / "hs" and result.run == "b"
    assert result.episodes == len(list(result.out_dir.rglob("hindsight_scores.json"))) > 0
    d = result.as_dict()
    assert list(d) == ["run", "out_dir", "episodes", "warnings"] and d["out_dir"] == str(tmp_path / "hs")
    assert hs.HindsightExport(**{**d, "out_dir": Path(d["out_dir"])}) == result
    text = _stdout(runner, db_path, "export", "hindsight-json", str(tmp_path / "hs"), "--credits", "b")
    assert text == f"wrote {result.episodes} hindsight_scores.json file(s) under {result.out_dir} (credit run 'b')\n"


def test_export_scores_result(credited: Store, db_path: Path, runner: CliRunner, tmp_path: Path) -> None:
    result = hs.export_scores(credited, tmp_path / "s.parquet")
    assert (result.scorer_id, result.scorer) == ("sc", "test-scorer")
    assert result.steps == pq.read_metadata(result.path).num_rows > 0
    d = result.as_dict()
    assert list(d) == ["path", "scorer_id", "scorer", "steps"]
    assert hs.ScoresExport(**{**d, "path": Path(d["path"])}) == result
    text = _stdout(runner, db_path, "export", "scores", str(result.path))
    assert text == f"wrote {result.path}: {result.steps} scored step(s) of scorer test-scorer\n"


def test_write_report_and_episode_page_results(
    credited: Store, db_path: Path, runner: CliRunner, tmp_path: Path
) -> None:
    report = hs.write_report(credited, tmp_path / "r.html", "b")
    assert report.run == "b" and report.warnings == []
    assert report.bytes == report.path.stat().st_size  # bytes of the UTF-8 file, not characters
    d = report.as_dict()
    assert list(d) == ["path", "run", "bytes", "warnings"]
    assert hs.ReportResult(**{**d, "path": Path(d["path"])}) == report
    text = _stdout(runner, db_path, "report", str(report.path), "--credits", "b")
    assert text == f"wrote {report.path} ({report.bytes} bytes, credit run 'b')\n"

    (name,) = credited.query("SELECT name FROM episodes ORDER BY name LIMIT 1")[1][0]
    page = hs.write_episode_page(credited, name, tmp_path / "e.html", "default")
    assert (page.episode, page.run) == (name, "default") and page.bytes == page.path.stat().st_size
    d = page.as_dict()
    assert list(d) == ["path", "episode", "run", "bytes"]
    assert hs.EpisodePage(**{**d, "path": Path(d["path"])}) == page


def test_datasette_metadata_file_is_as_dict(credited: Store, db_path: Path, runner: CliRunner, tmp_path: Path) -> None:
    _stdout(runner, db_path, "datasette-metadata", str(tmp_path / "m.json"))
    meta = hs.datasette_metadata(db_path.stem)
    assert (tmp_path / "m.json").read_text() == json.dumps(meta.as_dict(), indent=2)
    assert list(meta.as_dict()["databases"]) == [meta.database] == [db_path.stem]
    assert "q_h_smoothed" in meta.tables["credits"]["columns"] and meta.queries["top_steps_by_rho"]["params"]


def test_status_json_is_store_status_as_dict(credited: Store, db_path: Path, runner: CliRunner) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # a worker "running" in the table whose process is gone: status says dead
    register_worker(credited, f"{socket.gethostname()}:{ended.pid}", "sc")
    result = hs.status(credited)
    printed = json.loads(_stdout(runner, db_path, "status", "--json"))
    mine = json.loads(formatting.dumps(result.as_dict()))
    for doc in (printed, mine):  # the one value that moves between the two reads
        assert doc["workers"][0].pop("seconds_since_heartbeat") >= 0
    assert printed == mine and list(printed) == list(mine) and list(printed["workers"][0]) == list(mine["workers"][0])
    (worker,) = result.workers
    assert isinstance(worker, hs.WorkerStatus) and worker.pid == ended.pid
    assert (worker.state, worker.stored_state, worker.leases) == ("dead", "running", 0)
    assert result.credit_runs == 2 and result.steps == sum(result.steps_by_phase.values()) > 0
    assert result.scorers[0]["scorer_id"] == "sc"
    text = _stdout(runner, db_path, "status")
    assert f"episodes     {result.episodes} (+0 superseded versions)" in text
    assert f"worker {worker.id}: dead (process gone: killed?), 0 lease(s)" in text
