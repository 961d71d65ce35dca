"""Session fixtures that build the demo tokenizer and the tiny demo model once.

``tests/conftest.py`` imports them; everything is built locally, nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hcapo_store.devkit.tiny_model import build_demo_tokenizer, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_tokenizer(tmp_path_factory.mktemp("demo-tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A 2-layer random Qwen2 model with the demo vocabulary and its tokenizer files."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", demo_tokenizer_dir)


@pytest.fixture(scope="session")
def chat_ids(tiny_model_dir: Path) -> list[int]:
    """Forty short chat turns in the tiny model's tokenizer: a sequence to score in process."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "".join(f"<|im_start|>user\nstep {i}: parse the wire table {i * 7}<|im_end|>\n" for i in range(40))
    return tokenizer(text, add_special_tokens=False)["input_ids"]
