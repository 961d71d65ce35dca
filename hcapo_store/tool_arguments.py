"""Tool-call arguments between their two forms: the JSON text the OpenAI format carries and
the mapping that chat templates and the step mapping read. The one place for both ways.
"""

from __future__ import annotations

import json
from typing import Any

# What json.dumps(x, ensure_ascii=False) does, without building an encoder per call (ingest
# dumps every tool call's arguments: the construction was half the cost). Same text.
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode


def dumps_text(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)``, the same text, faster on many small values."""
    return _ENCODE(value)


def arguments_text(arguments: Any) -> str:
    """Arguments as JSON text: a string stays as it is, None is ``{}``, anything else is dumped."""
    if isinstance(arguments, str):
        return arguments
    return _ENCODE({} if arguments is None else arguments)


def as_mapping(value: Any) -> dict[str, Any] | None:
    """A mapping as it is, a string holding a JSON object parsed; anything else None."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):  # not JSON, a too-long integer, nested too deep
        return None
    return parsed if isinstance(parsed, dict) else None
