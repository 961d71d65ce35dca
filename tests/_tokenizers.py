"""Tokenizers and synthetic episodes for the prompt tests (no mocks: real `tokenizers` objects)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from _shared import TOKENIZERS as SHARED_TOKENIZERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHATML_WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}\n<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the of and to in is for on that with as this by def return import class self value "
    "data file path error test run build step café naïve 東京 ✓ -> == != {} [] () : ; 0 1 42"
).split()


# Loaded once per process (1-2 s each, far more on a loaded machine), handed out again while
# unchanged: a test that changes what it got (its chat template, special tokens, the backend's
# pieces) makes the next caller get a freshly loaded one.
_LOADED: dict[str, tuple[Any, tuple]] = {}


def _state(tok) -> tuple:
    backend = tok.backend_tokenizer
    parts = (backend.normalizer, backend.pre_tokenizer, backend.post_processor, backend.decoder)
    return (
        tok.chat_template,
        repr(tok.special_tokens_map),
        repr(tok.added_tokens_encoder),
        tok.padding_side,
        tok.truncation_side,
        tok.model_max_length,
        len(tok),
        repr(backend.truncation),
        repr(backend.padding),
        tuple(repr(x) for x in parts),
    )


def real_tokenizer(name: str):
    """The real Qwen tokenizer from ../shared, or skip the test."""
    path = SHARED_TOKENIZERS / name
    if not path.is_dir():
        pytest.skip(f"real tokenizer directory {path} is absent")
    return loaded_tokenizer(path)


def loaded_tokenizer(path: Path):
    """``load_tokenizer(path)``, loaded once per process while nobody changes it (above)."""
    where = Path(path).resolve()
    files = sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in where.iterdir() if f.is_file())
    key = f"{where} {files}"  # files rewritten in place: loaded again
    cached = _LOADED.get(key)
    if cached is not None and _state(cached[0]) == cached[1]:
        return cached[0]
    from hcapo_store.rendering.tokenizers import load_tokenizer

    tok = load_tokenizer(path)
    _LOADED[key] = (tok, _state(tok))
    return tok


def named_tokenizer(name: str, tmp_path: Path, demo_tokenizer_dir: Path):
    """A tokenizer by test-parameter name: ``demo`` (the built-in demo tokenizer),
    ``chatml-bos`` (bos_tokenizer below) or a real one from ../shared (``qwen3``, ``qwen2.5``)."""
    if name == "demo":
        from hcapo_store.rendering.tokenizers import load_tokenizer

        return load_tokenizer(demo_tokenizer_dir)
    if name == "chatml-bos":
        return bos_tokenizer(tmp_path)
    return real_tokenizer(name)


def bos_tokenizer(tmp_path: Path, *, template: str = CHATML_WITH_BOS):
    """A small byte-level BPE whose chat template emits BOS and which adds BOS on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = random.Random(1)
    tok.train_from_iterator([" ".join(rng.choice(_WORDS) for _ in range(50)) for _ in range(200)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials[2:],
    )
    fast.chat_template = template
    fast.save_pretrained(tmp_path)
    from hcapo_store.rendering.tokenizers import load_tokenizer

    return load_tokenizer(tmp_path)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def episode(seed: int, *, steps: int = 12, tool_chars: int = 400, thinking: bool = True, extra_user_turns: bool = True):
    """Messages, outcome and steps shaped like the converted loader output."""
    rng = random.Random(seed)
    messages: list[dict] = [{"role": "user", "content": "Task: " + text(rng, 60)}]
    plan = [{"id": f"S{i}"} for i in range(1, 4)]
    step_rows = []
    for t in range(steps):
        if extra_user_turns and t and t % 5 == 0:
            messages.append({"role": "user", "content": "Continue. " + text(rng, 10)})
        content = text(rng, rng.randint(0, 30))
        if thinking and rng.random() < 0.7:
            content = f"<think>\n{text(rng, 25)}\n</think>\n\n{content}"
        calls = []
        for c in range(rng.choice([0, 1, 1, 2])):
            args = {"command": text(rng, 8), "n": rng.randint(0, 9)}
            raw = json.dumps(args, ensure_ascii=False) if rng.random() < 0.9 else "not json {"
            calls.append(
                {
                    "id": f"call_{t}_{c}",
                    "type": "function",
                    "function": {"name": rng.choice(["bash", "mcp"]), "arguments": raw},
                }
            )
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        elif not content:
            msg["content"] = "done"
        messages.append(msg)
        index = len(messages) - 1
        phase = "planning" if t < 3 else "executing"
        sid = None if phase == "planning" else plan[min((t - 3) // 4, 2)]["id"]
        step_rows.append(
            {
                "step_index": t,
                "message_index": index,
                "phase": phase,
                "subtask_id": sid,
                "subtask_reward": 0.72 if sid is None else 0.5,
            }
        )
        for call in calls:
            body = text(rng, 5) + "\n" + "x" * rng.randint(0, tool_chars) + "\n" + text(rng, tool_chars // 6)
            messages.append(
                {"role": "tool", "name": call["function"]["name"], "tool_call_id": call["id"], "content": body}
            )
    outcome = {
        "reward": 0.4795,
        "phase": "executing",
        "plan_score": 0.72,
        "plan": plan,
        "frozen_scores": {"S1": 0.5845, "S2": 0.412, "S3": 0.0},
    }
    return messages, outcome, step_rows
