"""`follow` and `batches` (issue 17): a collection followed as it is written, each complete
batch published once with its own credits — real files, a real server process, real kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _waiting import wait_until
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.online.follow import FollowConfig, Follower, follow
from hcapo_store.online.state import FollowStatus
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _write_group(root: Path, step: int, n: int, seed: int) -> list[Path]:
    return write_standard_episodes(root / f"step_{step:04d}", n, seed=seed, steps_per_subtask=1, output_words=5)


def _set_reward(episode: Path, reward: float | None) -> None:
    result = episode / "result.json"
    data = json.loads(result.read_text())
    data["episode_reward"] = reward
    result.write_text(json.dumps(data))


def _follow(db: Path, ref: ReferenceServer, tiny: Path, *args: str):
    base = ["--db", str(db), "follow", *args, "--server", ref.url, "--tokenizer", str(tiny), "--max-context", "2048"]
    return CliRunner().invoke(cli, base, catch_exceptions=False)


def _batches(db: Path) -> list[dict]:
    r = CliRunner().invoke(cli, ["--db", str(db), "batches", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_complete_batches_are_published_once(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    _write_group(root, 0, 3, seed=10)
    second = _write_group(root, 1, 3, seed=20)
    _set_reward(second[2], None)  # still running: waiting, not failed
    db = tmp_path / "s.db"
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--once", "--variant", "paper")
    assert r.exit_code == 0, r.output
    assert "1 waiting" in r.stderr and "failed: " not in r.stderr
    (b,) = _batches(db)
    assert {"id", "key", "episodes", "status", "credit_run", "ready_at"} <= set(b)
    assert (b["key"], b["episodes"], b["status"], b["failed"]) == ("rollouts/step_0000", 3, "ready", 0)
    with Store.open(str(db)) as store:
        rows = store.query(
            "SELECT episode, a_macro FROM step_credits WHERE run = :r", {"r": b["credit_run"]}, read_only=True
        )[1]
        names = {e for e, _ in rows}
        assert len(names) == 3 and all("step_0000" in n for n in names)
        # the batch's own group statistics: its macro advantages are normalised within it
        macro = {e: a for e, a in rows}
        assert abs(float(np.mean(list(macro.values())))) < 1e-9
    # the third episode finishes: the second batch is published; nothing twice
    _set_reward(second[2], 0.4)
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--once", "--variant", "paper", "--json")
    assert r.exit_code == 0, r.output
    published = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [p["key"] for p in published] == ["rollouts/step_0001"]
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--once", "--variant", "paper")
    assert r.exit_code == 0 and len(_batches(db)) == 2
    assert [
        b["id"]
        for b in json.loads(CliRunner().invoke(cli, ["--db", str(db), "batches", "--json", "--since", "1"]).output)
    ] == [2]


def test_a_changed_episode_republishes_its_batch(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    group = _write_group(root, 0, 2, seed=30)
    db = tmp_path / "s.db"
    assert _follow(db, ref, tiny_model_dir, str(root), "--group-size", "2", "--once").exit_code == 0
    _set_reward(group[0], 0.99)  # a corrected reward: a new version
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "2", "--once")
    assert r.exit_code == 0, r.output
    old, new = _batches(db)
    assert (old["status"], old["superseded_by"], new["status"]) == ("superseded", new["id"], "ready")
    assert old["credit_run"] != new["credit_run"]


def test_a_jsonl_line_being_written_waits(tmp_path: Path, ref, tiny_model_dir: Path, samples: Path) -> None:
    """Two whole lines and a third without its newline: two ingested, nothing failed; once the
    line is whole it is read."""
    lines = _jsonl_lines(samples)[:3]
    root = tmp_path / "jsonl"
    root.mkdir()
    f = root / "eps.jsonl"
    f.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    db = tmp_path / "s.db"
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--once")
    assert r.exit_code == 0, r.output + r.stderr
    assert "2 ingested" in r.stderr and "0 failed" in r.stderr and _batches(db) == []
    f.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2] + "\n")
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--once")
    assert r.exit_code == 0 and "1 ingested" in r.stderr
    (b,) = _batches(db)
    assert b["episodes"] == 3 and b["key"] == "jsonl"


def _jsonl_lines(samples: Path) -> list[str]:
    """OpenAI-style JSONL episodes (the format docs/INGEST.md accepts), built from the examples."""
    out = []
    for i in range(3):
        out.append(
            json.dumps(
                {
                    "episode_id": i,
                    "reward": 0.25 * (i + 1),
                    "messages": [
                        {"role": "user", "content": f"task {i}: list the files"},
                        {"role": "assistant", "content": f"I will look {i}."},
                        {"role": "user", "content": "ok"},
                        {"role": "assistant", "content": f"done {i}"},
                    ],
                }
            )
        )
    return out


@pytest.mark.slow
def test_kill_9_and_restart(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """A follower killed mid-run; the restart scores the rest and publishes each batch once."""
    root = tmp_path / "rollouts"
    for step in range(3):
        _write_group(root, step, 2, seed=40 + 10 * step)
    db = tmp_path / "s.db"
    argv = [sys.executable, "-m", "hcapo_store", "--db", str(db), "follow", str(root), "--server", ref.url]
    argv += ["--tokenizer", str(tiny_model_dir), "--max-context", "2048", "--group-size", "2", "--concurrency", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([*argv, "--until-idle", "600"], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        # wait for a state, not a time: some steps scored, not every batch published
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if db.exists() and _count(db, "SELECT count(*) FROM scores") >= 3:
                break
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    # the restart in process (CliRunner): only the kill needs a process of its own
    done = CliRunner().invoke(cli, [*argv[3:], "--until-idle", "1"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    batches = _batches(db)
    assert sorted(b["key"] for b in batches) == [f"rollouts/step_{s:04d}" for s in range(3)]
    assert all(b["status"] == "ready" and b["episodes"] == 2 for b in batches)
    steps = _count(db, "SELECT count(*) FROM steps")
    assert _count(db, "SELECT count(*) FROM scores") == steps  # every step once (a unique pair)


def _live_line(proc: subprocess.Popen) -> str:
    """The stderr lines up to the first live line (``follow: ...``): the first round is done."""
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("follow:"):
            return "".join(lines)
    raise AssertionError(f"follow ended before its first round: {''.join(lines)}")


def _count(db: Path, sql: str) -> int:
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return int(con.execute(sql).fetchone()[0])
    except sqlite3.OperationalError:  # the schema is not there yet
        return 0
    finally:
        con.close()


@pytest.mark.slow  # a CLI process signalled (the fast tier: docs/DEVELOPMENT.md)
def test_until_idle_exits_zero_and_sigterm_stops(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    _write_group(root, 0, 2, seed=70)
    db = tmp_path / "s.db"
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "2", "--until-idle", "0.5", "--poll", "0.1")
    assert r.exit_code == 0, r.output
    assert len(_batches(db)) == 1
    argv = [sys.executable, "-m", "hcapo_store", "--db", str(db), "follow", str(root), "--server", ref.url]
    argv += ["--tokenizer", str(tiny_model_dir), "--max-context", "2048", "--group-size", "2", "--poll", "0.1"]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    # wait until it is following (its live line), then stop it
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("follow:"), first
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 130 and "stopped; rerun" in err, err


class _FollowInThread:
    """The library's follow loop (the one the CLI runs) in a thread, stopped by its stop event
    (what the CLI's signal handler sets) when the context ends; its notices collected as the CLI
    prints them, and an exception that ended it kept for the test (not lost in the thread)."""

    def __init__(self, follower: Follower, poll_seconds: float) -> None:
        self.stop, self.first_round = threading.Event(), threading.Event()
        self.lines: list[str] = []
        self.ended: list[object] = []
        self.thread = threading.Thread(target=self._run, args=(follower, poll_seconds), name="follow", daemon=True)

    def _on_cycle(self, report: object, status: FollowStatus) -> None:
        self.lines.extend(status.notices)
        status.notices.clear()
        self.first_round.set()

    def _run(self, follower: Follower, poll_seconds: float) -> None:
        try:
            self.ended.append(follow(follower, poll_seconds=poll_seconds, stop=self.stop, on_cycle=self._on_cycle))
        except BaseException as exc:
            self.ended.append(exc)
            raise

    def running(self) -> bool:
        assert not self.ended, self.ended  # still following
        return True

    def __enter__(self) -> _FollowInThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def test_a_new_episode_wakes_follow_before_its_poll(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """File-system events wake the follower: with a look every hour, a batch written after it
    went idle is still published (the test waits for that state, far below an hour). The
    library's follow loop (the one the CLI runs) in a thread, stopped by its stop event (what
    the CLI's signal handler sets): no process is needed to watch a folder."""
    root = tmp_path / "rollouts"
    root.mkdir()
    db = tmp_path / "s.db"
    with Store.open(str(db)) as store:
        prep = prepare(store, ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048))
        follower = Follower(store, prep, FollowConfig(paths=[root], group_size=2), RunOptions())
        with _FollowInThread(follower, poll_seconds=3600) as f:
            wait_until(lambda: f.running() and f.first_round.is_set(), "its first round", timeout=600)
            assert any("nothing to follow yet" in line for line in f.lines), f.lines  # the empty folder said
            _write_group(root, 0, 2, seed=90)
            # a loaded machine: still far below the hour of the poll
            wait_until(lambda: f.running() and _count(db, "SELECT count(*) FROM batches") > 0, "the batch", timeout=600)
            published = _count(db, "SELECT count(*) FROM batches")
    assert not f.thread.is_alive()
    assert published == 1, f.lines


