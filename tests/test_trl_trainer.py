"""The TRL hand-off: a plain SFTTrainer cannot take the tokenized export, WeightedSFTTrainer
trains on it with the advantages (its loss checked against a plain per-row computation), and
rows of another tokenizer are refused — with a real TRL, the tiny model and real tokenizers."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
from _examples import Completed, run_example
from _tokenizers import loaded_tokenizer

pytest.importorskip("trl")
import torch
from conftest import REPO, TOKENIZERS
from datasets import Dataset
from test_tokenized import scored_with
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import TrainingDataError
from hcapo_store.outputs.export import export_dataset
from hcapo_store.outputs.tokenized import TokenizedExport
from hcapo_store.storage.store import Store
from hcapo_store.training.data import check_tokenizer, read_rows
from hcapo_store.training.trl_sft import WeightedSFTTrainer, load_tokenized_export


def _config(tmp_path: Path, **kw) -> SFTConfig:
    base = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=8,
        shuffle_dataset=False,
        max_length=32768,
        disable_tqdm=True,
    )
    return SFTConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def exports(
    tmp_path_factory: pytest.TempPathFactory, migrated_db_template: Path, tiny_model_dir: Path
) -> tuple[Path, Path, TokenizedExport]:
    """Six short synthetic episodes (~2k tokens each: CPU training stays quick), scored once for
    the module: run ``r`` (the default) exported from rewards >= 0, then the paper's signed run
    ``p`` exported whole. Tests only read the two files (and copy rows before changing them)."""
    tmp = tmp_path_factory.mktemp("trl-sft")
    write_standard_episodes(tmp / "episodes", 6, steps_per_subtask=1, output_words=5)
    shutil.copyfile(migrated_db_template, tmp / "store.db")
    with Store.open(str(tmp / "store.db")) as store:
        scored_with(store, tmp / "episodes", tiny_model_dir)
        out = tmp / "train.jsonl"
        summary = export_dataset(store, out, "r", min_reward=0.0, layout="tokenized", tokenizer=tiny_model_dir)
        assert summary.weighted_tokens > 0
        compute_credits(store, CreditParams(variant="paper"), name="p")
        paper = tmp / "paper.jsonl"
        paper_summary = export_dataset(store, paper, "p", layout="tokenized", tokenizer=tiny_model_dir)
        assert isinstance(paper_summary, TokenizedExport)
    return out, paper, paper_summary


@pytest.fixture
def exported(exports: tuple[Path, Path, TokenizedExport]) -> Path:
    return exports[0]


def test_a_plain_sft_trainer_cannot_take_the_export(exported: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = read_rows(exported)
    assert "input_ids" not in rows[0] and {"token_ids", "labels", "advantages"} <= set(rows[0])
    with pytest.raises(Exception) as info:  # TRL's own error: no text, messages or input_ids column
        SFTTrainer(model=str(tiny_model_dir), args=_config(tmp_path), train_dataset=Dataset.from_list(rows))
    assert "text" in str(info.value) or "input_ids" in str(info.value)
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def _independent_loss(model, rows: list[dict], normalize: str) -> float:
    """Each row alone (no padding), float64 log-softmax, a Python loop over tokens."""
    total, count, weight = 0.0, 0, 0.0
    with torch.no_grad():
        for row in rows:
            ids = row["token_ids"]
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            for t in range(1, len(ids)):
                if row["labels"][t] != -100:
                    total += row["advantages"][t] * -float(logp[t - 1, row["labels"][t]])
                    count += 1
                    weight += row["advantages"][t]
    return total / max(count if normalize == "tokens" else weight, 1.0)


@pytest.mark.parametrize("normalize", ["tokens", "weights"])
def test_the_loss_is_the_advantage_weighted_nll(
    exported: Path, tiny_model_dir: Path, tmp_path: Path, normalize: str
) -> None:
    trainer = WeightedSFTTrainer(
        str(tiny_model_dir), args=_config(tmp_path), train_dataset=load_tokenized_export(exported), normalize=normalize
    )
    rows = read_rows(exported)[:8]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    assert batch["advantages"].shape == batch["input_ids"].shape
    model = trainer.model.eval()
    with torch.no_grad():
        got = float(trainer.compute_loss(model, {k: v.to(model.device) for k, v in batch.items()}))
    want = _independent_loss(model, rows, normalize)
    assert got == pytest.approx(want, rel=1e-4)
    assert want != pytest.approx(_independent_loss(model, rows, "tokens" if normalize == "weights" else "weights"))


@pytest.mark.slow  # trains (docs/DEVELOPMENT.md: the slow tier)
def test_training_lowers_the_weighted_loss(exported: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    ds = load_tokenized_export(exported)
    # two logged losses: the first before any update, the second after one; a lower second is the claim
    config = _config(tmp_path, max_steps=2, learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1)
    config.per_device_train_batch_size = len(ds)
    trainer = WeightedSFTTrainer(str(tiny_model_dir), args=config, train_dataset=ds)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_rows_of_another_tokenizer_are_refused(exported: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = read_rows(exported)
    rows[1]["provenance"]["tokenizer_files_sha256"] = "0" * 64
    with pytest.raises(TrainingDataError, match="2 different tokenizers"):
        WeightedSFTTrainer(str(tiny_model_dir), args=_config(tmp_path), train_dataset=Dataset.from_list(rows))
    for row in rows:
        row["provenance"]["tokenizer_files_sha256"] = "0" * 64
        row["provenance"]["tokenizer_content_sha256"] = "0" * 64  # another tokenizer: other content too
    with pytest.raises(TrainingDataError, match="tokenizer_files_sha256 differs"):
        WeightedSFTTrainer(str(tiny_model_dir), args=_config(tmp_path), train_dataset=Dataset.from_list(rows))
    # rows written by an older version (input_ids) say what to do
    old = [{("input_ids" if k == "token_ids" else k): v for k, v in r.items()} for r in read_rows(exported)]
    with pytest.raises(TrainingDataError, match="re-export"):
        WeightedSFTTrainer(str(tiny_model_dir), args=_config(tmp_path), train_dataset=Dataset.from_list(old))


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5"])
def test_a_real_tokenizer_is_not_the_rows_tokenizer(exported: Path, family: str) -> None:
    directory = TOKENIZERS / family
    if not directory.is_dir():
        pytest.skip(f"{directory} is not here (../shared absent)")
    with pytest.raises(TrainingDataError, match="not the one in"):
        # loaded once per test process (tests/_tokenizers.py): the same load_tokenizer(directory)
        check_tokenizer(read_rows(exported), loaded_tokenizer(directory), directory)


def test_a_re_saved_tokenizer_is_the_rows_tokenizer(exported: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Trainers save the tokenizer into every checkpoint: other bytes, the same content. It is
    recognised by content; a copy with one more added token is not, and the refusal names it."""
    rows = read_rows(exported)
    copy = tmp_path / "checkpoint-10"
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(copy))
    resaved = AutoTokenizer.from_pretrained(str(copy))
    check_tokenizer(rows, resaved, copy)  # accepted
    other = tmp_path / "other"
    changed = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    changed.add_tokens(["<hcapo_extra>"], special_tokens=True)
    changed.save_pretrained(str(other))
    with pytest.raises(TrainingDataError, match="differs, and so does its content"):
        check_tokenizer(rows, AutoTokenizer.from_pretrained(str(other)), other)


