"""Issue 40 item 5: ``tokenizers``' version (and the transformers tokenizer class) is part of the
tokenizer fingerprint the scorer id is built from, so an upgrade starts a new scorer; the scorers
of a store written before keep their rows and ids, and new scoring goes to the new id."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import tokenizers
from test_log_ratio import _episodes

from hcapo_store.cli import cli
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.scoring.scorer import register, scorer_id, scorer_label
from hcapo_store.storage.store import Store


def test_the_fingerprint_names_the_tokenizers_release_and_class(demo_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(demo_tokenizer_dir)
    fp = tokenizer_fingerprint(tok, demo_tokenizer_dir)
    assert fp["tokenizers_version"] == tokenizers.__version__
    assert fp["class"] == type(tok).__name__


def test_an_upgrade_is_a_new_scorer_and_a_store_from_before_still_opens(
    tiny_model_dir: Path, tmp_path: Path, runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = str(tmp_path / "s.db")
    store = Store.open(db)
    assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=1)]).failed == 0
    cfg = ScoreConfig(backend="transformers", model=str(tiny_model_dir))
    now = prepare(store, cfg)
    assert now.spec["tokenizer"]["tokenizers_version"] == tokenizers.__version__
    assert f"tokenizers={tokenizers.__version__}" in scorer_label(now.spec)
    # the scorer as the previous release registered it: the same spec, its fingerprint without the two
    before = copy.deepcopy(now.spec)
    del before["tokenizer"]["tokenizers_version"], before["tokenizer"]["class"]
    old_id = register(store, before)
    assert old_id == scorer_id(before) != now.scorer_id
    store.close()

    argv = ["--db", db, "score", "--backend", "transformers", "--model", str(tiny_model_dir), "--json"]
    r = runner.invoke(cli, argv)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["scored"] == 3
    r = runner.invoke(cli, ["--db", db, "scorers", "list", "--json"])
    assert r.exit_code == 0, r.output
    listed = {row["scorer_id"]: row for row in json.loads(r.output)}
    assert set(listed) == {old_id, now.scorer_id}  # the old row stays; new scores went to the new id
    assert listed[now.scorer_id]["scored"] == 3 and listed[old_id]["scored"] == 0

    # another tokenizers release renders the probe to the same ids here, and is still another scorer
    monkeypatch.setattr(tokenizers, "__version__", "999.0.0")
    with Store.open(db) as store:
        upgraded = prepare(store, cfg)
    assert upgraded.spec["rendering_sha256"] == now.spec["rendering_sha256"]
    assert upgraded.scorer_id not in (now.scorer_id, old_id)
    assert "tokenizers=999.0.0" in scorer_label(upgraded.spec)
