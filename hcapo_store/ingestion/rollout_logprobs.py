"""The behaviour policy's own per-token logprobs, read from an episode's stored source.

Three shapes (docs/FAMILY.md "rollout scorer"), per assistant message, in the order of the
conversation:

* OpenAI chat completions: ``"logprobs": {"content": [{"token", "logprob", "bytes",
  "top_logprobs"}, ...]}`` (or the bare ``content`` list) beside the message; a ``token`` of
  the form ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``) names the id itself;
* verl rollouts: ``"rollout_log_probs": [float, ...]`` beside the message, with the sampled
  ids in ``"response_ids"`` or ``"token_ids"`` when the dump has them;
* Pi sessions: a ``logprobs`` list (OpenAI entries) beside the assistant message's entry, or
  inside its ``message``, if the collector wrote one.

The record's ``engine``, ``model`` and ``weight_version`` (top level, or under ``rollout``)
name the policy. Nothing here touches the database or a tokenizer: the entries are checked
against the tokenizer's ids of each step where they are stored (outputs/rollout_scores.py).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

ID_PREFIX = "token_id:"


@dataclass
class RolloutTokens:
    """One assistant message's sampled tokens: logprobs, and what names each token."""

    logprobs: list[float]
    tokens: list[str | None] = field(default_factory=list)  # the entry's text, None where not given
    token_bytes: list[bytes | None] = field(default_factory=list)
    ids: list[int | None] = field(default_factory=list)


@dataclass
class RolloutRecord:
    policy: dict[str, Any]  # engine, model, weight_version where the record gives them
    messages: list[RolloutTokens | None]  # per assistant message, in order; None: none given


class RolloutFormatError(ValueError):
    """A logprobs field whose shape is not one of the module doc's."""


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RolloutFormatError(f"{what} must be a number, got {value!r}")
    return float(value)


def _openai_entries(value: Any, what: str) -> RolloutTokens:
    entries = value.get("content") if isinstance(value, dict) else value
    if not isinstance(entries, list):
        raise RolloutFormatError(f"{what} must be a list of token entries or an object with one in 'content'")
    out = RolloutTokens([])
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise RolloutFormatError(f"{what}[{i}] must be an object with 'token' and 'logprob'")
        out.logprobs.append(_float(e.get("logprob"), f"{what}[{i}].logprob"))
        token = e.get("token")
        token_id = None
        if isinstance(token, str) and token.startswith(ID_PREFIX) and token[len(ID_PREFIX) :].isdigit():
            token_id, token = int(token[len(ID_PREFIX) :]), None
        out.tokens.append(token if isinstance(token, str) else None)
        raw = e.get("bytes")
        out.token_bytes.append(bytes(raw) if isinstance(raw, list) and all(isinstance(b, int) for b in raw) else None)
        out.ids.append(token_id)
    return out


def _verl_entries(m: dict[str, Any], what: str) -> RolloutTokens:
    values = m["rollout_log_probs"]
    if not isinstance(values, list):
        raise RolloutFormatError(f"{what}.rollout_log_probs must be a list of numbers")
    ids = m.get("response_ids", m.get("token_ids"))
    if ids is not None and (not isinstance(ids, list) or len(ids) != len(values)):
        raise RolloutFormatError(f"{what}: response_ids must be a list as long as rollout_log_probs")
    logprobs = [_float(v, f"{what}.rollout_log_probs[{i}]") for i, v in enumerate(values)]
    n = len(logprobs)
    return RolloutTokens(logprobs, [None] * n, [None] * n, [int(i) for i in ids] if ids is not None else [None] * n)


def _message_tokens(m: Any, what: str, outer: dict[str, Any] | None = None) -> RolloutTokens | None:
    if not isinstance(m, dict):
        return None
    if m.get("logprobs") is not None:
        return _openai_entries(m["logprobs"], f"{what}.logprobs")
    if m.get("rollout_log_probs") is not None:
        return _verl_entries(m, what)
    if outer is not None and outer.get("logprobs") is not None:
        return _openai_entries(outer["logprobs"], f"{what} entry's logprobs")
    return None


def _policy(obj: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = obj["rollout"] if isinstance(obj.get("rollout"), dict) else {}
    out = {}
    for key in ("engine", "model", "weight_version"):
        value = obj.get(key, nested.get(key))
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            out[key] = str(value)
    return out


def read_rollout(source_format: str, raw_source: bytes) -> RolloutRecord | None:
    """The rollout logprobs of an episode's stored source, or None when it carries none."""
    text = zlib.decompress(raw_source).decode("utf-8")
    if source_format == "openai_jsonl":
        obj = json.loads(text)
        messages = obj.get("messages") or []
        found = [
            _message_tokens(m, f"messages[{i}]")
            for i, m in enumerate(messages)
            if isinstance(m, dict) and m.get("role") == "assistant"
        ]
        policy = _policy(obj)
    else:  # a Pi session: {result.json: text, pi_session.jsonl: text}
        parts = json.loads(text)
        session = next((v for k, v in parts.items() if k != "result.json"), "")
        found, policy = [], {}
        for n, line in enumerate(str(session).splitlines()):
            if not line.strip():
                continue
            entry = json.loads(line)
            message = entry.get("message") if isinstance(entry, dict) else None
            if isinstance(message, dict) and message.get("role") == "assistant":
                found.append(_message_tokens(message, f"line {n + 1}", entry))
                policy = policy or _policy({**message, **entry})
    if not any(t is not None for t in found):
        return None
    return RolloutRecord(policy, found)
