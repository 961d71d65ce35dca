"""`follow` against round 4's attacks (issue 41): a refused line still closes its batch under
``--batch-by field:NAME``, a JSONL rewritten in place is read again, a folder replaced by a
file and back is read again. A real follower over real files, a real server over a tiny real
model, real SQLite."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.online.follow import FollowConfig, Follower
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _line(i: int, reward: object, **extra: object) -> str:
    return json.dumps(
        {
            "episode_id": f"ep-{i}",
            "reward": reward,
            **extra,
            "messages": [
                {"role": "user", "content": f"task {i}"},
                {"role": "assistant", "content": f"I will look {i}."},
                {"role": "user", "content": "ok"},
                {"role": "assistant", "content": f"done {i}"},
            ],
        }
    )


def _follower(store: Store, ref: ReferenceServer, tiny: Path, root: Path, **cfg: object) -> Follower:
    prep = prepare(store, ScoreConfig(server=ref.url, tokenizer=str(tiny), max_context=2048))
    return Follower(store, prep, FollowConfig(paths=[root], **cfg), RunOptions())  # type: ignore[arg-type]


def _rewards(store: Store) -> dict[str, float]:
    rows = store.query("SELECT external_id, reward FROM episodes WHERE is_current", read_only=True)[1]
    return {e: r for e, r in rows}


def test_a_refused_line_closes_its_field_batch(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """Three lines of uid g, one refused by ingest (reward "high"): the batch is published with
    the failed member, as ``--batch-by parent`` publishes it (before: "2 of 3" forever)."""
    root = tmp_path / "jsonl"
    root.mkdir()
    (root / "eps.jsonl").write_text("".join(_line(i, r, uid="g") + "\n" for i, r in enumerate([1.0, "high", 0.0])))
    with Store.open(str(tmp_path / "s.db")) as store:
        follower = _follower(store, ref, tiny_model_dir, root, group_size=3, batch_by="field:uid")
        report = follower.cycle()
        (batch,) = report.published
        assert (batch.key, batch.episodes, len(batch.members)) == ("g", 3, 2)
        (failed,) = batch.failed_episodes
        assert failed.stage == "ingest" and failed.name.endswith("eps.jsonl:2"), failed
        assert follower.still_waiting() == []


def test_a_jsonl_rewritten_in_place_is_read_again(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """A reward corrected from 0.25 to 0.75 (same length), then a rewrite 4 bytes longer: each is
    a new version, as plain ``ingest`` of the same file stores it; the batch is published again."""
    root = tmp_path / "jsonl"
    root.mkdir()
    f = root / "eps.jsonl"
    f.write_text(_line(0, 0.25) + "\n" + _line(1, 0.5) + "\n")
    with Store.open(str(tmp_path / "s.db")) as store:
        follower = _follower(store, ref, tiny_model_dir, root, group_size=2)
        assert [b.episodes for b in follower.cycle().published] == [2]
        same_length = _line(0, 0.75) + "\n" + _line(1, 0.5) + "\n"
        assert len(same_length) == f.stat().st_size
        f.write_text(same_length)
        second = follower.cycle()
        assert second.ingest is not None and (second.ingest.changed, second.ingest.failed) == (1, 0)
        assert _rewards(store) == {"ep-0": 0.75, "ep-1": 0.5}
        assert [b.episodes for b in second.published] == [2]
        longer = _line(0, 0.751234) + "\n" + _line(1, 0.5) + "\n"
        assert len(longer) == f.stat().st_size + 4
        f.write_text(longer)
        third = follower.cycle()
        assert third.ingest is not None and (third.ingest.changed, third.ingest.failed) == (1, 0), third.ingest
        assert _rewards(store) == {"ep-0": 0.751234, "ep-1": 0.5}
        assert follower.status.ingest_failed == 0


def test_a_group_folder_replaced_by_a_file_then_a_folder_is_read_again(
    tmp_path: Path, ref, tiny_model_dir: Path
) -> None:
    root = tmp_path / "rollouts"
    group = root / "g"
    group.mkdir(parents=True)
    (group / "eps.jsonl").write_text(_line(0, 0.25) + "\n")
    with Store.open(str(tmp_path / "s.db")) as store:
        follower = _follower(store, ref, tiny_model_dir, root, group_size=1)
        assert [b.episodes for b in follower.cycle().published] == [1]
        shutil.rmtree(group)
        group.write_text("not a folder\n")
        follower.cycle()
        group.unlink()
        group.mkdir()
        (group / "eps.jsonl").write_text(_line(0, 0.75, note="longer content") + "\n")
        report = follower.cycle()
        assert report.ingest is not None and (report.ingest.changed, report.ingest.failed) == (1, 0), report.ingest
        assert _rewards(store) == {"ep-0": 0.75}
        assert follower.status.ingest_failed == 0


@pytest.mark.slow
def test_sigterm_stops_follow_in_the_middle_of_scoring_as_sigint_does(tmp_path: Path, ref, tiny_model_dir) -> None:
    """While the server holds its answers, SIGTERM stops the scoring run as Ctrl-C does (its
    grace period, then the steps go back to the queue): before, it waited for the run's end."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from faultserver import FaultServer
    from test_bounded_read import REPO

    from hcapo_store.devkit.synth import write_standard_episodes

    root = tmp_path / "rollouts"
    write_standard_episodes(root / "step_0000", 2, seed=5, steps_per_subtask=1, output_words=5)
    with FaultServer(ref) as proxy:
        proxy.hold_answers = threading.Event()  # never set: every request waits
        argv = [sys.executable, "-m", "hcapo_store", "--db", str(tmp_path / "s.db"), "follow", str(root)]
        argv += ["--server", proxy.url, "--tokenizer", str(tiny_model_dir), "--max-context", "2048"]
        argv += ["--group-size", "2"]
        proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
        try:
            while proxy.requests == 0:  # scoring has begun: a request waits for its answer
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                threading.Event().wait(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=300) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proxy.hold_answers.set()
        assert proc.stderr is not None and "stopped; rerun" in proc.stderr.read()