@pytest.mark.slow
@pytest.mark.postgres
def test_two_followers_on_one_postgresql_database_share_the_work(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    from pg import fresh_database

    root = tmp_path / "rollouts"
    for step in range(4):
        _write_group(root, step, 2, seed=100 + 10 * step)
    with fresh_database("follow") as url:
        assert CliRunner().invoke(cli, ["--db", url, "db", "upgrade"]).exit_code == 0
        argv = [sys.executable, "-m", "hcapo_store", "--db", url, "follow", str(root), "--server", ref.url]
        argv += ["--tokenizer", str(tiny_model_dir), "--max-context", "2048", "--group-size", "2"]
        argv += ["--concurrency", "1", "--until-idle", "2", "--poll", "0.2"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs = [
            subprocess.Popen([*argv, "--worker-id", f"w{i}"], env=env, stderr=subprocess.PIPE, text=True)
            for i in range(2)
        ]
        errors = [p.communicate(timeout=600)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errors
        batches = _batches_at(url)
        assert sorted(b["key"] for b in batches) == [f"rollouts/step_{s:04d}" for s in range(4)]  # each once
        with Store.open(url) as store:
            steps = store.query("SELECT count(*) FROM steps", read_only=True)[1][0][0]
            scores = store.query("SELECT count(*) FROM scores", read_only=True)[1][0][0]
            workers = store.query("SELECT count(DISTINCT worker_id) FROM scores", read_only=True)[1][0][0]
        assert scores == steps and workers >= 1


def _batches_at(url: str) -> list[dict]:
    r = CliRunner().invoke(cli, ["--db", url, "batches", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.mark.slow  # a server's fault waited out
def test_a_dead_server_pauses_follow_and_it_goes_on(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """The library's follow loop (the one the CLI runs) in a thread, stopped by its stop event:
    a server's pause is no matter of processes."""
    from faultserver import FaultServer

    root = tmp_path / "rollouts"
    root.mkdir()
    db = tmp_path / "s.db"
    proxy = FaultServer(ref)
    proxy.start()
    port = proxy.httpd.server_address[1]

    def said(f: _FollowInThread, *words: str) -> bool:
        return f.running() and any(all(w in line for w in words) for line in list(f.lines))

    back = None
    with Store.open(str(db)) as store:
        config = ScoreConfig(server=proxy.url, tokenizer=str(tiny_model_dir), max_context=2048)
        prep = prepare(store, config)
        follower = Follower(store, prep, FollowConfig(paths=[root], group_size=2), RunOptions(max_attempts=2))
        try:
            with _FollowInThread(follower, poll_seconds=0.2) as f:
                wait_until(lambda: f.running() and f.first_round.is_set(), "its first round")
                proxy.die()
                _write_group(root, 0, 2, seed=120)
                # paused, not exited, and long enough that a blind backoff would have grown past 2 s
                wait_until(lambda: said(f, "stopped answering", "4 s"), "the follower pauses")
                back = FaultServer(ref, port=port)
                back.start()
                wait_until(lambda: f.running() and _count(db, "SELECT count(*) FROM batches") == 1, "the batch")
        finally:
            if back is not None:  # after the follower stopped (the context's exit)
                back.shutdown()
        assert not f.thread.is_alive()
        f.lines.extend(follower.status.notices)  # said after the last round the loop reported
        # it probed while it waited and went on as soon as the server answered (issue 33 item 5:
        # a restart at every weight sync must not cost a backoff of up to a minute)
        assert any("answers again" in line for line in f.lines), f.lines
        assert _count(db, "SELECT count(*) FROM batches") == 1
        assert _count(db, "SELECT count(*) FROM scores") == _count(db, "SELECT count(*) FROM steps")


def test_batches_by_a_result_field(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """--batch-by field:NAME: the value of a field of result.json makes the batch, wherever the
    episodes sit; an episode without the field is named and in no batch."""
    root = tmp_path / "rollouts"
    episodes = write_standard_episodes(root, 5, seed=140, steps_per_subtask=1, output_words=5)
    for i, ep in enumerate(episodes[:4]):
        data = json.loads((ep / "result.json").read_text())
        data["group_id"] = "g-even" if i % 2 == 0 else "g-odd"
        (ep / "result.json").write_text(json.dumps(data))
    db = tmp_path / "s.db"
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "2", "--once", "--batch-by", "field:group_id")
    assert r.exit_code == 0, r.output
    assert "has no field 'group_id': it is in no batch" in r.stderr
    batches = _batches(db)
    assert sorted((b["key"], b["episodes"]) for b in batches) == [("g-even", 2), ("g-odd", 2)]
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "2", "--once", "--batch-by", "nonsense")
    assert r.exit_code == 2 and "--batch-by 'nonsense'" in r.output


def test_a_batch_timeout_publishes_a_short_batch(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    _write_group(root, 0, 2, seed=160)
    db = tmp_path / "s.db"
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--once")
    assert r.exit_code == 0 and _batches(db) == []  # 2 of 3: not complete
    r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--once", "--batch-timeout", "0")
    assert r.exit_code == 0, r.output
    (b,) = _batches(db)
    assert (b["episodes"], b["status"]) == (2, "ready")


def test_failed_episodes_are_named_in_their_batch(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """A server whose every answer is refused (a positive logprob): the steps fail for good, the
    batch is recorded as failed with its episodes by name, and follow exits 1."""
    from faultserver import FaultServer

    root = tmp_path / "rollouts"
    _write_group(root, 0, 2, seed=180)
    db = tmp_path / "s.db"
    with FaultServer(ref, lambda key, n: "positive_logprob") as bad:
        base = ["--db", str(db), "follow", str(root), "--server", bad.url, "--tokenizer", str(tiny_model_dir)]
        base += ["--max-context", "2048", "--group-size", "2", "--once", "--max-attempts", "1"]
        r = CliRunner().invoke(cli, base, catch_exceptions=False)
    assert r.exit_code == 1, r.output
    (b,) = _batches(db)
    assert b["status"] == "failed" and b["credit_run"] is None and b["failed"] == b["steps"] > 0
    assert [f["name"] for f in b["failed_episodes"]] == [
        "rollouts/step_0000/episode_001",
        "rollouts/step_0000/episode_002",
    ]
    assert all(f["stage"] == "score" and "failed for good" in f["reason"] for f in b["failed_episodes"])
    assert "failed episode(s) rollouts/step_0000/episode_001" in r.stderr
