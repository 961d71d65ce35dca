"""Insert once (storage/once.py): two writers of the same row at the same moment end with one
row and no error, on SQLite and on PostgreSQL, for an episode version (two ingesters, e.g.
two ``follow`` processes on one folder) and for a credit run (two followers publishing the
same batch).

The first writer is held inside its open transaction, after its insert, until the second one
is waiting for it: on PostgreSQL the second writer's insert waits for the first one's row (a
lock wait the test sees in ``pg_stat_activity``); on SQLite the writers are serialised at
``BEGIN IMMEDIATE`` (the second waits in its busy timeout, which no query shows, so the test
lets it go as soon as it has started: either order must give the same end).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pg
import pytest
from _waiting import HANG_GUARD_S, wait_until
from sqlalchemy import text
from test_credits import add_scorer, add_scores

from hcapo_store.credits.compute import ComputeResult, compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import IngestReport, ingest
from hcapo_store.storage.store import Store


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def two_stores(request, tmp_path: Path) -> Iterator[tuple[Store, Store, str]]:
    """Two handles on one database (two writers with their own connections) and its kind."""
    if request.param == "sqlite":
        yield from _pair(str(tmp_path / "store.db"), "sqlite")
    else:
        with pg.fresh_database("once") as url:
            yield from _pair(url, "postgres")


def _pair(url: str, kind: str) -> Iterator[tuple[Store, Store, str]]:
    a = Store.open(url)
    b = Store.open(url)
    try:
        yield a, b, kind
    finally:
        a.close()
        b.close()


def _one(store: Store, sql: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def _lock_waits(store: Store) -> int:
    return _one(
        store,
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )


def _race(
    kind: str,
    watcher: Store,
    first: Callable[[Callable[..., None]], Any],
    second: Callable[[], Any],
) -> tuple[Any, Any]:
    """Run ``first`` (given a hook to call inside its open transaction, after its insert) and,
    while it is held there, ``second``; let ``first`` commit once ``second`` waits for it."""
    inside, release, second_started = threading.Event(), threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def hold(*_: Any) -> None:
        if not inside.is_set():
            inside.set()
            assert release.wait(HANG_GUARD_S), "never released"

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            results[name] = fn()
        except BaseException as exc:  # the test reports it below
            results[name] = exc

    def run_second() -> None:
        second_started.set()
        run("second", second)

    a = threading.Thread(target=run, args=("first", lambda: first(hold)))
    a.start()
    wait_until(lambda: inside.is_set() or "first" in results, "the first writer is inside its transaction")
    b = threading.Thread(target=run_second)
    b.start()
    if kind == "postgres":
        wait_until(lambda: _lock_waits(watcher) > 0 or "second" in results, "the second writer waits for the first")
    else:
        wait_until(second_started.is_set, "the second writer has started")
    release.set()
    a.join(HANG_GUARD_S)
    b.join(HANG_GUARD_S)
    for name in ("first", "second"):
        assert not isinstance(results.get(name), BaseException), f"{name} writer: {results[name]!r}"
    return results["first"], results["second"]


def test_two_ingesters_of_the_same_episode_store_it_once(two_stores, tmp_path: Path) -> None:
    a, b, kind = two_stores
    write_standard_episodes(tmp_path / "eps", 1)
    folder = tmp_path / "eps"
    first, second = _race(
        kind,
        a,
        lambda hold: ingest(a, [folder], jobs=1, on_episode=hold),
        lambda: ingest(b, [folder], jobs=1),
    )
    assert isinstance(first, IngestReport) and isinstance(second, IngestReport)
    assert (first.new, first.failed, first.failures) == (1, 0, [])
    assert (second.failed, second.failures) == (0, [])  # no "database refused this episode"
    assert (second.new, second.unchanged) == (0, 1)  # the other's version: the same content
    assert _one(a, "SELECT COUNT(*) FROM episodes") == 1
    assert _one(a, "SELECT COUNT(*) FROM steps") == _one(a, "SELECT num_steps FROM episodes")


def test_two_followers_computing_the_same_batch_run_store_it_once(two_stores, tmp_path: Path) -> None:
    a, b, kind = two_stores
    write_standard_episodes(tmp_path / "eps", 4)
    ingest(a, [tmp_path / "eps"], jobs=1)
    add_scorer(a, "s1")
    add_scores(a, "s1")
    ids = [int(row[0]) for row in a.query("SELECT id FROM episodes ORDER BY id")[1]]
    params = CreditParams()

    def batch_run(store: Store, hook: Callable[..., None] | None = None) -> ComputeResult:
        # what follow's batcher calls for a complete batch (online/batching.py)
        return compute_credits(store, params, name="batch-same", scorer="s1", episodes=ids, on_progress=hook)

    first, second = _race(kind, a, lambda hold: batch_run(a, hold), lambda: batch_run(b))
    assert first.created and not second.created
    assert first.run.id == second.run.id and second.run.name == "batch-same"
    assert _one(a, "SELECT COUNT(*) FROM credit_runs") == 1
    assert _one(a, "SELECT COUNT(*) FROM credits") == first.run.steps > 0
