"""Rows through the driver's executemany: the same stored values as SQLAlchemy's insert."""

from __future__ import annotations

import pytest
from sqlalchemy import insert, select

from hcapo_store.storage import db
from hcapo_store.storage.bulk import insert_rows
from hcapo_store.storage.models import Episode, Step
from hcapo_store.storage.store import Store

COLUMNS = ("episode_id", "step_index", "message_index", "phase", "subtask_id", "subtask_reward")


def _episode(conn) -> int:
    return conn.execute(
        insert(Episode).returning(Episode.id),
        {
            "source_key": "k",
            "source_path": "/p",
            "version": 1,
            "is_current": True,
            "content_hash": "h",
            "source_format": "openai_jsonl",
            "name": "e",
            "reward": 0.5,
            "frozen_scores": "{}",
            "reward_backfilled": False,
            "include_thinking": True,
            "max_tool_result_chars": 0,
            "num_messages": 3,
            "num_steps": 3,
            "raw_source": b"",
            "ingested_at": "2026-11-26T00:00:00",
        },
    ).scalar_one()


def _roundtrip(store: Store) -> None:
    with db.write(store.engine) as conn:
        eid = _episode(conn)
        rows = [
            (eid, 0, 1, "planning", None, 0.25),
            (eid, 1, 3, "executing", "S1 ✓ \"quoted\" 'x' %s ?", -1e-300),
            (eid, 2, 5, "executing", "", 0.0),
        ]
        insert_rows(conn, Step, COLUMNS, rows)
        insert_rows(conn, Step, COLUMNS, [])  # nothing to do
    with db.read(store.engine) as conn:
        stored = conn.execute(
            select(
                Step.episode_id, Step.step_index, Step.message_index, Step.phase, Step.subtask_id, Step.subtask_reward
            ).order_by(Step.step_index)
        ).all()
    assert [tuple(r) for r in stored] == rows


def test_rows_are_stored_as_given_on_sqlite(tmp_path):
    with Store.open(str(tmp_path / "b.db")) as store:
        _roundtrip(store)


def test_rows_are_stored_as_given_on_postgresql():
    from pg import fresh_database

    with fresh_database("bulk") as url, Store.open(url) as store:
        _roundtrip(store)


def test_an_unknown_column_is_refused_before_anything_is_sent(tmp_path):
    with Store.open(str(tmp_path / "b.db")) as store, db.write(store.engine) as conn:
        with pytest.raises(ValueError, match="steps has no column 'nope'"):
            insert_rows(conn, Step, ("episode_id", "nope"), [(1, 2)])
