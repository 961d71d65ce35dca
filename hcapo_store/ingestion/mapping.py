"""Step → subtask mapping (docs/ORIGINAL.md §2; the original's ``map_steps_to_subtasks`` fixed).

Pure functions over a converted message list. Differences from the original, each a
documented quirk of docs/ORIGINAL.md §4:
- the plan comes from result.json (Q1), so executing steps get their subtask ids;
- ``mcp`` proxy calls are resolved from Pi's native dict arguments, a JSON string, or the
  legacy nested ``arguments`` (Q21);
- success is judged on the tool result whose ``tool_call_id`` matches the call, not the
  next tool message (Q7; fallback to the next tool message only when ids are missing),
  on the untruncated text (Q9);
- every transition call in a message counts, in call order (Q7).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hcapo_store.steps import StepInfo
from hcapo_store.tool_arguments import as_mapping

PLANNING = "planning"
EXECUTING = "executing"
_FAIL_PREFIXES = ("[tool_error]", "Failed to call tool", "Error:")


def effective_tool_name(call: dict[str, Any]) -> str:
    """The tool a call really invokes: the inner tool of an ``mcp`` proxy call, unprefixed."""
    fn = call.get("function") or {}
    name = fn.get("name") or ""
    if name == "mcp":
        args = as_mapping(fn.get("arguments")) or {}
        inner = args.get("tool")
        if not inner:  # legacy shape: {"arguments": "{\"tool\": …}"}
            inner = (as_mapping(args.get("arguments")) or {}).get("tool")
        if isinstance(inner, str) and inner:
            name = inner
    return name.replace("openenv_", "")


def is_successful_response(text: str) -> bool:
    """A transition succeeded when its result is a JSON object without an ``error`` key."""
    c = (text or "").strip()
    if not c or c.startswith(_FAIL_PREFIXES) or not c.startswith("{"):
        return False
    obj = as_mapping(c)
    return obj is not None and "error" not in obj


def _find_result(messages: list[dict[str, Any]], after: int, call_id: str, taken: set[int]) -> int | None:
    """Index of the tool message answering ``call_id`` (or the next unused tool message)."""
    fallback = None
    for i in range(after + 1, len(messages)):
        m = messages[i]
        if m["role"] == "assistant":
            break
        if m["role"] != "tool" or i in taken:
            continue
        if call_id and m.get("tool_call_id") == call_id:
            return i
        if fallback is None and not (call_id and m.get("tool_call_id")):
            fallback = i
    return fallback


def _transitions(
    messages: list[dict[str, Any]], m_index: int, full_tool_text: dict[int, str]
) -> Iterator[tuple[str, str]]:
    """(tool, untruncated result) of each answered submit_plan/advance call of one message, in call order."""
    taken: set[int] = set()
    for call in messages[m_index].get("tool_calls") or []:
        name = effective_tool_name(call)
        if name not in ("submit_plan", "advance"):
            continue
        r = _find_result(messages, m_index, call.get("id") or "", taken)
        if r is None:
            continue
        taken.add(r)
        yield name, full_tool_text.get(r, messages[r].get("content") or "")


def plan_warning(
    messages: list[dict[str, Any]], plan: list[dict[str, Any]], full_tool_text: dict[int, str] | None = None
) -> str | None:
    """Why no step gets a subtask although the episode has a plan; None when a plan was accepted."""
    if not plan:
        return None
    results = [
        text
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
        for name, text in _transitions(messages, i, full_tool_text or {})
        if name == "submit_plan"
    ]
    if any(is_successful_response(text) for text in results):
        return None
    if not results:
        return f"plan has {len(plan)} subtask(s) but no answered submit_plan call: every step is mapped to planning"
    return (
        f"plan has {len(plan)} subtask(s) but none of the {len(results)} submit_plan result(s) is a JSON "
        "object without an 'error' key: every step is mapped to planning"
    )


def map_steps(
    messages: list[dict[str, Any]],
    *,
    plan: list[dict[str, Any]],
    plan_score: float | None,
    frozen_scores: dict[str, float],
    full_tool_text: dict[int, str] | None = None,
) -> list[StepInfo]:
    """One StepInfo per assistant message, in order."""
    ids = [str(p["id"]) for p in plan]
    full_tool_text = full_tool_text or {}
    phase, idx = PLANNING, -1
    steps: list[StepInfo] = []
    for m_index, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        if phase == PLANNING:
            steps.append(StepInfo(len(steps), m_index, PLANNING, None, plan_score))
        else:
            sid = ids[idx] if 0 <= idx < len(ids) else None
            reward = float(frozen_scores.get(sid, 0.0)) if sid is not None else 0.0
            steps.append(StepInfo(len(steps), m_index, EXECUTING, sid, reward))
        for name, text in _transitions(messages, m_index, full_tool_text):
            if not is_successful_response(text):
                continue
            if name == "submit_plan":
                phase, idx = EXECUTING, 0
            elif phase == EXECUTING:
                nxt = (as_mapping(text) or {}).get("next_subtask_id")
                idx = ids.index(nxt) if nxt in ids else min(idx + 1, max(len(ids) - 1, 0))
    return steps
