"""Ingest on real files into real SQLite databases made by the migrations."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from builders import EpisodeBuilder, write_bad_episodes, write_standard_episodes

from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.ingestion.sources import ConvertOptions


def rows(store, sql):
    return store.query(sql)[1]


def test_samples_ingest_then_noop(store, samples):
    r = ingest(store, [samples])
    assert (r.new, r.changed, r.unchanged, r.failed) == (len(list(samples.glob("episode_*"))), 0, 0, 0)
    before = rows(store, "SELECT COUNT(*), SUM(num_steps) FROM episodes")
    r2 = ingest(store, [samples])
    assert (r2.new, r2.changed, r2.unchanged) == (0, 0, r.new)
    assert rows(store, "SELECT COUNT(*), SUM(num_steps) FROM episodes") == before
    assert rows(store, "SELECT MAX(version) FROM episodes") == [(1,)]


def test_edit_one_episode_gives_exactly_one_new_version(store, tmp_path):
    write_standard_episodes(tmp_path / "t", 3)
    ingest(store, [tmp_path / "t"])
    result = tmp_path / "t" / "episode_002" / "result.json"
    data = json.loads(result.read_text())
    data["episode_reward"] = 0.99
    result.write_text(json.dumps(data))
    r = ingest(store, [tmp_path / "t"])
    assert (r.new, r.changed, r.unchanged) == (0, 1, 2)
    versions = rows(
        store, "SELECT version, is_current, reward FROM episodes WHERE name = 't/episode_002' ORDER BY version"
    )
    assert [(v, c) for v, c, _ in versions] == [(1, 0), (2, 1)]
    assert versions[1][2] == 0.99 and versions[0][2] != 0.99
    # only current episodes count
    assert rows(store, "SELECT COUNT(*) FROM episodes WHERE is_current") == [(3,)]


def test_raw_source_kept_compressed(store, tmp_path):
    d = EpisodeBuilder(seed=3).standard().write(tmp_path / "episode_001")
    ingest(store, [d])
    blob = rows(store, "SELECT raw_source FROM episodes")[0][0]
    raw = json.loads(zlib.decompress(blob))
    assert raw["pi_session.jsonl"] == (d / "pi_session.jsonl").read_text()
    assert json.loads(raw["result.json"]) == json.loads((d / "result.json").read_text())


def test_mapping_with_plan_advances(store, tmp_path):
    b = EpisodeBuilder(seed=1, frozen_scores={"S1": 0.1, "S2": 0.2, "S3": 0.3, "S4": 0.4}, plan_score=0.66)
    ingest(store, [b.standard(steps_per_subtask=2).write(tmp_path / "episode_001")])
    steps = rows(store, "SELECT step_index, phase, subtask_id, subtask_reward FROM steps ORDER BY step_index")
    # exploration + submit_plan are planning steps carrying plan_score
    assert steps[0][1:] == ("planning", None, 0.66)
    assert steps[1][1:] == ("planning", None, 0.66)
    executing = [s for s in steps if s[1] == "executing"]
    # each subtask: 2 bash steps + submit_subtask + advance = 4 steps
    assert [s[2] for s in executing] == [sid for sid in ("S1", "S2", "S3", "S4") for _ in range(4)] + ["S4"]
    assert {s[2]: s[3] for s in executing} == {"S1": 0.1, "S2": 0.2, "S3": 0.3, "S4": 0.4}


def test_failed_submit_plan_keeps_planning(store, tmp_path):
    b = EpisodeBuilder(seed=2).header().user("task")
    b.submit_plan(ok=False).bash_turn(1).submit_plan(ok=True).bash_turn(1)
    ingest(store, [b.write(tmp_path / "episode_001")])
    assert [r[0] for r in rows(store, "SELECT phase FROM steps ORDER BY step_index")] == [
        "planning",
        "planning",
        "planning",
        "executing",
    ]


def test_submit_plan_with_bash_in_same_message(store, tmp_path):
    b = EpisodeBuilder(seed=4).header().user("task")
    b.submit_plan(with_bash=True, as_string=True).bash_turn(1)
    ingest(store, [b.write(tmp_path / "episode_001")])
    assert rows(store, "SELECT phase, subtask_id FROM steps ORDER BY step_index") == [
        ("planning", None),
        ("executing", "S1"),
    ]


def test_bad_inputs_never_abort_the_batch(store, tmp_path):
    write_bad_episodes(tmp_path / "bad")
    write_standard_episodes(tmp_path / "bad", 2)
    r = ingest(store, [tmp_path / "bad"])
    failures = dict((Path(s).name if "#" not in s else s, e) for s, e in r.failures)
    assert r.failed == 2, r.failures
    assert "episode_malformed_line" in failures and "pi_session.jsonl:5" in failures["episode_malformed_line"]
    assert "missing result.json" in failures["episode_missing_result"]
    assert r.skipped == {"no reward yet": 1, "no pi_session.jsonl": 1, "empty pi_session.jsonl": 1}
    names = {n for (n,) in rows(store, "SELECT name FROM episodes")}
    assert names == {
        f"bad/{n}"
        for n in (
            "episode_truncated_last",
            "episode_null_plan_score",
            "episode_non_utf8",
            "episode_unknown_roles",
            "episode_001",
            "episode_002",
        )
    }
    warn = {
        n.split("/")[1]: w for n, w in rows(store, "SELECT name, warnings FROM episodes WHERE warnings IS NOT NULL")
    }
    assert "truncated last line" in warn["episode_truncated_last"]
    assert "invalid UTF-8" in warn["episode_non_utf8"]
    assert "bashExecution" in warn["episode_unknown_roles"]
    assert "plan_score is null" in warn["episode_null_plan_score"]
    assert rows(
        store,
        "SELECT COUNT(*) FROM steps s JOIN episodes e ON e.id = s.episode_id "
        "WHERE e.name = 'bad/episode_null_plan_score' AND s.phase = 'planning' AND s.subtask_reward IS NULL",
    ) == [(2,)]
    # nothing half-written: every stored episode has its messages and steps
    assert rows(
        store,
        "SELECT COUNT(*) FROM episodes e WHERE num_steps != (SELECT COUNT(*) FROM steps s WHERE s.episode_id = e.id)",
    ) == [(0,)]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_pi_session_versions(store, tmp_path, version):
    b = EpisodeBuilder(version=version, seed=5).standard()
    b.compaction().bash_turn(1)
    ingest(store, [b.write(tmp_path / "episode_001")])
    fmt, n_msgs = rows(store, "SELECT source_format, num_messages FROM episodes")[0]
    assert fmt == f"pi_v{version}"
    # compaction skipped: the message list is the full history, in file order
    assert n_msgs == sum(1 for e in b.entries if e.get("type") == "message")


def test_conversion_thinking_truncation_and_errors(store, tmp_path):
    b = EpisodeBuilder(seed=6).header().user("task")
    b.assistant(thinking="let me look", calls=[("c1", "bash", {"command": "cat big"})])
    b.tool_result("c1", "bash", "x" * 5000)
    b.assistant(thinking="only thinking")
    b.assistant(text="")  # empty: dropped
    b.assistant(calls=[("c2", "bash", {"command": "false"})])
    b.tool_result("c2", "bash", "", is_error=True)
    d = b.write(tmp_path / "episode_001")
    ingest(store, [d])
    msgs = rows(store, "SELECT role, content, tool_calls FROM messages ORDER BY message_index")
    assert msgs[1][0] == "assistant" and msgs[1][1] == "<think>\nlet me look\n</think>"
    assert json.loads(msgs[1][2])[0]["function"] == {"name": "bash", "arguments": '{"command": "cat big"}'}
    assert msgs[2][1] == "x" * 4000 + "\n... [truncated, 5000 chars total]"
    assert msgs[3][1] == "<think>\nonly thinking\n</think>"
    assert msgs[5] == ("tool", "[tool_error]", None)
    assert len(msgs) == 6


def test_no_thinking_and_limit_change_is_a_new_version(store, tmp_path):
    d = EpisodeBuilder(seed=8).standard().write(tmp_path / "episode_001")
    ingest(store, [d])
    r = ingest(store, [d], options=ConvertOptions(include_thinking=False))
    assert r.changed == 1
    assert rows(
        store,
        "SELECT COUNT(*) FROM messages m JOIN episodes e ON e.id = m.episode_id "
        "WHERE e.is_current AND m.content LIKE '<think>%'",
    ) == [(0,)]


def test_openai_jsonl(store, tmp_path):
    path = tmp_path / "eps.jsonl"
    eps = [
        {
            "episode_id": "a",
            "reward": 0.5,
            "plan": [{"id": "S1"}],
            "frozen_scores": {"S1": 0.25},
            "plan_score": 0.4,
            "messages": [
                {"role": "user", "content": "do it"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "t1",
                            "type": "function",
                            "function": {"name": "submit_plan", "arguments": {"subtasks": []}},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "t1", "name": "submit_plan", "content": '{"plan_score": 0.4}'},
                {"role": "assistant", "content": "working"},
            ],
        },
        {"episode_id": "b", "reward": None, "messages": []},
    ]
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n{not json\n")
    r = ingest(store, [path], tags={"run": "r1"})
    assert (r.new, sum(r.skipped.values()), r.failed) == (1, 1, 1)
    assert "eps.jsonl:3" in r.failures[0][1]
    assert rows(store, "SELECT phase, subtask_id, subtask_reward FROM steps ORDER BY step_index") == [
        ("planning", None, 0.4),
        ("executing", "S1", 0.25),
    ]
    assert rows(store, "SELECT key, value FROM tags") == [("run", "r1")]
    assert ingest(store, [path]).unchanged == 1


def test_tags_survive_new_versions(store, tmp_path):
    d = EpisodeBuilder(seed=9).standard().write(tmp_path / "episode_001")
    ingest(store, [d], tags={"task": "pg"})
    ingest(store, [d], options=ConvertOptions(max_tool_result_chars=10), tags={"run": "2"})
    assert sorted(
        rows(store, "SELECT t.key, t.value FROM tags t JOIN episodes e ON e.id = t.episode_id WHERE e.is_current")
    ) == [("run", "2"), ("task", "pg")]


@pytest.mark.slow  # a real `ingest` process interrupted (the rule); the in-process ingest tests here stay fast
def test_interrupted_ingest_leaves_database_consistent(tmp_path):
    """SIGINT a real `hcapo-store ingest` process mid-run; the database stays whole."""
    import signal
    import sqlite3
    from contextlib import closing

    import psutil
    from _waiting import HANG_GUARD_S, wait_until

    write_standard_episodes(tmp_path / "t", 400, steps_per_subtask=6, output_words=200)
    db = tmp_path / "i.db"
    cmd = [sys.executable, "-m", "cli", "--db", str(db), "ingest", str(tmp_path / "t")]
    proc = subprocess.Popen(
        cmd, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )

    def committed() -> int:  # episodes of the batches committed so far (a reader never blocks in WAL mode)
        if not db.with_name("i.db-wal").exists():
            return 0
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            try:
                return conn.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]
            except sqlite3.OperationalError:  # the schema is not there yet
                return 0

    wait_until(lambda: committed() > 0, "the first batch is committed", procs={"ingest": proc})
    workers = psutil.Process(proc.pid).children(recursive=True)  # the processes that parse episodes
    proc.send_signal(signal.SIGINT)  # mid-run: later batches are still to come
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode in (0, 130), err
    assert workers, "400 episodes are parsed in worker processes"
    wait_until(
        lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), "no worker is left"
    )
    from hcapo_store.storage.store import Store

    with Store.open(str(db)) as s:
        assert s.query("PRAGMA integrity_check")[1] == [("ok",)]
        assert s.query(
            "SELECT COUNT(*) FROM episodes e WHERE num_steps != "
            "(SELECT COUNT(*) FROM steps s WHERE s.episode_id = e.id)"
        )[1] == [(0,)]
        n = s.query("SELECT COUNT(*) FROM episodes")[1][0][0]
        r = ingest(s, [tmp_path / "t"])
        assert r.new == 400 - n and r.unchanged == n and r.failed == 0
