"""The trainer's tokenizer, recognised by content: a ``save_pretrained`` copy of the scorer's
tokenizer (a checkpoint's) is accepted, a copy whose merges, added tokens or chat template differ
is refused naming what differs. Split from tests/test_token_fidelity.py (pytest-xdist runs a file
on one worker: the two halves run side by side)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _shared import SHARED
from _tokenizers import loaded_tokenizer
from sqlalchemy import text
from test_credits import add_scorer
from test_tokenized import scored_with

from hcapo_store.errors import ExportError
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.scoring.scorer import remember_tokenizer
from hcapo_store.scoring.tokenizer_lookup import scorer_tokenizer
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import Handoff

# ---- the trainer's tokenizer, recognised by content ------------------------------------------


def _qwen3_scorer(store: Store) -> tuple[Any, Path]:
    tok_dir = SHARED / "tokenizers" / "qwen3"
    if not tok_dir.is_dir():
        pytest.skip(f"the real tokenizer {tok_dir} is absent")
    tok = loaded_tokenizer(tok_dir)
    fingerprint = tokenizer_fingerprint(tok, tok_dir)
    add_scorer(store, "sc", spec={"tokenizer": fingerprint, "max_logprob_tokens": 2048})
    remember_tokenizer(store, fingerprint["files_sha256"], tok_dir)  # as `score --tokenizer` records it
    return tok, tok_dir


def test_a_save_pretrained_copy_is_the_scorers_tokenizer(store: Store, tmp_path: Path) -> None:
    tok, tok_dir = _qwen3_scorer(store)
    copy = tmp_path / "checkpoint-100"
    tok.save_pretrained(copy)
    assert tokenizer_fingerprint(load_tokenizer(copy), copy)["files_sha256"] != store_files_sha256(store)
    loaded, fingerprint = scorer_tokenizer(store, "sc", copy)
    assert fingerprint["chat_template_sha256"] == tokenizer_fingerprint(tok, tok_dir)["chat_template_sha256"]
    assert loaded.name_or_path == str(copy)


def store_files_sha256(store: Store) -> str:
    from hcapo_store.scoring.scorer import scorer_spec

    return scorer_spec(store, "sc")["tokenizer"]["files_sha256"]


def _changed_copy(tok: Any, out: Path, what: str) -> Path:
    tok.save_pretrained(out)
    if what == "merges":  # swap two merges: same vocabulary, other ids for some texts
        spec = json.loads((out / "tokenizer.json").read_text())
        merges = spec["model"]["merges"]
        merges[1000], merges[1001] = merges[1001], merges[1000]
        (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    elif what == "added tokens":
        changed = load_tokenizer(out)
        changed.add_tokens(["<|hcapo_test|>"], special_tokens=True)
        changed.save_pretrained(out)
    else:  # the chat template
        changed = load_tokenizer(out)
        changed.chat_template = changed.get_chat_template().replace(
            "<|im_start|>assistant\\n", "<|im_start|>assistant\\n\\n"
        )
        changed.save_pretrained(out)
    return out


@pytest.mark.parametrize("what", ["merges", "added tokens", "chat template"])
def test_a_copy_with_other_content_is_refused_naming_what_differs(store: Store, tmp_path: Path, what: str) -> None:
    tok, _ = _qwen3_scorer(store)
    copy = _changed_copy(tok, tmp_path / "changed", what)
    with pytest.raises(ExportError, match=f"its {what} differ"):
        scorer_tokenizer(store, "sc", copy)


def test_a_copy_is_refused_when_the_scorers_tokenizer_is_not_at_hand(store: Store, tmp_path: Path) -> None:
    tok, _ = _qwen3_scorer(store)
    tok.save_pretrained(tmp_path / "copy")
    with store.engine.begin() as conn:
        conn.execute(text("DELETE FROM tokenizer_locations"))
    with pytest.raises(ExportError, match="cannot be compared by content"):
        scorer_tokenizer(store, "sc", tmp_path / "copy")


def test_the_trainer_hands_off_with_its_checkpoints_copy(store: Store, tmp_path: Path) -> None:
    """Handoff with the tokenizer a trainer re-saved: accepted, and the same ids and advantages."""
    samples, tok_dir = SHARED / "samples" / "trajectories", SHARED / "tokenizers" / "qwen3"
    if not samples.is_dir() or not tok_dir.is_dir():
        pytest.skip("the shared samples or the Qwen3 tokenizer are absent")
    scored_with(store, samples, tok_dir)
    remember_tokenizer(store, store_files_sha256(store), tok_dir)  # as `score --tokenizer` records it
    original = Handoff(store, "r", tokenizer=tok_dir)
    loaded_tokenizer(tok_dir).save_pretrained(tmp_path / "checkpoint-1")
    copy = Handoff(store, "r", tokenizer=tmp_path / "checkpoint-1")
    (name,) = store.query("SELECT name FROM episodes ORDER BY id LIMIT 1")[1][0]
    ids = original.rendered_ids(name)
    assert copy.rendered_ids(name) == ids
    assert list(copy.advantages(name, ids).advantages) == list(original.advantages(name, ids).advantages)
