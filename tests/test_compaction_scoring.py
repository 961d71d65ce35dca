"""Pi compaction (``ConvertOptions(compaction="context")``) beyond ingest: a ``ScoreConfig``
carrying it scores (compaction is ingest's option: a scorer selects episodes by the options
each episode records, and its identity is the same as without it), and ``follow
--compaction context`` ingests what the agent saw, as ``ingest --compaction context`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import EpisodeBuilder
from hcapo_store.ingestion.parsing import COMPACTION_SUMMARY
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.ingestion.sources import ConvertOptions
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store

CONTEXT = ConvertOptions(compaction="context")
SUMMARY_START = COMPACTION_SUMMARY.split("{", 1)[0]


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _compacted(directory: Path, seed: int = 5) -> Path:
    return (
        EpisodeBuilder(seed=seed)
        .standard(steps_per_subtask=1, output_words=5)
        .compaction()
        .bash_turn(1)
        .write(directory)
    )


def _summary_messages(store: Store) -> int:
    with store.engine.connect() as conn:
        return conn.execute(
            text("SELECT COUNT(*) FROM messages WHERE role = 'user' AND content LIKE :p"), {"p": SUMMARY_START + "%"}
        ).scalar_one()


def test_a_score_config_with_context_compaction_scores(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    with Store.open(str(tmp_path / "s.db")) as store:
        assert ingest(store, [_compacted(tmp_path / "episode_001")], options=CONTEXT).new == 1
        assert _summary_messages(store) == 1  # stored as the agent saw it
        cfg = ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048, conversion=CONTEXT)
        prep = prepare(store, cfg)
        plain = prepare(store, ScoreConfig(server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048))
        assert prep.scorer_id == plain.scorer_id  # the same stored messages, scored the same way
        report = run_scoring(store, prep, RunOptions(concurrency=1))
        steps = store.query("SELECT COUNT(*) FROM steps")[1][0][0]
        assert (report.scored, report.failed) == (steps, 0) and steps > 0


def test_follow_takes_compaction_as_ingest_does(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    root = tmp_path / "rollouts"
    _compacted(root / "step_0000" / "episode_001")
    db = tmp_path / "s.db"
    args = ["--db", str(db), "follow", str(root), "--group-size", "1", "--once", "--compaction", "context"]
    args += ["--server", ref.url, "--tokenizer", str(tiny_model_dir), "--max-context", "2048"]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    with Store.open(str(db)) as store:
        assert _summary_messages(store) == 1
        assert store.query("SELECT COUNT(*) FROM batches WHERE status = 'ready'")[1] == [(1,)]
        # ingest with the same option finds the episode unchanged: the same conversion
        assert ingest(store, [root / "step_0000"], options=CONTEXT).unchanged == 1