def test_cutting_to_max_length_keeps_advantages_on_their_tokens(
    exported: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows = read_rows(exported)
    longest = max(rows, key=lambda r: len(r["token_ids"]))
    cut = len(longest["token_ids"]) - 5
    last_label = max(i for i, x in enumerate(longest["labels"]) if x != -100)
    assert last_label >= cut  # the cut removes trained tokens of this row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = WeightedSFTTrainer(
            str(tiny_model_dir), args=_config(tmp_path, max_length=cut), train_dataset=Dataset.from_list(rows)
        )
    assert trainer.truncated_tokens > 0
    assert any("cut" in str(w.message) and "trained tokens" in str(w.message) for w in caught)
    for prepared in trainer.train_dataset:
        source = next(r for r in rows if r["token_ids"][: len(prepared["input_ids"])] == prepared["input_ids"])
        n = len(prepared["input_ids"])
        assert n <= cut
        assert prepared["labels"] == source["labels"][:n]
        assert prepared["advantages"] == pytest.approx(source["advantages"][:n])


def test_signed_advantages_of_the_paper_variant(
    exports: tuple[Path, Path, TokenizedExport], tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = exports[1]
    rows = read_rows(out)
    assert any(a < 0 for r in rows for a in r["advantages"])
    negative = sum(1 for r in rows for w in r["step_advantages"] if w < 0)
    with pytest.raises(TrainingDataError, match=f"^{negative} step\\(s\\) have a negative advantage.*signed=True"):
        WeightedSFTTrainer(str(tiny_model_dir), args=_config(tmp_path), train_dataset=load_tokenized_export(out))
    trainer = WeightedSFTTrainer(
        str(tiny_model_dir), args=_config(tmp_path), train_dataset=load_tokenized_export(out), signed=True
    )
    assert trainer.negative_steps == negative > 0
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(min(8, len(rows)))])
    model = trainer.model.eval()
    with torch.no_grad():
        got = float(trainer.compute_loss(model, batch))
    assert got == pytest.approx(_independent_loss(model, rows[:8], "tokens"), rel=1e-4)
    weights = WeightedSFTTrainer(
        str(tiny_model_dir),
        args=_config(tmp_path),
        train_dataset=load_tokenized_export(out),
        normalize="weights",
        signed=True,
    )
    with pytest.raises(ValueError, match="non-negative"):
        weights.compute_loss(model, batch)


