"""The batch API a trainer calls (issue 33 item 2): ``BatchInfo`` lists its members by store
name and collector id, ``wait_for_batch`` blocks until `follow` publishes a step's batch —
a real store, a real server, a real `follow`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import hcapo_store
from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import BatchNotReady, UsageError
from hcapo_store.online.batches import list_batches, step_of_key, wait_for_batch
from hcapo_store.storage.store import Store


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _follow(db: Path, ref: ReferenceServer, tiny: Path, *args: str):
    base = ["--db", str(db), "follow", *args, "--server", ref.url, "--tokenizer", str(tiny), "--max-context", "2048"]
    return CliRunner().invoke(cli, base, catch_exceptions=False)


def test_the_api_is_exported() -> None:
    for name in ("BatchInfo", "BatchMember", "FailedEpisode", "list_batches", "wait_for_batch", "BatchNotReady"):
        assert name in hcapo_store.__all__
        assert getattr(hcapo_store, name) is not None


@pytest.mark.parametrize(
    ("key", "step"),
    [("rollouts/step_0007", 7), ("step-12", 12), ("3", 3), ("runs/a/global_step_100/", 100), ("rollouts/x", None)],
)
def test_the_step_a_key_names(key: str, step: int | None) -> None:
    assert step_of_key(key) == step


def test_wait_for_a_step_returns_its_batch_with_members(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    write_standard_episodes(root / "step_0007", 2, seed=5, steps_per_subtask=1, output_words=5)
    db = tmp_path / "s.db"
    with Store.open(str(db)) as store:
        # nothing published yet: a bounded wait says so, in the error hcapo-store raises
        with pytest.raises(BatchNotReady, match="training step 7"):
            wait_for_batch(store, step=7, timeout=0)
        got: list[object] = []

        def waiter() -> None:
            try:
                got.append(wait_for_batch(store, step=7, poll=0.05))
            except Exception as exc:  # handed to the test thread
                got.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        r = _follow(db, ref, tiny_model_dir, str(root), "--group-size", "2", "--once")
        assert r.exit_code == 0, r.output
        thread.join()  # returns once the batch is there: no deadline is guessed
        (info,) = got
        assert isinstance(info, hcapo_store.BatchInfo), info
        assert (info.key, info.status, info.episodes) == ("rollouts/step_0007", "ready", 2)
        assert [m.name for m in info.members] == ["rollouts/step_0007/episode_001", "rollouts/step_0007/episode_002"]
        assert info.external_ids == ["1", "2"]  # result.json's episode_id, as the collector wrote it
        assert info.failed_episodes == []
        # the same by key, and in the feed; as_dict is JSON-ready
        assert wait_for_batch(store, "rollouts/step_0007", timeout=0) == info
        (listed,) = list_batches(store)
        assert listed == info
        assert listed.as_dict()["members"][0]["external_id"] == "1"


def test_wait_for_batch_refuses_unclear_questions(tmp_path: Path, store) -> None:
    with pytest.raises(UsageError, match="exactly one"):
        wait_for_batch(store)
    with pytest.raises(UsageError, match="exactly one"):
        wait_for_batch(store, "k", step=1)
    with pytest.raises(UsageError, match="poll"):
        wait_for_batch(store, step=1, poll=0)


def test_a_timeout_is_counted_on_the_callers_clock(store) -> None:
    """The deadline is the caller's clock: the wait polls until it passes, then raises."""
    ticks = iter(range(100))
    slept: list[float] = []
    with pytest.raises(BatchNotReady, match="within 3 s"):
        wait_for_batch(
            store, "rollouts/step_0001", timeout=3, poll=1, clock=lambda: float(next(ticks)), sleep=slept.append
        )
    assert slept and all(0 <= s <= 1 for s in slept)
