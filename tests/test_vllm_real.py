"""Opt-in: grouped == per-step on a real vLLM server (issue 10). Not in the default run.

    HCAPO_VLLM_URL=http://127.0.0.1:8000 [HCAPO_VLLM_TOKENIZER=DIR] [HCAPO_VLLM_ATOL=1e-4] \\
        pytest tests/test_vllm_real.py

The server must serve a model whose tokenizer is ``HCAPO_VLLM_TOKENIZER`` (default: the
model card's ``root``, when it is a local directory), e.g. a tiny random-weight Qwen3 saved
with ``save_pretrained`` and started with ``--dtype float32 --max-model-len 8192``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from _tokenizers import episode

from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import GroupPrompt, StepPrompt
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.scoring.backends.vllm import VLLMBackend
from hcapo_store.scoring.grouping import group_prompts

URL = os.environ.get("HCAPO_VLLM_URL")
pytestmark = pytest.mark.skipif(not URL, reason="set HCAPO_VLLM_URL to a running vLLM server to run this test")


async def _check() -> int:
    backend = VLLMBackend(URL or "")
    await backend.start()
    try:
        location = os.environ.get("HCAPO_VLLM_TOKENIZER") or backend.tokenizer_path()
        if not location or not Path(location).is_dir():
            pytest.skip(f"tokenizer {location!r} is not a local directory: set HCAPO_VLLM_TOKENIZER")
        ctx = min(backend.context_length() or 8192, 8192)
        builder = PromptBuilder(load_tokenizer(location), max_context=ctx)
        messages, outcome, steps = episode(2, steps=10, tool_chars=150)
        prompts = [p for p in builder.build_episode(messages, outcome, steps) if isinstance(p, StepPrompt)]
        groups = [g for g in group_prompts(prompts, max_tokens=ctx) if isinstance(g, GroupPrompt)]
        atol = float(os.environ.get("HCAPO_VLLM_ATOL", "1e-4"))
        compared = 0
        for g in groups:
            if len(g.members) < 2:
                continue
            together = await backend.score_group(g)
            for member, grouped in zip(g.members, together):
                alone = await backend.score(member)
                np.testing.assert_allclose(grouped.logprobs, alone.logprobs, atol=atol, rtol=0)
                compared += 1
        return compared
    finally:
        await backend.close()


def test_grouped_equals_per_step_on_a_real_vllm_server():
    assert asyncio.run(_check()) >= 2
