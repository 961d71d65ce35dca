"""What `follow` promises (docs/PROMISES.md, issue 34): batches always close, `--until-idle`
always ends, hostile files are per-input failures, a growing JSONL is read from where it
stopped. Real files, real `follow` runs (in process; in a process of its own where a hostile
file could hang it), a real server over a tiny real model, real SQLite."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import EpisodeBuilder
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent
HANG_GUARD = 600  # seconds: a follow that hangs fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _collect(directory: Path, builder: EpisodeBuilder, *, result: bool = True) -> Path:
    """As a collector does: the session first, then result.json renamed into place (whole)."""
    builder.write(directory)
    final = directory / "result.json"
    if not result:
        final.unlink()
        return directory
    tmp = directory / "result.json.tmp"
    final.rename(tmp)
    tmp.rename(final)
    return directory


def _episode(seed: int, n: int) -> EpisodeBuilder:
    return EpisodeBuilder(seed=seed, episode_id=n, reward=round(0.1 * (n % 10), 2)).standard(
        steps_per_subtask=1, output_words=5
    )


def _follow_argv(db: Path, ref: ReferenceServer, tiny: Path, *args: str) -> list[str]:
    argv = ["--db", str(db), "follow", *args, "--server", ref.url]
    return argv + ["--tokenizer", str(tiny), "--max-context", "2048", "--poll", "0.1"]


def _follow(db: Path, ref: ReferenceServer, tiny: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`follow` in process (CliRunner: the console script's own `cli`), its exit status and
    output as a process's; an exception that escaped the command (a traceback) fails the test."""
    argv = _follow_argv(db, ref, tiny, *args)
    r = CliRunner().invoke(cli, argv, catch_exceptions=False)
    return subprocess.CompletedProcess(argv, r.exit_code, r.stdout, r.stderr)


