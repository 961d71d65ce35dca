"""The data users have goes in (issue 39 §6): a Pi session file or a JSON array given as JSONL
is answered in one line from its head; ``--format tau-bench|openai-list`` reads such arrays;
``--group-by field:NAME`` groups credits, diagnose and export by a per-episode field; Pi
compaction entries are warned about and can be rendered as the context the agent saw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from builders import EpisodeBuilder
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import make_server
from hcapo_store.ingestion import fields
from hcapo_store.ingestion.discovery import count_inputs
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.ingestion.sources import ConvertOptions


def _tau_result(task_id: int, trial: int, reward: float, steps: int = 2) -> dict[str, Any]:
    """One element of τ-bench's results file (tau_bench/run.py: task_id, reward, info, traj, trial)."""
    traj: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a retail agent. Follow the policy."},
        {"role": "user", "content": f"Task {task_id}: I want to return order #W{task_id}."},
    ]
    for k in range(steps):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "get_order", "arguments": '{"id": 1}'}}
        traj.append({"role": "assistant", "content": None, "tool_calls": [call]})
        traj.append({"role": "tool", "tool_call_id": f"c{k}", "name": "get_order", "content": f"order {k} ok"})
    traj.append({"role": "assistant", "content": f"Done with task {task_id}, trial {trial}."})
    return {"task_id": task_id, "reward": reward, "info": {"source": "user"}, "traj": traj, "trial": trial}


TAU_REWARDS = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.0, (1, 1): 0.0}


def _tau_file(path: Path, *, indent: int | None = 2) -> Path:
    results = [_tau_result(t, trial, r) for (t, trial), r in TAU_REWARDS.items()]
    path.write_text(json.dumps(results, indent=indent))
    return path


def _failed_lines(result: Any) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("failed: ")]


# --- recognised and answered in one line ----------------------------------------------------


def test_a_pretty_printed_tau_bench_array_is_one_line_not_a_failure_per_line(runner, db_path, tmp_path):
    # Before: every line of the array starting with '{' passed the JSONL probe, so each of its
    # (here ~150, in a real file 65,000) lines was an episode that failed, in minutes.
    file = _tau_file(tmp_path / "results.json")
    assert len(file.read_text().splitlines()) > 100
    assert count_inputs([file]) == 1  # the progress total too: one refused file
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", str(file)])
    assert result.exit_code == 1
    assert _failed_lines(result) == [
        f"failed: {file.resolve()}: a JSON array of τ-bench results (task_id, reward, traj), not JSONL: "
        "ingest it with --format tau-bench"
    ]
    assert "0 new" in result.stdout and "1 failed" in result.stdout


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_of_episodes_names_openai_list(runner, db_path, tmp_path, indent):
    file = tmp_path / "eps.json"
    file.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}], "reward": 1}], indent=indent))
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", str(file)])
    assert result.exit_code == 1
    [line] = _failed_lines(result)
    assert line.endswith("ingest an array of episodes (messages, reward) with --format openai-list")


def test_a_raw_pi_session_file_is_pointed_at_its_directory(runner, db_path, tmp_path):
    episode = EpisodeBuilder(seed=3).standard().write(tmp_path / "episode_001")
    session = episode / "pi_session.jsonl"
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", str(session)])
    assert result.exit_code == 1
    assert _failed_lines(result) == [
        f"failed: {session.resolve()}: a Pi session file, not JSONL of episodes: ingest its episode "
        f"directory: hcapo-store ingest {episode.resolve()}"
    ]
    # one named elsewhere (~/.pi/agent/sessions/…/<time>_<uuid>.jsonl): how to make it an episode
    loose = tmp_path / "2026-04-20_abc.jsonl"
    loose.write_bytes(session.read_bytes())
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", str(loose)])
    [line] = _failed_lines(result)
    assert "a Pi session file, not JSONL of episodes: put it in a directory as pi_session.jsonl beside a " in line
    # the directory it names goes in
    assert runner.invoke(cli, ["--db", str(db_path), "ingest", str(episode)]).exit_code == 0


def test_a_folder_of_json_arrays_says_how_they_are_read(store, tmp_path):
    (tmp_path / "results").mkdir()
    _tau_file(tmp_path / "results" / "tau.json")
    [(_, error)] = ingest(store, [tmp_path / "results"]).failures
    assert error.endswith(
        "no episodes here: expected result.json + pi_session.jsonl, episode_* directories, or *.jsonl files; "
        "a JSON array (tau.json) is read given as a file with --format tau-bench|openai-list"
    )


def test_one_pretty_printed_object_is_one_line(runner, db_path, tmp_path):
    file = tmp_path / "one.jsonl"
    file.write_text(json.dumps({"messages": [], "reward": 1.0}, indent=2))
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", str(file)])
    [line] = _failed_lines(result)
    assert line.endswith("one pretty-printed JSON object, not JSONL: write one episode object per line (e.g. jq -c)")


# --- converted: --format ----------------------------------------------------------------------


