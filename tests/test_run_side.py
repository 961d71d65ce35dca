"""The run side of a trainer's read (credits/run_side.py): in one read, what the exports and
``Handoff`` know about a credit run, the same as the separate lookups it replaced."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from sqlalchemy import text
from test_tokenized import scored_with

from hcapo_store.credits.lookup import get_run
from hcapo_store.credits.run_side import read_run_side, with_tokenizer
from hcapo_store.credits.weights import run_weights
from hcapo_store.errors import CreditError, ExportError, HandoffError
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


def test_one_read_gives_what_the_separate_lookups_gave(store: Store, samples: Path, demo_tokenizer_dir: Path) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    side = read_run_side(store, "r", credited=True, top_k=True, tokenizer=True, tokenizer_dir=demo_tokenizer_dir)
    run = get_run(store, "r")
    assert side.run == run and side.replaced is None
    with db.read(store.engine) as conn:
        rw = run_weights(conn, run, [])
        names = conn.execute(
            text(
                "SELECT DISTINCT e.name FROM credits c JOIN steps s ON s.id = c.step_id "
                "JOIN episodes e ON e.id = s.episode_id WHERE c.run_id = :r"
            ),
            {"r": run.id},
        ).scalars()
        assert sorted(e.name for e in side.credited) == sorted(names)
    assert [e["id"] for e in side.weights.episodes] == [e["id"] for e in rw.episodes]
    assert all((a == b).all() for a, b in zip(side.weights.weights, rw.weights))
    assert side.has_topk is False  # the scorer stored no top-k
    assert side.fingerprint is not None and side.fingerprint["files_sha256"] == side.tokenizer_record[0]["files_sha256"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        side.replaced = "x"  # type: ignore[misc]
    # a second run side of the same scorer takes the tokenizer already loaded and checked
    again = with_tokenizer(read_run_side(store, "r"), demo_tokenizer_dir, like=side)
    assert again.tokenizer is side.tokenizer
    # without tokenizer=True nothing is loaded; the weight options are run_weights'
    plain = read_run_side(store, None, omega=0.5)
    assert plain.tokenizer is None and plain.weights.omega == 0.5 and plain.credited == ()


def test_what_the_read_refuses_it_names(store: Store, samples: Path, demo_tokenizer_dir: Path) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    with pytest.raises(CreditError, match=r"^no credit run named 'nope' \(runs: r\)"):
        read_run_side(store, "nope")
    with pytest.raises(HandoffError, match=r"^no batch 7 in this store"):
        read_run_side(store, 7)
    with db.write(store.engine) as conn:  # a batch whose every member failed: no credit run
        conn.execute(
            text(
                "INSERT INTO batches (id, key, batch_hash, status, episodes, steps, scored, failed, scorer_id, "
                "complete_at, ready_at) VALUES (7, 'g', 'h', 'failed', 1, 1, 0, 1, 'sc', 't', 't')"
            )
        )
    with pytest.raises(HandoffError, match=r"^batch 7 \(g\) has no credit run \(failed\): no member could be credited"):
        read_run_side(store, 7)
    with pytest.raises(ExportError, match="this needs the tokenizer scorer sc"):
        # no tokenizer given and none recorded where the store could find it again
        read_run_side(store, "r", tokenizer=True)