def _follow_process(db: Path, ref: ReferenceServer, tiny: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`follow` in a process of its own: for hostile files, where a hang or a MemoryError must end
    that process (bounded by HANG_GUARD), not the test's."""
    argv = [sys.executable, "-m", "hcapo_store", *_follow_argv(db, ref, tiny, *args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=HANG_GUARD)


def _batches(db: Path) -> list[dict]:
    r = CliRunner().invoke(cli, ["--db", str(db), "batches", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_batches_close_with_an_unstorable_member_and_until_idle_names_what_waits(
    tmp_path: Path, ref, tiny_model_dir: Path
) -> None:
    """13 episodes in four step folders; one cannot be stored (one message after conversion),
    one result.json never comes (the collector crashed). Before: the batch with the bad episode
    never reached 4 and `--until-idle` never ended. Now it publishes with the failed member named,
    and follow exits, naming the batch and the episode that still wait."""
    root = tmp_path / "rollouts"
    n = 0
    for step in range(3):
        for i in range(4):
            n += 1
            if step == 1 and i == 2:
                bad = EpisodeBuilder(seed=500 + n, episode_id=n).header().user("only a question")
                _collect(root / f"step_{step:04d}" / f"episode_{i:03d}", bad)
            else:
                _collect(root / f"step_{step:04d}" / f"episode_{i:03d}", _episode(500, n))
    _collect(root / "step_0003" / "episode_000", _episode(500, 13), result=False)  # never finishes
    db = tmp_path / "s.db"
    done = _follow(db, ref, tiny_model_dir, str(root), "--batch-by", "parent", "--group-size", "4", "--until-idle", "1")
    assert done.returncode == 1, done.stderr  # one episode failed: 1 outranks 3
    assert "Traceback" not in done.stderr
    batches = {b["key"]: b for b in _batches(db)}
    assert sorted(batches) == ["rollouts/step_0000", "rollouts/step_0001", "rollouts/step_0002"]
    b1 = batches["rollouts/step_0001"]
    assert (b1["status"], b1["episodes"], len(b1["members"])) == ("ready", 4, 3)
    (failed,) = b1["failed_episodes"]
    assert failed["name"] == "rollouts/step_0001/episode_002" and failed["stage"] == "ingest"
    assert "fewer than 2 messages after conversion" in failed["reason"]
    assert "still waiting: " in done.stderr and "step_0003/episode_000: no result.json yet" in done.stderr
    assert "still waiting: batch rollouts/step_0003: " not in done.stderr  # its only member is no arrival yet


@pytest.mark.slow  # two follow runs; the exit and --batch-timeout: tests/test_follow.py
def test_until_idle_ends_while_a_batch_lacks_members_exit_3(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """A collector that crashed after 2 of 3 episodes: follow ends, exit 3, the batch named;
    `--batch-timeout` is the bound that publishes it."""
    root = tmp_path / "rollouts"
    for i in range(2):
        _collect(root / "step_0000" / f"episode_{i:03d}", _episode(600, i + 1))
    db = tmp_path / "s.db"
    done = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "3", "--until-idle", "0.5")
    assert done.returncode == 3, done.stderr
    assert "still waiting: batch rollouts/step_0000: 2 of 3 episode(s)" in done.stderr
    assert _batches(db) == []
    done = _follow(
        db, ref, tiny_model_dir, str(root), "--group-size", "3", "--until-idle", "0.5", "--batch-timeout", "0"
    )
    assert done.returncode == 0, done.stderr
    (b,) = _batches(db)
    assert (b["episodes"], b["status"]) == (2, "ready")


@pytest.mark.slow  # a follow process; the same files in process: tests/test_hostile_ingest.py
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_hostile_files_fail_alone_and_good_episodes_are_stored(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """A result.json that is a FIFO (hung follow) or a link to /dev/zero (MemoryError, nothing
    stored), a .jsonl FIFO, and a .jsonl link out of the folder to a FIFO (opened before it was
    refused: opening a FIFO blocks, so this ends only if it is never opened)."""
    root = tmp_path / "rollouts" / "step_0000"
    good = [_collect(root / f"episode_{i:03d}", _episode(700, i + 1)) for i in range(2)]
    fifo = _collect(root / "episode_fifo", _episode(700, 3))
    (fifo / "result.json").unlink()
    os.mkfifo(fifo / "result.json")
    zero = _collect(root / "episode_zero", _episode(700, 4))
    (zero / "result.json").unlink()
    (zero / "result.json").symlink_to("/dev/zero")
    device = _collect(root / "episode_device", _episode(700, 5))
    (device / "result.json").unlink()
    try:  # /dev/zero's own device numbers, inside the followed folder (root may make one)
        os.mknod(device / "result.json", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    except PermissionError:
        (device / "result.json").symlink_to("/dev/zero")  # then refused as a link out, like episode_zero
    os.mkfifo(root / "pipe.jsonl")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.mkfifo(outside / "secret.jsonl")
    (root / "leak.jsonl").symlink_to(outside / "secret.jsonl")
    db = tmp_path / "s.db"
    done = _follow_process(
        db, ref, tiny_model_dir, str(tmp_path / "rollouts"), "--group-size", "7", "--until-idle", "0.5"
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    failed = [line for line in done.stderr.splitlines() if line.startswith("failed: ") and "batch " not in line]
    expect = {
        "episode_fifo": "a FIFO, not a regular file",
        "episode_zero": "a symbolic link out of the followed folders (to /dev/zero)",
        "pipe.jsonl": "a FIFO, not a regular file",
        "leak.jsonl": "a symbolic link out of the followed folders",
    }
    for where, why in expect.items():
        assert sum(where in line and why in line for line in failed) == 1, (where, failed)
    assert (
        sum(
            "episode_device" in line and ("a device, not a regular file" in line or "out of" in line) for line in failed
        )
        == 1
    )
    (b,) = _batches(db)
    assert sorted(m["name"] for m in b["members"]) == [f"rollouts/step_0000/{g.name}" for g in good]
    assert sorted(f["name"] for f in b["failed_episodes"]) == [
        "rollouts/step_0000/episode_device",
        "rollouts/step_0000/episode_fifo",
        "rollouts/step_0000/episode_zero",
        "rollouts/step_0000/leak.jsonl",
        "rollouts/step_0000/pipe.jsonl",
    ]


def test_a_link_out_of_the_folder_is_read_only_when_asked(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "eps.jsonl").write_text(_jsonl_line(1) + "\n")
    (root / "eps.jsonl").symlink_to(outside / "eps.jsonl")
    db = tmp_path / "s.db"
    # in process: an exception escaping the command (before: the failed batch was published
    # before its scorer was registered, FOREIGN KEY constraint failed) fails the test
    refused = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "1", "--once")
    assert refused.returncode == 1 and "a symbolic link out of the followed folders" in refused.stderr
    assert "Traceback" not in refused.stderr
    with Store.open(str(db)) as store:
        assert store.query("SELECT count(*) FROM episodes", read_only=True)[1][0][0] == 0
    (failed,) = _batches(db)  # the refused member's batch is published, failed, naming it
    assert failed["status"] == "failed" and failed["episodes"] == 1
    asked = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "1", "--once", "--follow-links")
    assert asked.returncode == 0, asked.stderr
    first, b = sorted(_batches(db), key=lambda x: x["id"])
    assert b["status"] == "ready" and b["episodes"] == 1
    assert first["status"] == "failed" and first["credit_run"] is None  # the refused arrival, on record


def _jsonl_line(i: int) -> str:
    return json.dumps(
        {
            "episode_id": f"ep-{i}",
            "reward": 0.25 * (i % 4),
            "messages": [
                {"role": "user", "content": f"task {i}"},
                {"role": "assistant", "content": f"I will look {i}."},
                {"role": "user", "content": "ok"},
                {"role": "assistant", "content": f"done {i}"},
            ],
        }
    )


def test_a_growing_jsonl_is_read_from_where_it_stopped(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """The follower keeps a byte offset per JSONL file: after the first cycle only the lines
    added since are read (before: the whole file, every old line counted again as unchanged),
    and a line still being written waits — not a failure, not exit 1."""
    from hcapo_store.online.follow import FollowConfig, Follower
    from hcapo_store.scoring.job import ScoreConfig, prepare
    from hcapo_store.scoring.scheduler import RunOptions

    root = tmp_path / "jsonl"
    root.mkdir()
    f = root / "eps.jsonl"
    f.write_text("".join(_jsonl_line(i) + "\n" for i in range(3)))
    with Store.open(str(tmp_path / "s.db")) as store:
        prep = prepare(store, ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048))
        follower = Follower(store, prep, FollowConfig(paths=[root], group_size=4), RunOptions())
        first = follower.cycle()
        assert first.ingest is not None and first.ingest.new == 3
        assert follower.cursors[f].offset == f.stat().st_size
        half = _jsonl_line(3)
        with f.open("a") as out:
            out.write(half[: len(half) // 2])
        second = follower.cycle()
        assert second.ingest is not None and (second.ingest.new, second.ingest.unchanged, second.ingest.failed) == (
            0,
            0,
            0,
        )
        assert follower.waiting == {f"{f}:4": "a line still being written"}
        with f.open("a") as out:
            out.write(half[len(half) // 2 :] + "\n")
        third = follower.cycle()
        assert third.ingest is not None
        assert (third.ingest.new, third.ingest.unchanged, third.ingest.failed) == (1, 0, 0)  # the new line only
        assert follower.waiting == {} and follower.status.ingest_failed == 0
        assert [b.episodes for b in third.published] == [4]
        # a rewritten (not grown) file is read again from its start
        f.write_text(_jsonl_line(0) + "\n")
        fourth = follower.cycle()
        assert fourth.ingest is not None and fourth.ingest.unchanged == 1


def test_an_idle_cycle_runs_no_query(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """Once every batch is published, a cycle with nothing new sends nothing to the database,
    whatever it holds (counted on the engine's own statement events)."""
    from sqlalchemy import event

    from hcapo_store.online.follow import FollowConfig, Follower
    from hcapo_store.scoring.job import ScoreConfig, prepare
    from hcapo_store.scoring.scheduler import RunOptions

    root = tmp_path / "rollouts"
    for i in range(2):
        _collect(root / "step_0000" / f"episode_{i:03d}", _episode(800, i + 1))
    with Store.open(str(tmp_path / "s.db")) as store:
        prep = prepare(store, ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048))
        follower = Follower(store, prep, FollowConfig(paths=[root], group_size=2), RunOptions())
        assert [b.episodes for b in follower.cycle().published] == [2]
        statements: list[str] = []
        event.listen(store.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        idle = follower.cycle()
        assert not idle.busy and idle.changed == 0
        assert statements == []
        # one new episode: the work is that episode's (and its batch's), then idle again
        _collect(root / "step_0001" / "episode_000", _episode(800, 3))
        follower.cfg.batch_timeout = 0
        assert [b.key for b in follower.cycle().published] == ["rollouts/step_0001"]
        statements.clear()
        follower.cycle()
        assert statements == []


def test_the_lists_kept_between_reports_are_bounded() -> None:
    """A week of failures with nobody draining them keeps MAX_LISTED messages and counts the rest."""
    from hcapo_store.online.state import MAX_LISTED, FollowStatus

    status = FollowStatus()
    for i in range(MAX_LISTED + 50):
        status.fail(f"input {i}: broken")
        status.notice(f"input {i}: waiting")
    assert len(status.failures) == len(status.notices) == MAX_LISTED
    assert status.failures[-1] == f"input {MAX_LISTED - 1}: broken" and status.unlisted == 100