def test_format_tau_bench_stores_one_episode_per_result_with_its_fields(store, tmp_path):
    file = _tau_file(tmp_path / "results.json")
    report = ingest(store, [file], input_format="tau-bench")
    assert (report.new, report.failed) == (4, 0), report.failures
    assert report.warning_list == []  # outcome-only data: no word about a plan_score it never had
    with store.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, name, external_id, reward, source_format, num_steps FROM episodes ORDER BY name")
        ).all()
        assert [(r.name, r.external_id, r.reward, r.source_format, r.num_steps) for r in rows] == [
            (f"results.json#{t}-{trial}", f"{t}-{trial}", r, "tau_bench", 3) for (t, trial), r in TAU_REWARDS.items()
        ]
        # the per-episode field a group-by reads, from what was stored
        assert fields.group_values(conn, [r.id for r in rows], "field:task_id") == ["0", "0", "1", "1"]
        assert fields.group_values(conn, [r.id for r in rows], "field:trial") == ["0", "1", "0", "1"]
        assert fields.group_values(conn, [r.id for r in rows], "field:nope") == [None] * 4
    # again: unchanged (the identity is the file's name and TASK-TRIAL)
    assert ingest(store, [_tau_file(tmp_path / "results.json", indent=None)], input_format="tau-bench").unchanged == 4


def test_format_refusals_name_the_element(store, tmp_path):
    file = tmp_path / "results.json"
    good = _tau_result(0, 0, 1.0)
    file.write_text(json.dumps([good, {"task_id": 1, "reward": 1.0, "trial": 0}, 7, {**good, "reward": 0.5}]))
    report = ingest(store, [file], input_format="tau-bench")
    assert report.new == 0 and report.failed == 4
    errors = sorted(e for _, e in report.failures)
    assert errors == sorted(
        [
            f"{file.resolve()}:2: a τ-bench result has a list 'traj' (its messages)",
            f"{file.resolve()}:3: element 3 must be an object, got int",
            *(
                f"{file.resolve()}:{n}: elements 1, 4 are the same episode (jsonl:results.json#0-0) with different "
                "contents: none is stored; give each its own task_id-trial"
                for n in (1, 4)
            ),
        ]
    )
    file.write_text('{"not": "an array"}')
    [(_, error)] = ingest(store, [file], input_format="openai-list").failures
    assert error.endswith("--format openai-list reads a JSON array, got dict")


def test_format_openai_list_reads_what_a_jsonl_line_holds(runner, db_path, tmp_path):
    episodes = [{"episode_id": i, **{k: v for k, v in _tau_result(i, 0, 0.5).items() if k != "traj"}} for i in (1, 2)]
    for e, i in zip(episodes, (1, 2), strict=True):
        e["messages"] = _tau_result(i, 0, 0.5)["traj"]
    file = tmp_path / "eps.json"
    file.write_text(json.dumps(episodes))
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", "--format", "openai-list", str(file), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["new"] == 2
    names = runner.invoke(cli, ["--db", str(db_path), "sql", "--format", "json", "SELECT name FROM episodes"])
    assert sorted(r["name"] for r in json.loads(names.stdout)) == ["eps.json#1", "eps.json#2"]


# --- --group-by field:NAME --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tau_scored(tmp_path_factory, tiny_model_dir):
    from click.testing import CliRunner

    root = tmp_path_factory.mktemp("tau")
    db = root / "tau.db"
    runner = CliRunner()
    r = runner.invoke(cli, ["--db", str(db), "ingest", "--format", "tau-bench", str(_tau_file(root / "results.json"))])
    assert r.exit_code == 0, r.output
    server = make_server(tiny_model_dir).start()
    try:
        args = ["--db", str(db), "score", "--server", server.url, "--tokenizer", str(tiny_model_dir), "--json"]
        r = runner.invoke(cli, args, catch_exceptions=False)
    finally:
        server.shutdown()
    assert r.exit_code == 0 and json.loads(r.stdout)["failed"] == 0, r.output
    return db


def _a_macro(runner: Any, db: Path, run: str) -> dict[str, float]:
    sql = (
        "SELECT DISTINCT episode, a_macro FROM step_credits WHERE run = '" + run + "' AND a_macro IS NOT NULL "
        "ORDER BY episode"
    )
    r = runner.invoke(cli, ["--db", str(db), "sql", "--format", "json", sql])
    assert r.exit_code == 0, r.output
    return {row["episode"]: row["a_macro"] for row in json.loads(r.stdout)}


def test_credits_compute_groups_by_a_per_episode_field(runner, tau_scored):
    db = tau_scored
    for name, extra in (("flat", []), ("by-task", ["--group-by", "field:task_id"])):
        r = runner.invoke(cli, ["--db", str(db), "credits", "compute", "--variant", "paper", "--name", name, *extra])
        assert r.exit_code == 0, r.output
    flat, by_task = _a_macro(runner, db, "flat"), _a_macro(runner, db, "by-task")
    # task 1's trials both failed: within their own group there is nothing to prefer
    assert by_task["results.json#1-0"] == by_task["results.json#1-1"] == 0.0
    assert flat["results.json#1-0"] < 0  # against all four, a failure is below the mean
    assert by_task["results.json#0-0"] > 0 > by_task["results.json#0-1"]
    shown = runner.invoke(cli, ["--db", str(db), "credits", "show", "by-task", "--json"])
    assert json.loads(shown.stdout)["params"]["group_by"] == "field:task_id"
    # a field no episode has is refused, naming where fields come from
    r = runner.invoke(cli, ["--db", str(db), "credits", "compute", "--variant", "paper", "--group-by", "field:nope"])
    assert r.exit_code != 0
    assert "--group-by field:nope: no credited episode has this field" in r.output


