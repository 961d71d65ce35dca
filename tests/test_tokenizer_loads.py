"""Tokenizer loads per TRL step (issue 43 item 4): ``StoreAdvantages`` loads its tokenizer once
and hands that object to each step's ``score_live`` and ``Handoff`` (``loaded_tokenizer=``),
loading it again only when the directory's tokenizer files change. Counted on the real
``AutoTokenizer.from_pretrained`` with the tiny demo model on the CPU; the advantages, scorer
ids and stored scores are those of the path APIs, which load the tokenizer each time (as every
step did before)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("trl")

from _rollout_batches import SIGNS, sign_batch

from hcapo_store.credits.compute import compute_credits
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.tokenizers import KeptTokenizer, load_tokenizer
from hcapo_store.scoring.live import score_live
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import Handoff
from hcapo_store.training.trl_grpo import GROUP_TAG, HandoffAdvantages, RolloutBatch, StoreAdvantages


def _batch(tok: Any, model: Any, step: int) -> RolloutBatch:
    return sign_batch(tok, model, step=step, prompt_text=f"Write some signs ({step}).")


def _count_loads(mp: pytest.MonkeyPatch) -> list[str]:
    """Every ``AutoTokenizer.from_pretrained`` from now on (the real one, counted)."""
    from transformers import AutoTokenizer

    calls: list[str] = []
    real = AutoTokenizer.from_pretrained.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, name: Any, *a: Any, **kw: Any) -> Any:
        calls.append(str(name))
        return real(cls, name, *a, **kw)

    mp.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    return calls


def _scores(store: Store, scorer: str) -> dict[tuple[str, int], bytes]:
    rows = store.query(
        "SELECT e.name, s.step_index, c.token_logprobs FROM scores c JOIN steps s ON s.id = c.step_id "
        "JOIN episodes e ON e.id = s.episode_id WHERE c.scorer_id = :s",
        {"s": scorer},
    )[1]
    return {(str(n), int(i)): bytes(b) for n, i, b in rows}


def _touch(path: Path) -> None:
    """A file rewritten with the same bytes: a new mtime, nothing else."""
    st = path.stat()
    path.write_bytes(path.read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).float().eval()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """This module's own copy of the demo tokenizer (the tests rewrite its files)."""
    return Path(shutil.copytree(demo_tokenizer_dir, tmp_path_factory.mktemp("tok") / "demo"))


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory, model: Any, tok_dir: Path) -> Iterator[dict[str, Any]]:
    """Three batches through one ``StoreAdvantages`` (store A; before the third, the tokenizer's
    config is rewritten with the same bytes), and each batch again through the path APIs as
    ``StoreAdvantages`` called them before (store B: ingest, ``score_live(tokenizer=DIR)``,
    ``compute_credits``, ``Handoff(tokenizer=DIR)``), with the loads each made."""
    work = tmp_path_factory.mktemp("loads")
    tok = load_tokenizer(tok_dir)
    out: dict[str, Any] = {"loads": [], "values": [], "ref_loads": [], "ref_values": [], "scorers": [], "scores": []}
    with pytest.MonkeyPatch.context() as mp, Store.open(str(work / "a.db")) as a, Store.open(str(work / "b.db")) as b:
        loads = _count_loads(mp)
        source = StoreAdvantages(a, tokenizer=tok_dir, workdir=work / "rollouts", run_id="k")
        for step in (0, 1, 2):
            if step == 2:
                _touch(tok_dir / "tokenizer_config.json")
            batch = _batch(tok, model, step)
            before = len(loads)
            out["values"].append([np.asarray(v) for v in source(batch)])
            out["loads"].append(len(loads) - before)

            before = len(loads)
            folder = work / "rollouts" / "k" / f"step_{step:06d}"
            (path,) = sorted(folder.glob("*.jsonl"))  # one GRPO group
            ingest(b, [path], tags={GROUP_TAG: f"step-{step}/g0"}, jobs=1)
            names = [n for n in source.episodes[step] if n is not None]
            found = b.query("SELECT id FROM episodes WHERE source_path = :p AND is_current", {"p": str(path.resolve())})
            ids = [int(i) for (i,) in found[1]]
            live = score_live(b, model, tokenizer=str(tok_dir), weight_version=f"k/step-{step}", episodes=names)
            run = compute_credits(b, source.params, scorer=live.scorer_id, episodes=ids)
            lookup = HandoffAdvantages(Handoff(b, run.run.name, tokenizer=tok_dir), source.episode_name)
            out["ref_values"].append([np.asarray(v) for v in lookup(batch)])
            out["ref_loads"].append(len(loads) - before)
            out["scorers"].append((source.scorers[step], live.scorer_id))
            out["scores"].append((_scores(a, source.scorers[step]), _scores(b, live.scorer_id)))
        out["kept_loads"] = source.kept_tokenizer.loads
        out["store_b"], out["run_b"] = b, run.run.name
        yield out