def test_a_database_deleted_or_replaced_under_follow_stops_it(tmp_path: Path, ref, tiny_model_dir) -> None:
    """Its connections would go on writing to the unlinked file: batches that exist nowhere.
    The follower notices before and after each round and stops (exit 1 from the CLI)."""
    import os

    from hcapo_store.errors import StoreError

    root = tmp_path / "jsonl"
    root.mkdir()
    (root / "eps.jsonl").write_text(_line(0, 0.25) + "\n")
    db = tmp_path / "s.db"
    with Store.open(str(db)) as store:
        follower = _follower(store, ref, tiny_model_dir, root, group_size=1)
        assert len(follower.cycle().published) == 1
        other = tmp_path / "other.db"
        Store.open(str(other)).close()
        os.replace(other, db)  # replaced: another store at the same path
        with pytest.raises(StoreError, match="replaced by another file"):
            follower.cycle()


@pytest.mark.slow
def test_follow_exits_1_when_its_database_is_deleted(tmp_path: Path, ref, tiny_model_dir) -> None:
    import os
    import subprocess
    import sys

    from test_bounded_read import REPO

    root = tmp_path / "jsonl"
    root.mkdir()
    (root / "eps.jsonl").write_text(_line(0, 0.25) + "\n")
    db = tmp_path / "s.db"
    argv = [sys.executable, "-m", "hcapo_store", "--db", str(db), "follow", str(root), "--server", ref.url]
    argv += ["--tokenizer", str(tiny_model_dir), "--max-context", "2048", "--group-size", "1", "--poll", "0.1"]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().startswith("follow:")  # its first round is done
        db.unlink()
        assert proc.wait(timeout=300) == 1
        assert "was deleted while this process used it" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_many_episodes_at_once_are_scored_in_rounds_each_published_when_done(
    tmp_path: Path, ref, tiny_model_dir, monkeypatch
) -> None:
    """Episodes dropped at once are scored in rounds of ``SCORE_ROUND`` episodes (a run's
    episode filter is bound into each claim: one run over them all was quadratic), and each
    round's batches are published before the next round's first request reaches the server."""
    import sqlite3

    from faultserver import FaultServer

    from hcapo_store.devkit.synth import write_standard_episodes
    from hcapo_store.online import follow as follow_module

    monkeypatch.setattr(follow_module, "SCORE_ROUND", 2)
    monkeypatch.setattr(follow_module, "ROUND_PER_REQUEST", 0)
    root = tmp_path / "rollouts"
    for step in range(3):
        write_standard_episodes(root / f"step_{step:04d}", 2, seed=10 * step, steps_per_subtask=1, output_words=5)
    db = tmp_path / "s.db"
    seen_published: list[int] = []

    def schedule(key: str, n: int) -> None:  # at each request's arrival: the batches already published
        with sqlite3.connect(db) as conn:
            seen_published.append(conn.execute("SELECT COUNT(*) FROM batches").fetchone()[0])

    with Store.open(str(db)) as store, FaultServer(ref, schedule) as proxy:
        prep = prepare(store, ScoreConfig(server=proxy.url, tokenizer=str(tiny_model_dir), max_context=2048))
        follower = Follower(store, prep, FollowConfig(paths=[root], group_size=2), RunOptions())
        report = follower.cycle()
        assert [b.key for b in report.published] == [f"rollouts/step_{s:04d}" for s in range(3)]
        assert report.score is not None and report.score.failed == 0
        assert report.score.scored == store.query("SELECT COUNT(*) FROM steps", read_only=True)[1][0][0]
    assert sorted(set(seen_published)) == [0, 1, 2], seen_published


