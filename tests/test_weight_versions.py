"""Policy versions (issue 17): every score comes from a named weight version that is part of
its scorer, so a credit run never mixes two; the policy being trained scores in process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import ScoringError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.live import score_live
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.storage.store import Store


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


@pytest.fixture
def episodes(tmp_path: Path) -> Path:
    write_standard_episodes(tmp_path / "eps", 2, steps_per_subtask=1, output_words=6)
    return tmp_path / "eps"


def _cfg(ref: ReferenceServer, tiny: Path, **kw) -> ScoreConfig:
    return ScoreConfig(backend="sglang", server=ref.url, tokenizer=str(tiny), max_context=2048, **kw)


def test_the_served_version_is_part_of_the_scorer(store: Store, episodes: Path, ref, tiny_model_dir: Path) -> None:
    ingest(store, [episodes])
    plain = prepare(store, _cfg(ref, tiny_model_dir))
    assert "weight_version" not in plain.spec  # "default": scorers from before keep their ids
    ref.weight_version = "step-7"
    try:
        versioned = prepare(store, _cfg(ref, tiny_model_dir))
        assert versioned.spec["weight_version"] == "step-7" and versioned.scorer_id != plain.scorer_id
        assert run_scoring(store, versioned, RunOptions(concurrency=2)).failed == 0
        assert scorer_spec(store, versioned.scorer_id)["weight_version"] == "step-7"
        label = store.query("SELECT label FROM scorers", read_only=True)[1][0][0]
        assert label.endswith("wv=step-7")
        # asking for another version than the server's is refused before anything is sent
        seen = ref.sequences_seen
        with pytest.raises(ScoringError, match=r"--weight-version step-8 .* \(weight version 'step-7'\)"):
            prepare(store, _cfg(ref, tiny_model_dir, weight_version="step-8"))
        assert ref.sequences_seen == seen
    finally:
        ref.weight_version = "default"
    # a server without versions: the caller's name is the version
    named = prepare(store, _cfg(ref, tiny_model_dir, weight_version="step-8"))
    assert named.spec["weight_version"] == "step-8"


def test_cli_weight_version(store: Store, db_path: Path, episodes: Path, ref, tiny_model_dir: Path) -> None:
    ingest(store, [episodes])
    base = ["--db", str(db_path), "score", "--server", ref.url, "--tokenizer", str(tiny_model_dir)]
    base += ["--max-context", "2048"]
    r = CliRunner().invoke(cli, [*base, "--weight-version", "3"])
    assert r.exit_code == 0, r.output
    ref.weight_version = "4"
    try:
        r = CliRunner().invoke(cli, [*base, "--weight-version", "3"])
    finally:
        ref.weight_version = "default"
    assert r.exit_code == 1 and "--weight-version 3" in r.output and "'4'" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["--db", str(db_path), "scorers", "list", "--json"])
    assert [s["spec"]["weight_version"] for s in json.loads(r.output)] == ["3"]


def _live(tiny: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)


def test_the_policy_scores_itself_in_process(store: Store, episodes: Path, tiny_model_dir: Path) -> None:
    ingest(store, [episodes])
    # the reference: the same weights from disk, through the in-process backend
    disk = prepare(store, ScoreConfig(backend="transformers", model=str(tiny_model_dir), max_context=2048))
    assert run_scoring(store, disk, RunOptions(concurrency=1)).failed == 0
    model = _live(tiny_model_dir)
    model.train()  # as a trainer holds it: dropout on
    first = score_live(store, model, tokenizer=str(tiny_model_dir), weight_version="1", max_context=2048)
    assert first.report.failed == 0 and first.report.scored > 0 and model.training  # its mode given back
    assert scorer_spec(store, first.scorer_id)["weight_version"] == "1" and first.label.endswith("wv=1")

    def scores(scorer: str) -> list:
        return store.query(
            "SELECT step_id, token_logprobs FROM scores WHERE scorer_id = :s ORDER BY step_id",
            {"s": scorer},
            read_only=True,
        )[1]

    assert scores(first.scorer_id) == scores(disk.scorer_id)  # bit for bit: eval mode, same weights
    # a policy-gradient step later: a new version, a new scorer, never mixed with the first
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1.5)
    second = score_live(store, model, tokenizer=str(tiny_model_dir), weight_version="2", max_context=2048)
    assert second.scorer_id != first.scorer_id and second.report.scored == first.report.scored
    assert scores(second.scorer_id) != scores(first.scorer_id)
    runs = [
        compute_credits(store, scorer=s, name=f"v{v}").run for v, s in (("1", first.scorer_id), ("2", second.scorer_id))
    ]
    assert [r.scorer_id for r in runs] == [first.scorer_id, second.scorer_id]
    # the same version again resumes: nothing left to score
    again = score_live(store, model, tokenizer=str(tiny_model_dir), weight_version="2", max_context=2048)
    assert again.scorer_id == second.scorer_id and again.report.scored == 0


def test_a_batch_only(store: Store, episodes: Path, tiny_model_dir: Path) -> None:
    ingest(store, [episodes])
    names = [r[0] for r in store.query("SELECT name FROM episodes ORDER BY name", read_only=True)[1]]
    model = _live(tiny_model_dir)
    out = score_live(
        store, model, tokenizer=str(tiny_model_dir), weight_version="1", episodes=names[:1], max_context=2048
    )
    per_episode = store.query(
        "SELECT e.name, count(sc.id) FROM episodes e JOIN steps s ON s.episode_id = e.id "
        "LEFT JOIN scores sc ON sc.step_id = s.id GROUP BY e.name ORDER BY e.name",
        read_only=True,
    )[1]
    assert out.report.failed == 0 and per_episode[0][1] > 0 and per_episode[1][1] == 0
    with pytest.raises(ValueError, match="episodes is empty"):
        score_live(store, model, tokenizer=str(tiny_model_dir), weight_version="1", episodes=[])
