"""Two reads of a tokenizer that a trainer paid for at every step, now kept (issue 43 item 4):
the tokenizer's largest id (a 150k-entry vocabulary read per new ``PromptBuilder``) per tokenizer
object, and the sha256 of its files (``tokenizer_fingerprint``) while their sizes and mtimes
stay. Both give what a fresh read gives: after tokens are added, after a file changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hcapo_store.rendering import tokenizers as tokenizers_module
from hcapo_store.rendering.prompts import PromptBuilder, top_token_id
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint


def fresh_top(tok) -> int:
    return int(max(tok.get_vocab().values()))


def test_top_token_id_is_the_vocabulary_s_largest_id_and_follows_added_tokens(demo_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(demo_tokenizer_dir)
    assert top_token_id(tok) == fresh_top(tok) == PromptBuilder(tok).top_token_id
    before = top_token_id(tok)
    tok.add_tokens(["<kept-test-token>"])
    assert top_token_id(tok) == fresh_top(tok) == before + 1  # its length changed: read again
    assert PromptBuilder(tok).top_token_id == before + 1


def uncached(tok, directory: Path) -> dict:
    tokenizers_module._FILE_DIGESTS.clear()
    return tokenizer_fingerprint(tok, directory)


def test_fingerprint_kept_while_the_files_stay_and_new_when_one_changes(
    demo_tokenizer_dir: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "tok"
    shutil.copytree(demo_tokenizer_dir, directory)
    tok = load_tokenizer(directory)
    first = uncached(tok, directory)
    assert tokenizer_fingerprint(tok, directory) == first  # kept: the same answer
    assert tokenizer_fingerprint(tok, directory) == first
    config = directory / "tokenizer_config.json"
    assert config.is_file()
    stat = config.stat()
    config.write_text(config.read_text(encoding="utf-8") + " ", encoding="utf-8")  # same tokenizer, other bytes
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = tokenizer_fingerprint(tok, directory)
    assert changed["files_sha256"] != first["files_sha256"]
    assert changed == uncached(tok, directory)


@pytest.mark.parametrize("name", ["qwen3"])
def test_fingerprint_of_a_real_tokenizer_equals_a_fresh_one(name: str) -> None:
    from _shared import TOKENIZERS

    directory = TOKENIZERS / name
    if not directory.is_dir():
        pytest.skip(f"real tokenizer directory {directory} is absent")
    tok = load_tokenizer(directory)
    fresh = uncached(tok, directory)
    assert tokenizer_fingerprint(tok, directory) == fresh
    assert top_token_id(tok) == fresh_top(tok)