def test_a_watchfiles_failure_is_said(tmp_path: Path) -> None:
    """The watch thread's failure (here: a path gone before it starts) is a notice and a log
    line, and the wait still ends at its poll (before: swallowed without a word)."""
    import threading

    from hcapo_store.online.waiting import Waiter

    said: list[str] = []
    stop = threading.Event()
    waiter = Waiter([tmp_path / "gone"], 0.05, stop, False, said.append)
    waiter.wait()
    stop.set()
    (message,) = said
    assert message.startswith("file-system events stopped (") and "every 0.05 s instead" in message, message


def test_a_result_json_saved_again_with_the_same_content_is_no_new_version(
    tmp_path: Path, ref, tiny_model_dir: Path
) -> None:
    """Identity by parsed content: the published batch stays (before: a new version, the batch
    superseded); a changed reward is still a new version and a new batch."""
    from hcapo_store.devkit.synth import write_standard_episodes

    root = tmp_path / "rollouts"
    (episode,) = write_standard_episodes(root / "step_0000", 1, seed=3, steps_per_subtask=1, output_words=5)
    result = episode / "result.json"
    with Store.open(str(tmp_path / "s.db")) as store:
        follower = _follower(store, ref, tiny_model_dir, root, group_size=1)
        assert len(follower.cycle().published) == 1
        data = json.loads(result.read_text())
        result.write_text(json.dumps(dict(reversed(list(data.items()))), indent=4))
        again = follower.cycle()
        assert again.changed == 0 and again.published == [] and again.ingest is None
        assert store.query("SELECT COUNT(*) FROM episodes", read_only=True)[1] == [(1,)]
        data["episode_reward"] = 0.123
        result.write_text(json.dumps(data))
        changed = follower.cycle()
        assert changed.ingest is not None and changed.ingest.changed == 1
        assert len(changed.published) == 1
        assert store.query("SELECT status FROM batches ORDER BY id", read_only=True)[1] == [("superseded",), ("ready",)]


def test_a_repeated_line_is_one_member_and_its_batch_publishes(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """A collector that appends a line again (a retry), or two rollouts equal byte for byte:
    ingest keeps one episode, so the batch has one member for it, counted once toward the group,
    and publishes once the group's other member comes (before: the ids named it twice, the
    batch insert failed on its unique key, a traceback on every start, the credit run orphaned)."""
    root = tmp_path / "jsonl"
    root.mkdir()
    a, b, c = (_line(i, r, uid="g") + "\n" for i, r in enumerate([1.0, 0.0, 0.5]))
    (root / "eps.jsonl").write_text(a + a + b)
    with Store.open(str(tmp_path / "s.db")) as store:
        follower = _follower(store, ref, tiny_model_dir, root, group_size=3, batch_by="field:uid")
        assert follower.cycle().published == []  # two distinct members of three
        assert follower.still_waiting() == ["batch g: 2 of 3 episode(s)"]
        assert any("eps.jsonl:2 repeats" in n and "eps.jsonl:1" in n for n in follower.status.notices)
        with (root / "eps.jsonl").open("a") as f:
            f.write(c)
        (batch,) = follower.cycle().published
        assert (batch.key, batch.episodes, batch.status) == ("g", 3, "ready")
        assert sorted(m.external_id for m in batch.members) == ["ep-0", "ep-1", "ep-2"]
        runs = store.query("SELECT episodes FROM credit_runs", read_only=True)[1]
        assert [r[0] for r in runs] == [3]
        # a restart reads the same file: nothing new, nothing fails
        again = _follower(store, ref, tiny_model_dir, root, group_size=3, batch_by="field:uid")
        assert again.cycle().published == [] and again.still_waiting() == []
