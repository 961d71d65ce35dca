"""The rendering stack's part of the scorer identity.

The scorer id hashes the tokenizer files and the chat template text, but the same files
can render or tokenize differently under another transformers, tokenizers or jinja2. So a
fixed probe conversation (system, user, an assistant turn with thinking and a tool call,
the tool's result, a final assistant turn) is built exactly as steps are, through
``PromptBuilder.build_episode``, and the hash of the resulting token ids is part of the
identity. The probe is built by the rules only (``PromptBuilder.by_rule``: ``apply_chat_template``
and the ``tokenizers`` backend's own pipeline, never the fast strategies of
rendering/verify.py, which reproduce them), so what a ``transformers``, ``tokenizers`` or
``jinja2`` upgrade changes on the probe, ASCII text included, changes the fingerprint. The
library versions are recorded with the scorer (``spec["provenance"]``); of them only
``tokenizers``' is part of its id (in the tokenizer fingerprint, rendering/tokenizers.py: a
release can change ids the probe does not reach). A transformers or jinja2 upgrade that renders
the probe to the same ids keeps the scorer, one that renders it differently makes a new scorer.
"""

from __future__ import annotations

import hashlib
from array import array
from importlib import metadata
from typing import Any

from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import PromptFailure, StepPrompt
from hcapo_store.scoring.grouping import plan_requests

RENDERING_LIBRARIES = ("transformers", "tokenizers", "jinja2")

# The stored message shape (storage/episodes.loader_message): arguments as JSON strings,
# thinking kept as <think>…</think> in the content (ingest --include-thinking).
PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful agent. Use tools when they help."},
    {"role": "user", "content": "Count the lines of notes.txt, then report.\nÜnïcödé and  two  spaces."},
    {
        "role": "assistant",
        "content": "<think>\nI should run wc first.\n</think>\n\nLet me count them.",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "wc -l notes.txt"}'},
            }
        ],
    },
    {"role": "tool", "name": "bash", "tool_call_id": "call_0", "content": "42 notes.txt\n"},
    {"role": "assistant", "content": "<think>\nThe tool said 42.\n</think>\n\nnotes.txt has 42 lines."},
]
PROBE_OUTCOME = {
    "reward": 0.75,
    "phase": "executing",
    "plan_score": 0.5,
    "plan": [{"id": "S1"}],
    "frozen_scores": {"S1": 0.75},
}
PROBE_STEPS = [
    {"step_index": 0, "message_index": 2, "phase": "executing", "subtask_id": "S1", "subtask_reward": 0.75},
    {"step_index": 1, "message_index": 4, "phase": "executing", "subtask_id": "S1", "subtask_reward": 0.75},
]


def rendering_fingerprint(builder: PromptBuilder) -> str:
    """SHA-256 of the probe's prompts as the builder's rules make them (ids, spans, failures):
    ``apply_chat_template`` and the backend tokenizer itself, never a fast strategy
    (rendering/verify.py), so the fingerprint sees what the libraries do."""
    builder = builder.by_rule()
    digest = hashlib.sha256()
    if builder.layout == "episode":
        digest.update(b"layout:episode\n")
        for request in plan_requests(builder, PROBE_MESSAGES, PROBE_OUTCOME, PROBE_STEPS):
            members: list[StepPrompt | PromptFailure] = (
                [request] if isinstance(request, PromptFailure) else list(request.members)
            )
            _digest(digest, members)
        return digest.hexdigest()
    _digest(digest, builder.build_episode(PROBE_MESSAGES, PROBE_OUTCOME, PROBE_STEPS))
    return digest.hexdigest()


def _digest(digest: Any, prompts: list[StepPrompt | PromptFailure]) -> None:
    for prompt in prompts:
        if isinstance(prompt, PromptFailure):
            digest.update(f"failure:{prompt.step_index}:{prompt.reason}\n".encode())
            continue
        digest.update(f"step:{prompt.step_index}:{prompt.first_scored}:{prompt.flattened}:".encode())
        digest.update(array("q", prompt.input_ids).tobytes() + b"\n")


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in RENDERING_LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