def test_one_load_for_the_first_step_none_after_and_one_when_the_files_change(steps: dict[str, Any]) -> None:
    # before: every step loaded it twice (score_live's prepare, the Handoff's check): the path APIs still do
    assert steps["ref_loads"] == [2, 2, 2]
    # now: once, none on the next step, once more after tokenizer_config.json was rewritten
    assert steps["loads"] == [1, 0, 1]
    assert steps["kept_loads"] == 2


def test_the_advantages_scorers_and_scores_are_the_path_apis(steps: dict[str, Any]) -> None:
    for step, (ours, theirs) in enumerate(zip(steps["values"], steps["ref_values"])):
        assert len(ours) == len(theirs) == len(SIGNS)
        assert any(np.any(v != 0) for v in ours), f"step {step}: no advantage to compare"
        for row, (x, y) in enumerate(zip(ours, theirs)):
            assert np.array_equal(x, y), f"step {step}, row {row}: {x} != {y}"
    for kept, loaded in steps["scorers"]:  # the same spec: tokenizer fingerprint included
        assert kept == loaded
    for step, (ours, theirs) in enumerate(steps["scores"]):
        assert ours and ours == theirs, f"step {step}: stored logprobs differ"


def test_log_ratio_scores_twice_and_hands_off_on_one_load(tmp_path: Path, model: Any, tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    with pytest.MonkeyPatch.context() as mp, Store.open(str(tmp_path / "s.db")) as store:
        loads = _count_loads(mp)
        source = StoreAdvantages(
            store, tokenizer=tok_dir, workdir=tmp_path / "r", run_id="lr", variant="log-ratio", against="no-hindsight"
        )
        counts = []
        for step in (0, 1):
            before = len(loads)
            values = source(_batch(tok, model, step))
            counts.append(len(loads) - before)
            assert any(np.any(np.asarray(v) != 0) for v in values)
        assert counts == [1, 0]  # teacher, student and hand-off share it
        assert source.students[1] != source.scorers[1]


def test_a_changed_tokenizer_file_is_read_again(tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    directory = Path(shutil.copytree(demo_tokenizer_dir, tmp_path / "tok"))
    kept = KeptTokenizer(directory)
    first = kept.get()
    assert kept.get() is first and kept.loads == 1
    config = directory / "tokenizer_config.json"
    data = json.loads(config.read_text())
    old = data["chat_template"]
    assert "text(" in old
    data["chat_template"] = old.replace("text(", "txet(")  # the macro renamed: another template, same length
    st = config.stat()
    config.write_text(json.dumps(data, ensure_ascii=False, indent=2))
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a clock coarser than the write
    second = kept.get()
    assert second is not first and kept.loads == 2
    assert second.chat_template == data["chat_template"] != first.chat_template
    (directory / "chat_template.jinja").write_text("{{ 'x' }}")  # a tokenizer file added
    assert kept.get() is not second and kept.loads == 3


def test_a_callers_changes_to_its_own_tokenizer_do_not_reach_a_kept_one(demo_tokenizer_dir: Path) -> None:
    kept = KeptTokenizer(demo_tokenizer_dir)
    mine = kept.get()
    size, template = len(mine), mine.chat_template
    theirs = load_tokenizer(demo_tokenizer_dir)  # no process-wide cache: each caller its own object
    assert theirs is not mine
    theirs.add_tokens(["<brand-new-token>"])
    theirs.chat_template = "{{ 'changed' }}"
    assert kept.get() is mine and len(mine) == size and mine.chat_template == template
    assert KeptTokenizer(demo_tokenizer_dir).get() is not mine  # another owner, another object


def test_a_tokenizer_from_another_directory_is_refused(
    tmp_path: Path, model: Any, tok_dir: Path, steps: dict[str, Any]
) -> None:
    """The scorer's fingerprint hashes the directory's files beside the object's template: an
    object loaded elsewhere would make a fingerprint of two tokenizers."""
    other = load_tokenizer(Path(shutil.copytree(tok_dir, tmp_path / "other")))
    refused = "pass the tokenizer loaded from that directory"
    with Store.open(str(tmp_path / "s.db")) as store:
        with pytest.raises(ValueError, match=refused):
            score_live(store, model, tokenizer=str(tok_dir), weight_version="w", loaded_tokenizer=other)
    with pytest.raises(ValueError, match=refused):
        Handoff(steps["store_b"], steps["run_b"], tokenizer=tok_dir, loaded_tokenizer=other)