@pytest.mark.slow  # trains (docs/DEVELOPMENT.md: the slow tier)
def test_the_example_takes_signed_advantages_only_when_asked(
    exports: tuple[Path, Path, TokenizedExport], tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paper run's signed advantages: refused in one line without --signed; with it, the example
    says how many steps get unlikelihood; a --max-length that keeps no trained token is one line."""
    _, data, summary = exports
    rows = read_rows(data)[:4]
    negative = sum(1 for r in rows for w in r["step_advantages"] if w < 0)
    assert negative > 0 and summary.step_signs["negative"] > 0
    assert sum(summary.step_signs.values()) == summary.aligned_steps
    assert summary.weighted_steps == summary.step_signs["positive"] + summary.step_signs["negative"]

    def example(*extra: str) -> Completed:  # the example's status and output, run in this process
        script = REPO / "examples" / "train_weighted.py"
        return run_example(
            script, str(data), "--model", str(tiny_model_dir), "--steps", "1", *extra, monkeypatch=monkeypatch
        )

    refused = example()
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"{negative} step(s) have a negative advantage" in refused.stderr and "--signed" in refused.stderr
    assert _lines(refused.stderr) == [refused.stderr.strip().splitlines()[-1]]
    signed = example("--signed", "--max-length", "32768", "--json")
    assert signed.returncode == 0, signed.stderr[-2000:]
    assert f"unlikelihood on {negative} steps" in signed.stderr
    short_cut = example("--signed", "--max-length", "4")
    assert short_cut.returncode != 0 and "Traceback" not in short_cut.stderr
    assert _lines(short_cut.stderr) == [f"{data}: no row keeps a trained token within --max-length 4"]


def _lines(stderr: str) -> list[str]:
    """stderr without the Python warnings of other libraries (transformers' deprecations)."""
    lines = stderr.strip().splitlines()
    return [x for i, x in enumerate(lines) if "Warning:" not in x and not (i and "Warning:" in lines[i - 1])]


def test_the_example_refuses_rows_of_another_tokenizer(
    exported: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = read_rows(exported)
    for row in rows:
        row["provenance"]["chat_template_sha256"] = "f" * 64
        row["provenance"]["tokenizer_content_sha256"] = "f" * 64  # another tokenizer: other content too
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_example(
        REPO / "examples" / "train_weighted.py", str(other), "--model", str(tiny_model_dir), monkeypatch=monkeypatch
    )
    assert out.returncode != 0
    assert "chat_template_sha256 differs" in out.stderr and "Traceback" not in out.stderr


def test_the_model_must_match_its_vocabulary(exported: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model.resize_token_embeddings(8)  # a model of another vocabulary with this tokenizer's files
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        WeightedSFTTrainer(
            model,
            args=_config(tmp_path),
            train_dataset=load_tokenized_export(exported),
            processing_class=tok,
            tokenizer_dir=tiny_model_dir,
        )


def test_the_loader_does_not_shadow_datasets_load_dataset() -> None:
    import hcapo_store.training.trl_sft as trl_sft

    assert not hasattr(trl_sft, "load_dataset") and "load_dataset" not in trl_sft.__all__
