"""One rule for a ``result.json``'s identity, in ``ingest`` as in ``follow`` (issue 41): its
parsed content (``ingestion.discovery.result_identity``). The same JSON saved again with other
whitespace or key order is the same version; a changed value is a new one; a store written
when the identity was the file's bytes keeps its versions. Real files, real SQLite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_follow_round4
from sqlalchemy import text
from test_follow_round4 import _follower

from hcapo_store.devkit.refserver import ReferenceServer
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.discovery import iter_sources, result_identity
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.ingestion.sources import ConvertOptions
from hcapo_store.online.scanning import result_state
from hcapo_store.storage.store import Store

ref = test_follow_round4.ref  # the fixture: a reference server over the tiny model, one per module


@pytest.fixture
def episode(tmp_path: Path) -> Path:
    (path,) = write_standard_episodes(
        tmp_path / "rollouts" / "step_0000", 1, seed=3, steps_per_subtask=1, output_words=5
    )
    return path


def _resave(result: Path, **changes: object) -> None:
    """The same document written again as another program would: keys reversed, indented,
    a BOM and CRLF line ends; ``changes`` change values."""
    data = json.loads(result.read_bytes().decode("utf-8-sig"))
    data.update(changes)
    text_ = json.dumps(dict(reversed(list(data.items()))), indent=3, ensure_ascii=False)
    result.write_bytes(b"\xef\xbb\xbf" + text_.replace("\n", "\r\n").encode())


def _versions(store: Store) -> list[tuple[int, bool, float]]:
    return [tuple(r) for r in store.query("SELECT version, is_current, reward FROM episodes ORDER BY version")[1]]


def test_ingest_takes_a_result_json_saved_again_as_the_same_version(tmp_path: Path, episode: Path) -> None:
    result = episode / "result.json"
    before = result.read_bytes()
    with Store.open(str(tmp_path / "s.db")) as store:
        assert ingest(store, [episode.parent], jobs=1).new == 1
        _resave(result)
        assert result.read_bytes() != before
        again = ingest(store, [episode.parent], jobs=1)
        assert (again.new, again.changed, again.unchanged) == (0, 0, 1)
        assert len(_versions(store)) == 1
        _resave(result, episode_reward=0.123)  # a changed value: a new version
        changed = ingest(store, [episode.parent], jobs=1)
        assert (changed.new, changed.changed) == (0, 1)
        assert _versions(store)[-1] == (2, True, 0.123)


def test_follow_and_ingest_share_the_rule(episode: Path) -> None:
    """follow's identity of a result.json is the hash of ingest's, for the same bytes."""
    import hashlib

    result = episode / "result.json"
    waiting, first = result_state(episode, None)
    assert waiting is None and first == hashlib.sha256(result_identity(result.read_bytes())).hexdigest()
    _resave(result)
    assert result_state(episode, None)[1] == first
    _resave(result, episode_reward=0.5)
    assert result_state(episode, None)[1] != first


def test_result_identity_is_the_parsed_content() -> None:
    assert result_identity(b'{"b": 1, "a": [1, 2]}') == result_identity(b'\xef\xbb\xbf{\r\n "a":[1,2],\r\n "b":1}\r\n')
    assert result_identity(b'{"a": 1}') != result_identity(b'{"a": 2}')
    assert result_identity(b'{"a": 1') == b'{"a": 1'  # no JSON: the bytes, as they are


def test_a_store_written_when_identity_was_the_bytes_keeps_its_versions(tmp_path: Path, episode: Path) -> None:
    """A version stored with the hash of the file's bytes (the earlier rule) is still the
    same version when the same files are ingested again, not a new one."""
    with Store.open(str(tmp_path / "s.db")) as store:
        assert ingest(store, [episode.parent], jobs=1).new == 1
        _resave(episode / "result.json")  # bytes unlike canonical JSON: the two hashes differ
        (source,) = iter_sources([episode.parent], ConvertOptions())
        assert not isinstance(source, Exception) and source.earlier_hash not in (None, source.content_hash)
        with store.engine.begin() as conn:  # as the earlier rule stored this file
            conn.execute(text("UPDATE episodes SET content_hash = :h"), {"h": source.earlier_hash})
        again = ingest(store, [episode.parent], jobs=1)
        assert (again.new, again.changed, again.unchanged) == (0, 0, 1)
        assert len(_versions(store)) == 1


def test_a_restarted_follower_keeps_the_batch_of_a_result_json_saved_again(
    tmp_path: Path, episode: Path, ref: ReferenceServer, tiny_model_dir: Path
) -> None:
    """A restarted follower has no memory of the file: it asks ingest, whose rule is the same
    (before: a new version, and the published batch superseded)."""
    root = episode.parents[1]
    with Store.open(str(tmp_path / "s.db")) as store:
        assert len(_follower(store, ref, tiny_model_dir, root, group_size=1).cycle().published) == 1
        _resave(episode / "result.json")
        report = _follower(store, ref, tiny_model_dir, root, group_size=1).cycle()
        assert report.ingest is not None and (report.ingest.changed, report.ingest.unchanged) == (0, 1)
        assert report.published == []
        assert store.query("SELECT status FROM batches", read_only=True)[1] == [("ready",)]
