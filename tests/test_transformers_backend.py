"""The in-process chunked scorer against a plain full forward pass, and the demo assets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _shared import TOKENIZERS
from transformers import AutoModelForCausalLM, AutoTokenizer

from hcapo_store.devkit.tiny_model import build_demo_tokenizer, build_tiny_model, ensure_demo_model
from hcapo_store.scoring.forward import LogprobModel

TOL = 1e-5
QWEN25_TOKENIZER = TOKENIZERS / "qwen2.5"

CHAT = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "The parser test fails."},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": "src/parser.py"}}}],
    },
    {"role": "tool", "content": "def parse(text):\n    return None"},
    {"role": "assistant", "content": "Fixed: it now returns an empty list."},
]


def _full_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _expected(full: torch.Tensor, ids: list[int], first_scored: int) -> list[float]:
    return [full[i - 1, ids[i]].item() for i in range(first_scored, len(ids))]


@pytest.fixture(scope="module")
def chat_ids(tiny_model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def full(tiny_model_dir: Path, chat_ids: list[int]) -> torch.Tensor:
    return _full_logprobs(tiny_model_dir, chat_ids)


@pytest.mark.parametrize("chunk_size", [1, 7, 512])
def test_score_matches_full_forward(
    tiny_model_dir: Path, chat_ids: list[int], full: torch.Tensor, chunk_size: int
) -> None:
    scorer = LogprobModel(tiny_model_dir, chunk_size=chunk_size)
    n = len(chat_ids)
    assert n > 40  # the scored spans below are longer than the small chunks
    for first_scored in (1, 2, n // 2, n - 1, n):
        got = scorer.score(chat_ids, first_scored)
        assert got == pytest.approx(_expected(full, chat_ids, first_scored), abs=TOL)


def test_score_batch_and_positions(tiny_model_dir: Path, chat_ids: list[int], full: torch.Tensor) -> None:
    scorer = LogprobModel(tiny_model_dir, chunk_size=5)
    short = chat_ids[:12]
    assert scorer.score_batch([(chat_ids, 3), (short, 11)]) == [scorer.score(chat_ids, 3), scorer.score(short, 11)]

    scores = scorer.score_positions(chat_ids, 20, top_k=4, ranks=True, next_token=True)
    assert scores.ranks is not None and scores.top is not None
    for offset, position in enumerate(range(20, len(chat_ids))):
        row = full[position - 1]
        target = chat_ids[position]
        assert scores.ranks[offset] == int((row > row[target]).sum()) + 1
        assert [t for t, _ in scores.top[offset]] == row.topk(4).indices.tolist()
    assert scores.next_token is not None
    assert scores.next_token[0] == int(full[-1].argmax())
    assert scores.next_token[1] == pytest.approx(full[-1].max().item(), abs=TOL)


def test_score_rejects_bad_input(tiny_model_dir: Path) -> None:
    scorer = LogprobModel(tiny_model_dir)
    for ids, first in (([], 1), ([1, 2], 0), ([1, 2], 3), ([1, scorer.vocab_size], 1)):
        with pytest.raises(ValueError):
            scorer.score(ids, first)


def test_model_info(tiny_model_dir: Path) -> None:
    info = LogprobModel(tiny_model_dir, chunk_size=64).model_info()
    assert info["model_type"] == "qwen2" and info["architectures"] == ["Qwen2ForCausalLM"]
    assert info["num_hidden_layers"] == 2 and info["hidden_size"] == 64
    assert info["dtype"] == "float32" and info["chunk_size"] == 64 and info["device"] == "cpu"
    assert info["vocab_size"] >= len(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def test_demo_tokenizer_round_trips(demo_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))
    assert 1500 <= len(tokenizer) <= 2100
    text = 'Ünïcode ✓ 😀\n$ ls -la\n{"a": [1, 2]}\n<tool_call>\n</tool_call><think>x</think>\tdef f(): pass'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert tokenizer.convert_ids_to_tokens(tokenizer(token, add_special_tokens=False)["input_ids"]) == [token]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None


def test_demo_chat_template(demo_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))
    rendered = tokenizer.apply_chat_template(CHAT[:4], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou fix bugs.<|im_end|>\n"
        "<|im_start|>user\nThe parser test fails.<|im_end|>\n"
        "<|im_start|>assistant\nLet me look.\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/parser.py"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\ndef parse(text):\n    return None\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_tools = tokenizer.apply_chat_template(
        CHAT[1:2], tools=[{"type": "function", "function": {"name": "bash"}}], tokenize=False
    )
    assert with_tools.startswith("<|im_start|>system\n# Tools\n")
    assert '{"type": "function", "function": {"name": "bash"}}' in with_tools


def test_demo_assets_are_deterministic_and_idempotent(
    tmp_path: Path, demo_tokenizer_dir: Path, tiny_model_dir: Path
) -> None:
    again = build_demo_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (demo_tokenizer_dir / name).read_bytes()
    weights = tiny_model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_tiny_model(tiny_model_dir, demo_tokenizer_dir) == tiny_model_dir
    assert weights.stat().st_mtime_ns == stamp
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768 and config["num_hidden_layers"] == 2


def test_ensure_demo_model_builds_once(tmp_path: Path) -> None:
    model_dir = ensure_demo_model(tmp_path)
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(CHAT[1:2], tokenize=False)


@pytest.mark.skipif(not QWEN25_TOKENIZER.is_dir(), reason="Qwen2.5 tokenizer not available")
@pytest.mark.slow  # a 151k vocabulary on the CPU; the tiny-vocabulary scoring tests here stay fast
def test_qwen_vocabulary_model_scores_correctly(tmp_path: Path) -> None:
    model_dir = build_tiny_model(
        tmp_path / "qwen-tiny", QWEN25_TOKENIZER, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tokenizer) == 151665
    ids = tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    scorer = LogprobModel(model_dir, chunk_size=16)
    assert scorer.vocab_size >= 151665
    first_scored = len(ids) // 2
    expected = _expected(_full_logprobs(model_dir, ids), ids, first_scored)
    assert scorer.score(ids, first_scored) == pytest.approx(expected, abs=TOL)
