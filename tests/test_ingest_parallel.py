"""Ingest with episodes parsed in worker processes: the same database as one process makes.

Real files, real worker processes (a forkserver pool), real SQLite stores made by the
migrations. What is compared is every stored column but the ingest time.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from builders import write_bad_episodes, write_standard_episodes

from hcapo_store.ingestion import parallel
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.ingestion.sources import ConvertOptions, Source, iter_sources
from hcapo_store.storage.store import Store

TABLES = {
    "episodes": "SELECT * FROM episodes ORDER BY id",
    "messages": "SELECT * FROM messages ORDER BY episode_id, message_index",
    "steps": "SELECT * FROM steps ORDER BY episode_id, step_index",
    "subtasks": "SELECT * FROM subtasks ORDER BY episode_id, position",
    "tags": "SELECT * FROM tags ORDER BY episode_id, key",
}


def _contents(store: Store) -> dict[str, list[tuple]]:
    out = {}
    for table, sql in TABLES.items():
        columns, rows = store.query(sql)
        keep = [i for i, c in enumerate(columns) if c != "ingested_at"]
        out[table] = [tuple(row[i] for i in keep) for row in rows]
    return out


def _inputs(root: Path) -> Path:
    """Enough good episodes to start the pool, every bad case, and a JSONL file of episodes."""
    write_standard_episodes(root, 2 * parallel.CHUNK + 5, steps_per_subtask=3)
    write_bad_episodes(root)
    lines = [
        {"episode_id": f"j{i}", "reward": i / 10, "messages": [{"role": "user", "content": f"task {i}"}]}
        for i in range(parallel.MIN_PARALLEL + 2)
    ]
    (root / "more.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    return root


def test_workers_store_exactly_what_one_process_stores(tmp_path):
    root = _inputs(tmp_path / "t")
    reports, contents = {}, {}
    for jobs in (1, 2):
        with Store.open(str(tmp_path / f"jobs{jobs}.db")) as store:
            reports[jobs] = ingest(store, [root], tags={"run": "r1"}, jobs=jobs)
            contents[jobs] = _contents(store)
    one, two = reports[1], reports[2]
    assert one.new > 2 * parallel.CHUNK and one.failed >= 3 and sum(one.skipped.values()) >= 1
    assert one.as_dict() == two.as_dict()  # the same failures (file and line named), skips, warnings
    assert contents[1] == contents[2]
    assert any(":" in message and "more.jsonl:" in message for _, message in two.failures)


@pytest.mark.slow  # worker processes on PostgreSQL; the SQLite case stays fast
def test_workers_on_postgresql_store_what_one_process_stores(tmp_path):
    """The unchanged-lookup reads through its own connection while the batch's transaction
    is open: on PostgreSQL as on SQLite, nothing changes but who parses."""
    from pg import fresh_database

    root = _inputs(tmp_path / "t")
    contents = {}
    for jobs in (1, 2):
        with fresh_database("parallel") as url, Store.open(url) as store:
            first = ingest(store, [root], jobs=jobs)
            again = ingest(store, [root], jobs=jobs)
            contents[jobs] = (first.as_dict(), again.unchanged, _contents(store))
    assert contents[1] == contents[2]
    assert contents[2][1] == contents[2][0]["new"]


def test_sources_stored_unchanged_are_not_parsed_ahead(tmp_path):
    root = tmp_path / "t"
    write_standard_episodes(root, 2 * parallel.CHUNK)

    def loads(stored) -> list:
        """Each source's load, and what it returns, taken while the workers run."""
        items = parallel.parse_ahead(iter_sources([root], ConvertOptions()), jobs=2, stored=stored)
        try:
            return [(item.load, item.load()) for item in items if isinstance(item, Source)]
        finally:
            items.close()

    ahead = loads(lambda chunk: set())
    assert len(ahead) == 2 * parallel.CHUNK and all(isinstance(f, parallel._ParsedAhead) for f, _ in ahead)
    nothing = loads(lambda chunk: {(s.key, s.content_hash) for s in chunk})
    assert not any(isinstance(f, parallel._ParsedAhead) for f, _ in nothing)
    assert [p.messages for _, p in ahead] == [p.messages for _, p in nothing]


def test_a_second_ingest_of_unchanged_episodes_starts_no_workers(tmp_path):
    root = tmp_path / "t"
    write_standard_episodes(root, 2 * parallel.CHUNK)
    with Store.open(str(tmp_path / "s.db")) as store:
        assert ingest(store, [root], jobs=2).new == 2 * parallel.CHUNK
        started = []
        real_start = parallel._start
        parallel._start = lambda jobs: started.append(jobs) or real_start(jobs)
        try:
            again = ingest(store, [root], jobs=2)
        finally:
            parallel._start = real_start
    assert (again.unchanged, again.new, started) == (2 * parallel.CHUNK, 0, [])


def test_a_killed_worker_costs_a_parse_not_an_episode(tmp_path):
    (d,) = write_standard_episodes(tmp_path / "t", 1)
    (source,) = list(iter_sources([d], ConvertOptions()))
    assert isinstance(source, Source)
    pool = ProcessPoolExecutor(max_workers=1)
    try:
        pool.submit(os._exit, 1)  # the worker dies: every future of the pool breaks
        future = pool.submit(source.load)
        parsed = parallel._ParsedAhead(future, source.load)()  # parsed here instead
    finally:
        pool.shutdown(wait=True)
    assert parsed.messages == source.load().messages and parsed.content_hash == source.content_hash


def test_a_small_ingest_neither_looks_up_nor_starts_workers(tmp_path):
    root = tmp_path / "t"
    write_standard_episodes(root, parallel.MIN_PARALLEL - 1)
    lookups: list[int] = []
    items = parallel.parse_ahead(
        iter_sources([root], ConvertOptions()), jobs=2, stored=lambda chunk: lookups.append(len(chunk)) or set()
    )
    try:
        loads = [item.load for item in items if isinstance(item, Source)]
    finally:
        items.close()
    assert len(loads) == parallel.MIN_PARALLEL - 1 and lookups == []
    assert not any(isinstance(f, parallel._ParsedAhead) for f in loads)
