"""``verify.Checks``: what a builder's run-time checks are (issue 40's budget is measured by
switching them, in one process: bench/verify_cost.py). ``UNCHECKED`` really skips every
builder-level check (so the bench's "off" side is what it says), ``CHECKED`` (every builder's
default) catches the same planted fault, and the bench runs at a small size."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from _bench import BENCH as BENCH_DIR
from _shared import SHARED
from _tokenizers import episode, real_tokenizer
from test_verify import _always_the_shortest

from hcapo_store.rendering import verify
from hcapo_store.rendering.ascii_bpe import AsciiBpe, AsciiEncoding
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.turn_windows import TurnWindows

BENCH = BENCH_DIR / "verify_cost.py"


@pytest.fixture
def fresh_policy(monkeypatch):
    monkeypatch.setattr(verify, "_uses", {})


def test_unchecked_counts_no_use_and_checked_is_every_builders_default() -> None:
    assert PromptBuilder(real_tokenizer("qwen3")).checks is verify.CHECKED
    uses = itertools.count(verify.PLACEMENT.every - 1)  # the next use is a sampled one
    verify._uses["placement"] = uses
    try:
        assert not verify.UNCHECKED.due(verify.PLACEMENT)
        assert verify.CHECKED.due(verify.PLACEMENT)  # still the sampled one: UNCHECKED took no use
    finally:
        del verify._uses["placement"]


def test_a_planted_fault_is_caught_checked_and_passes_unchecked(fresh_policy, monkeypatch) -> None:
    tok = real_tokenizer("qwen2.5")
    messages, outcome, steps = episode(5, steps=14, tool_chars=200)
    checked = PromptBuilder(tok, max_context=900, truncation="turns")
    unchecked = PromptBuilder(tok, max_context=900, truncation="turns", checks=verify.UNCHECKED)
    rule = [checked.build_step_reference(messages, outcome, step) for step in steps]
    monkeypatch.setattr(TurnWindows, "_earliest_fit", _always_the_shortest)
    before = verify.fallbacks().get("turn_windows", 0)
    assert unchecked.build_episode(messages, outcome, steps) != rule  # on trust: the fault is stored
    assert verify.fallbacks().get("turn_windows", 0) == before
    assert checked.build_episode(messages, outcome, steps) == rule
    assert verify.fallbacks()["turn_windows"] == before + 1


def test_unchecked_ascii_pieces_are_not_encoded_again(fresh_policy, monkeypatch) -> None:
    tok = real_tokenizer("qwen3")
    text = "<|im_start|>user\nplain ascii text, checked<|im_end|>\n"
    original = AsciiBpe.encode

    def wrong(self, piece):
        enc = original(self, piece)
        return None if enc is None else AsciiEncoding(enc.ids[::-1], piece, self)

    monkeypatch.setattr(AsciiBpe, "encode", wrong)
    unchecked = PromptBuilder(tok, checks=verify.UNCHECKED).encoder
    before = verify.fallbacks().get("ascii_bpe", 0)
    assert unchecked.encode_once(text) != tok.encode(text, add_special_tokens=False)
    assert verify.fallbacks().get("ascii_bpe", 0) == before


@pytest.mark.slow
def test_the_bench_runs_small() -> None:
    if not (SHARED / "tokenizers" / "qwen3").is_dir():
        pytest.skip(f"{SHARED / 'tokenizers' / 'qwen3'} is not here (../shared absent)")
    r = subprocess.run(
        [sys.executable, str(BENCH), "--episodes", "1", "--rounds", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["input"] == "budget: 1 episodes, 99 steps" and out["fallbacks"] == {}
    assert set(out["cpu_ms_per_step_median"]) == {"on", "off"} and out["rounds_each_way"] == 2


@pytest.mark.parametrize("name", sorted(verify.STRATEGIES))
def test_a_batch_samples_the_uses_one_by_one_would(name: str, fresh_policy) -> None:
    """``sampled(strategy, n)`` (one call for a batch of pieces) checks the very uses that n
    calls of ``due`` would, wherever the process's count stands."""
    strategy = verify.Strategy(name, "rule", "policy", "process", first=5, every=7)
    for batches in ([1, 3, 9, 2, 30, 1, 14], [40], [0, 6, 6, 6, 25]):
        verify._uses.clear()
        one_by_one = [verify.due(strategy) for _ in range(sum(batches))]
        verify._uses.clear()
        got, at = [], 0
        for n in batches:
            got += [at + k for k in verify.sampled(strategy, n)]
            at += n
        assert got == [i for i, d in enumerate(one_by_one) if d], batches
    assert verify.UNCHECKED.sampled(strategy, 50) == []
