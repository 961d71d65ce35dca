"""The scorer id includes the rendering stack: the token ids of a fixed probe conversation
built exactly as steps are. Library versions are recorded but do not change the id alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from transformers import PreTrainedTokenizerBase

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import StepPrompt
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.scoring import job
from hcapo_store.scoring.fingerprint import PROBE_MESSAGES, PROBE_OUTCOME, PROBE_STEPS
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.scoring.scorer import register


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _prepare(store, ref: ReferenceServer, tiny_model_dir: Path) -> job.Prepared:
    return prepare(
        store, ScoreConfig(backend="sglang", server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048)
    )


def test_the_probe_exercises_every_message_kind(tiny_model_dir):
    roles = [m["role"] for m in PROBE_MESSAGES]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert "<think>" in PROBE_MESSAGES[2]["content"] and PROBE_MESSAGES[2]["tool_calls"]
    prompts = PromptBuilder(load_tokenizer(tiny_model_dir)).build_episode(PROBE_MESSAGES, PROBE_OUTCOME, PROBE_STEPS)
    assert all(isinstance(p, StepPrompt) and p.scored_tokens > 0 for p in prompts)


def test_same_rendering_keeps_the_scorer_whatever_the_versions(store, ref, tiny_model_dir, monkeypatch):
    first = _prepare(store, ref, tiny_model_dir)
    register(store, first.spec)  # as run_scoring does (prepare writes nothing)
    monkeypatch.setattr(job, "library_versions", lambda: {"transformers": "99.0", "tokenizers": "9.9", "jinja2": "9.0"})
    upgraded = _prepare(store, ref, tiny_model_dir)
    register(store, upgraded.spec)  # the same id: the first registration's spec stays
    assert upgraded.spec["rendering_sha256"] == first.spec["rendering_sha256"]
    assert upgraded.spec["provenance"] != first.spec["provenance"]
    assert upgraded.scorer_id == first.scorer_id
    with store.engine.connect() as conn:
        stored = json.loads(conn.execute(text("SELECT spec FROM scorers")).scalar_one())
    assert stored["provenance"]["libraries"]["transformers"] == first.spec["provenance"]["libraries"]["transformers"]


def test_changed_rendering_makes_a_new_scorer(store, ref, tiny_model_dir, monkeypatch):
    first = _prepare(store, ref, tiny_model_dir)
    original = PreTrainedTokenizerBase.apply_chat_template

    def renders_differently(self, conversation, *args, **kwargs):  # as another jinja2/transformers might
        out = original(self, conversation, *args, **kwargs)
        return out.replace("\n", " \n") if isinstance(out, str) else out

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", renders_differently)
    other = _prepare(store, ref, tiny_model_dir)
    assert other.spec["tokenizer"] == first.spec["tokenizer"]  # same files, same template text
    assert other.spec["rendering_sha256"] != first.spec["rendering_sha256"]
    assert other.scorer_id != first.scorer_id
