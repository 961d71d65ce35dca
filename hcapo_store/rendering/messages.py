"""Messages as chat templates take them: normalized (tool-call arguments as mappings), or
flattened to plain text for templates that reject tool traffic, and a message's own words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hcapo_store.tool_arguments import arguments_text, as_mapping


def _parse_arguments(arguments: Any) -> Any:
    """JSON-object strings become mappings (templates `tojson` or iterate them); others stay."""
    parsed = as_mapping(arguments)
    return arguments if parsed is None else parsed


def normalize_message(message: Mapping[str, Any]) -> dict:
    """A template-ready copy: None values dropped, tool-call arguments as mappings."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            call = dict(call)
            function = dict(call.get("function") or {})
            if "arguments" in function:
                function["arguments"] = _parse_arguments(function["arguments"])
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    return [normalize_message(m) for m in messages]


def flatten_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The original's fallback: tool traffic as plain text, for templates that reject it."""
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "tool":
            out.append(
                {
                    "role": "user",
                    "content": f"[Tool Result: {m.get('name', 'tool')}]\n{m.get('content', '')}",
                }
            )
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            for call in m["tool_calls"]:
                function = call.get("function", {})
                parts.append(f"[Tool Call: {function.get('name', '?')}]\n{arguments_text(function.get('arguments'))}")
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append(dict(m))
    return out


def own_text(message: Mapping[str, Any]) -> str:
    """A message's own words (content, reasoning, tool calls), without template markup."""
    parts = []
    for name in ("content", "reasoning_content"):
        value = message.get(name)
        if value is not None:
            parts.append(value if isinstance(value, str) else repr(value))
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        parts.append(f"{function.get('name', '')} {arguments_text(function.get('arguments'))}")
    return "\n".join(parts)