def test_diagnose_and_export_group_by_a_per_episode_field(runner, tau_scored, tmp_path):
    db = tau_scored
    r = runner.invoke(cli, ["--db", str(db), "credits", "compute", "--name", "orig"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["--db", str(db), "diagnose", "orig", "--group-by", "field:task_id", "--json"])
    assert r.exit_code == 0, r.output
    groups = json.loads(r.stdout)["groups"]
    assert sorted(groups) == ["0", "1"] and all(g["steps"] == 6 for g in groups.values())
    out = tmp_path / "train.jsonl"
    args = ["export", "dataset", str(out), "--credits", "orig", "--min-reward", "0", "--json"]
    r = runner.invoke(cli, ["--db", str(db), *args, "--group-by", "field:task_id"])
    assert r.exit_code == 0, r.output
    rows = {row["_episode_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    # task 0: rewards 1 and 0, normalised within the task: ±1 (against all four it would be 1.73)
    assert rows["0-0"]["_grpo_advantage"] == pytest.approx(1.0, abs=1e-4)


# --- Pi compaction ----------------------------------------------------------------------------


def _compacted_episode(root: Path) -> Path:
    b = EpisodeBuilder(seed=5).standard()
    messages = [i for i, e in enumerate(b.entries) if e["type"] == "message"]
    kept = b.entries[messages[-6]]
    cut = messages[-3]
    compaction = {
        "type": "compaction",
        "id": "c0ffee00",
        "parentId": b.entries[cut]["id"],
        "timestamp": "2026-04-20T12:00:00.000Z",
        "summary": "Planned S1-S4 and built the listener.",
        "firstKeptEntryId": kept["id"],
        "tokensBefore": 115000,
    }
    b.entries.insert(cut + 1, compaction)
    return b.write(root / "episode_001")


def test_compaction_is_warned_about_and_can_render_the_agents_context(store, tmp_path):
    episode = _compacted_episode(tmp_path)
    full = ingest(store, [episode])
    assert full.new == 1
    [(_, warning)] = [w for w in full.warning_list if "compaction" in w[1]]
    assert "1 compaction(s)" in warning and "ingest --compaction context renders what it saw" in warning
    context = ingest(store, [episode], options=ConvertOptions(compaction="context"))
    assert context.changed == 1  # another rendering of the same episode: a new version
    with store.engine.connect() as conn:
        versions = conn.execute(text("SELECT id, num_steps, is_current FROM episodes ORDER BY version")).all()
        first_message = conn.execute(
            text("SELECT role, content FROM messages WHERE episode_id = :e ORDER BY message_index LIMIT 1"),
            {"e": versions[1].id},
        ).one()
    assert versions[1].is_current and versions[1].num_steps < versions[0].num_steps
    assert first_message.role == "user"
    assert "<summary>\nPlanned S1-S4 and built the listener.\n</summary>" in first_message.content
    [(_, warning)] = [w for w in context.warning_list if "compaction" in w[1]]
    assert "rendered as the agent's context after the last" in warning
    # the default conversion's hash is what it always was: the full transcript is unchanged
    assert ingest(store, [episode]).changed == 1
    assert ConvertOptions().as_dict() == {"include_thinking": True, "max_tool_result_chars": 4000}


def test_a_field_of_result_json_is_read_from_the_head_of_the_stored_source(store, tmp_path):
    """An episode directory's result.json leads its stored source: a field of it is read without
    the session (megabytes) behind it, also when result.json itself spans several pieces."""
    episode = EpisodeBuilder(seed=9).standard().write(tmp_path / "episode_001")
    result = json.loads((episode / "result.json").read_text())
    result |= {"group_id": "g7", "notes": "n" * 200_000, "tail": {"b": 2, "a": [1]}}
    (episode / "result.json").write_text(json.dumps(result))
    assert ingest(store, [episode]).new == 1
    with store.engine.connect() as conn:
        [raw] = conn.execute(text("SELECT raw_source FROM episodes")).scalars().all()
        [episode_id] = conn.execute(text("SELECT id FROM episodes")).scalars().all()
        assert fields._leading_result(bytes(raw)) == (episode / "result.json").read_text()
        assert fields.group_values(conn, [episode_id], "field:group_id") == ["g7"]
        assert fields.group_values(conn, [episode_id], "field:tail") == ['{"a":[1],"b":2}']
        assert fields.group_values(conn, [episode_id], "field:episode_reward") == [str(result["episode_reward"])]
