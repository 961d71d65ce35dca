"""Parsing inputs: result.json + Pi session JSONL, and OpenAI JSONL lines, into episodes.

Conversion follows the original loader (``build_training_dataset.load_trajectory``) with
the fixes listed in docs/ORIGINAL.md §4: thinking is read from the block's ``thinking`` key, ``plan`` is
kept, a null ``plan_score`` stays null, a malformed line names its file and line number.
Every field read is checked for its type and size (a bad one fails that episode alone,
naming file, line and field), and a NUL character becomes U+FFFD. Both formats go through
one converter (``_Turn`` → ``_build_messages``). This module reads no file: it is given the
bytes discovery.py read (through files.py's gate); ``pipeline.py`` stores what it returns.
"""

from __future__ import annotations

import json
import re
import sys
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from hcapo_store.errors import IngestError, SkipEpisode
from hcapo_store.ingestion.mapping import map_steps, plan_warning
from hcapo_store.steps import StepInfo
from hcapo_store.tool_arguments import arguments_text, dumps_text

SESSION_FILE = "pi_session.jsonl"
# zlib level of the stored raw source: level 1 costs a quarter of level 6 for ~20 % more
# bytes (bench/ingest.py); any level decompresses the same way.
RAW_COMPRESSION = 1
RESULT_FILE = "result.json"
TRUNCATION_SUFFIX = "\n... [truncated, {n} chars total]"
TOOL_ERROR_PREFIX = "[tool_error]"
COMPACTION_MODES = ("full", "context")
# How the summary of a compaction enters the model's context in context mode: a user message.
COMPACTION_SUMMARY = (
    "The conversation history before this point was compacted into the following summary:\n\n"
    "<summary>\n{summary}\n</summary>"
)


@dataclass(frozen=True)
class ConvertOptions:
    """Options that change the converted messages (and so belong to the scorer identity)."""

    include_thinking: bool = True
    max_tool_result_chars: int = 4000
    # Pi sessions with compaction entries: "full" = every message in file order (the original
    # loader's transcript); "context" = what the agent saw after the last compaction.
    compaction: str = "full"

    def __post_init__(self) -> None:
        if self.compaction not in COMPACTION_MODES:
            raise ValueError(f"compaction must be one of {', '.join(COMPACTION_MODES)}, got {self.compaction!r}")

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "include_thinking": self.include_thinking,
            "max_tool_result_chars": self.max_tool_result_chars,
        }
        if self.compaction != "full":  # left out at its default: stored hashes stay
            d["compaction"] = self.compaction
        return d

    def episode_columns(self) -> dict[str, Any]:
        """The options every stored episode records in its own columns (``episodes.include_thinking``,
        ``max_tool_result_chars``): what a scorer selects episodes by (its spec's ``conversion``,
        the queue's filter). ``compaction`` is ingest's alone: it decides which messages are
        stored, and scoring reads the stored messages as they are."""
        return {"include_thinking": self.include_thinking, "max_tool_result_chars": self.max_tool_result_chars}


@dataclass
class ParsedEpisode:
    """One episode as read from its source, converted and ready to store."""

    source_format: str
    content_hash: str
    raw_source: bytes
    external_id: str | None
    reward: float
    phase: str | None
    plan_score: float | None
    frozen_scores: dict[str, float]
    plan: list[dict[str, Any]]
    turns: int | None
    tool_call_count: int | None
    reward_backfilled: bool
    messages: list[MessageRow]
    steps: list[StepInfo]  # mapped on the untruncated tool results (Q9), which are not kept
    warnings: list[str] = field(default_factory=list)


class MessageRow(NamedTuple):
    """A converted message as it is stored (``messages`` table): tool calls as JSON text.

    Rows, not dicts, travel from a parse worker to the process that stores them."""

    role: str
    content: str
    tool_calls: str | None
    name: str | None
    tool_call_id: str | None

    @classmethod
    def of(cls, m: dict[str, Any]) -> MessageRow:
        calls = m.get("tool_calls")
        return cls(
            m["role"],
            m.get("content") or "",
            dumps_text(calls) if calls else None,
            m.get("name"),
            m.get("tool_call_id"),
        )


# ---------------------------------------------------------------------------
# checked reading: every field the conversion uses is checked for its type and size, so a
# bad episode fails alone with a message naming the file (and line) and the field


MAX_ABS_SCORE = 1e9  # rewards and scores: finite numbers within ±1e9 (the message below says so)
MAX_COUNT = 2**31 - 1  # turns, tool_call_count: what an INTEGER column holds on every database
MAX_SESSION_VERSION = 999
# PostgreSQL text cannot hold U+0000, so on every database a NUL becomes U+FFFD (with a warning).
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")
# A lone UTF-16 surrogate escape (an agent cut a tool output inside an emoji) parses to a str
# that no UTF-8 database, hash or file can hold: it too becomes U+FFFD, with a warning.
_HIGH, _LOW = r"\\u[dD][89abAB][0-9a-fA-F]{2}", r"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE_SURROGATE_ESCAPE = re.compile(rf"(?<!\\)((?:\\\\)*)(?:{_HIGH}(?!{_LOW})|(?<!{_HIGH}){_LOW})")
JSONL_PROBE_LINES = 5


class _Invalid(ValueError):
    """A value of the input has the wrong type or size; the message names the field."""


class _BadJson(ValueError):
    """Text that json cannot load: malformed, nested too deeply, or an integer too long."""

    def __init__(self, msg: str, line: int | None = None, column: int | None = None) -> None:
        self.msg, self.line = msg, line
        super().__init__(msg if column is None else f"{msg} (column {column})")


def _parse_json(text: str | bytes) -> Any:
    # orjson first (3x faster on session lines); anything it refuses (NaN, lone surrogates,
    # deep nesting, huge integers, malformed text) goes through json for the same result
    # and the same messages as before.
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadJson(exc.msg, exc.lineno, exc.colno) from exc
    except RecursionError as exc:
        raise _BadJson("nested too deeply") from exc
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise _BadJson(
            f"a number has more than {sys.get_int_max_str_digits()} digits"
            if "digits" in str(exc)
            else str(exc).split(":")[0]
        ) from exc


def _replace_nul(text: str, warnings: list[str], label: str) -> str:
    """Replace every ``\\u0000`` escape and every lone surrogate escape by U+FFFD before parsing
    (an escaped backslash is kept): text no database can store, each said in a warning."""
    if "\\u" not in text:
        return text
    text, n = _NUL_ESCAPE.subn(lambda m: m.group(1) + "\\ufffd", text)
    if n:
        warnings.append(f"{label}{n} NUL character(s) (\\u0000) replaced by U+FFFD")
    text, n = _LONE_SURROGATE_ESCAPE.subn(lambda m: m.group(1) + "\\ufffd", text)
    if n:
        warnings.append(f"{label}{n} lone UTF-16 surrogate(s) (e.g. a cut emoji) replaced by U+FFFD")
    return text


@contextmanager
def _located(path: Path, line: int | None = None) -> Iterator[None]:
    """A bad field, or a conversion error nobody foresaw, fails the episode naming the file and line."""
    try:
        yield
    except _CONVERSION_ERRORS as exc:
        raise _located_error(exc, path, line) from exc


# what a bad field (_Invalid) or a conversion error nobody foresaw raises
_CONVERSION_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError, OverflowError)


def _located_error(exc: Exception, path: Path, line: int | None) -> IngestError:
    if isinstance(exc, _Invalid):
        return IngestError(str(exc), path=str(path), line=line)
    first = (str(exc).splitlines() or [""])[0][:200]
    return IngestError(f"cannot convert: {type(exc).__name__}: {first}", path=str(path), line=line)


def _describe(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10**15 else f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40]) + ("…" if len(value) > 40 else "")
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _wrong(what: str, expected: str, value: Any) -> _Invalid:
    return _Invalid(f"{what} must be {expected}, got {_describe(value)}")


def _score(value: Any, what: str, *, nullable: bool = False) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= MAX_ABS_SCORE:
        raise _wrong(what, "a finite number within ±1e9", value)
    return float(value)


def _count(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise _wrong(what, f"an integer from 0 to {MAX_COUNT}", value)
    return value


def _text(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _wrong(what, "a string", value)


def _flag(value: Any, what: str) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise _wrong(what, "true or false", value)


def _obj(value: Any, what: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise _wrong(what, "an object", value)


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list):
        return value
    raise _wrong(what, "a list", value)


def _id(value: Any, what: str) -> str | None:
    """An identifier given as a string or an integer."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise _wrong(what, "a string or an integer", value)


# ---------------------------------------------------------------------------
# outcome (result.json, or the JSONL line's own fields)


def _outcome(result: dict[str, Any], reward_key: str = "episode_reward") -> dict[str, Any]:
    frozen = result.get("frozen_scores")
    frozen = {} if frozen is None else _obj(frozen, "frozen_scores")
    return {
        "external_id": _id(result.get("episode_id"), "episode_id"),
        "reward": _score(result.get(reward_key), reward_key),
        "phase": _text(result.get("phase"), "phase"),
        "plan_score": _score(result.get("plan_score"), "plan_score", nullable=True),
        "frozen_scores": {str(k): _score(v, f"frozen_scores.{str(k)[:40]}") for k, v in frozen.items()},
        "plan": [_plan_item(p, f"plan[{i}]") for i, p in enumerate(_list(result.get("plan"), "plan"))],
        "turns": _count(result.get("turns"), "turns"),
        "tool_call_count": _count(result.get("tool_call_count"), "tool_call_count"),
        "reward_backfilled": _flag(result.get("_reward_backfilled"), "_reward_backfilled"),
    }


def _plan_item(item: Any, what: str) -> dict[str, Any]:
    item = _obj(item, what)
    if _id(item.get("id"), f"{what}.id") is None:
        raise _wrong(f"{what}.id", "a string or an integer", None)
    # Texts the subtasks table stores; a non-string value is kept as its JSON.
    texts = {
        k: v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        for k, v in item.items()
        if k in ("description", "acceptance_criteria")
    }
    return {**item, **texts}


def _finish(
    *,
    source_format: str,
    digest: str,
    raw: bytes,
    outcome: dict[str, Any],
    messages: list[dict[str, Any]],
    full_tool_text: dict[int, str],
    warnings: list[str],
    dense: bool = True,
) -> ParsedEpisode:
    """``dense``: the source has the plan-and-subtask shape (a result.json, or a line with a
    plan or a plan_score); outcome-only data (τ-bench, a GRPO rollout) is not warned about a
    plan_score it never had."""
    if len(messages) < 2:
        raise SkipEpisode(f"fewer than 2 messages after conversion ({len(messages)})")
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipEpisode("no assistant messages")
    if outcome["plan_score"] is None and dense:
        warnings.append("plan_score is null: planning steps get no dense reward (treated as 0 in credits)")
    unmapped = plan_warning(messages, outcome["plan"], full_tool_text)
    if unmapped:
        warnings.append(unmapped)
    steps = map_steps(
        messages,
        plan=outcome["plan"],
        plan_score=outcome["plan_score"],
        frozen_scores=outcome["frozen_scores"],
        full_tool_text=full_tool_text,
    )
    return ParsedEpisode(
        source_format=source_format,
        content_hash=digest,
        raw_source=raw,
        messages=[MessageRow.of(m) for m in messages],
        steps=steps,
        warnings=warnings,
        **outcome,
    )


# ---------------------------------------------------------------------------
# one converter for both formats: each format reads its messages into _Turns, one builder
# turns them into OpenAI-style messages


@dataclass
class _Turn:
    """One source message in the shape both formats share, before the conversion options apply."""

    role: str  # system | user | assistant | tool, or the dropped role's name
    parts: list[tuple[str, str]] = field(default_factory=list)  # ("thinking" | "text", text) in order
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, arguments as JSON text
    name: str = "unknown"
    call_id: str = ""
    is_error: bool = False
    kept: bool = True


def _build_messages(
    turns: Iterable[_Turn], options: ConvertOptions, warnings: list[str]
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Turns → messages in order; also the untruncated text of each tool message (Q9)."""
    messages: list[dict[str, Any]] = []
    full_tool_text: dict[int, str] = {}
    dropped: Counter[str] = Counter()
    for turn in turns:
        if not turn.kept:
            dropped[turn.role] += 1
            continue
        text = _join(turn.parts, options.include_thinking)
        if turn.role == "tool":
            full_tool_text[len(messages)] = _error_prefixed(text, turn.is_error)
            messages.append(
                {
                    "role": "tool",
                    "name": turn.name,
                    "tool_call_id": turn.call_id,
                    "content": _error_prefixed(_truncate(text, options.max_tool_result_chars), turn.is_error),
                }
            )
        elif text or turn.calls:
            message: dict[str, Any] = {"role": turn.role, "content": text}
            if turn.calls:
                message["tool_calls"] = turn.calls
            messages.append(message)
    for role, n in sorted(dropped.items()):
        warnings.append(f"{n} message(s) of role {role!r} dropped (not part of the model's context)")
    return messages, full_tool_text


def _join(parts: list[tuple[str, str]], include_thinking: bool) -> str:
    out = []
    for kind, text in parts:
        text = text.strip()
        if text and kind == "thinking" and include_thinking:
            out.append(f"<think>\n{text}\n</think>")
        elif text and kind == "text":
            out.append(text)
    return "\n\n".join(out).strip()


def _text_blocks(content: Any, what: str) -> str:
    """A message's text: a string, or the text blocks of a block list joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if not isinstance(content, list):
        raise _wrong(what, "a string, a list of content blocks or null", content)
    texts = []
    for i, block in enumerate(content):
        block = _obj(block, f"{what}[{i}]")
        if block.get("type") == "text":
            text = _text(block.get("text", ""), f"{what}[{i}].text")
            if text is not None:
                texts.append(text)
    return "\n".join(texts).strip()


def _tool_call(call_id: Any, name: Any, arguments: Any, *, id_what: str, fn_what: str) -> dict[str, Any]:
    if arguments is not None and not isinstance(arguments, (str, dict)):
        raise _wrong(f"{fn_what}.arguments", "a JSON string or an object", arguments)
    return {
        "id": _text(call_id, id_what) or "",
        "type": "function",
        "function": {"name": _text(name, f"{fn_what}.name") or "unknown", "arguments": arguments_text(arguments)},
    }


def _truncate(text: str, limit: int) -> str:
    if limit > 0 and len(text) > limit:
        return text[:limit] + TRUNCATION_SUFFIX.format(n=len(text))
    return text


def _error_prefixed(text: str, is_error: bool) -> str:
    if not is_error:
        return text
    return f"{TOOL_ERROR_PREFIX}\n{text}" if text else TOOL_ERROR_PREFIX


# ---------------------------------------------------------------------------
# episode directories (result.json + Pi session JSONL)


def _decode(data: bytes, path: Path, warnings: list[str]) -> tuple[str, str]:
    """(the text read, the text kept in the raw source): the same string for valid UTF-8; for
    invalid bytes U+FFFD is read and the bytes are kept (surrogate-escaped)."""
    try:
        text = data.decode("utf-8")
        return text, text
    except UnicodeDecodeError as exc:
        warnings.append(f"{path.name}: invalid UTF-8 at byte {exc.start} replaced (raw bytes kept)")
        return data.decode("utf-8", errors="replace"), data.decode("utf-8", "surrogateescape")


def _compress(obj: dict[str, Any]) -> bytes:
    # ASCII JSON keeps surrogate-escaped invalid bytes recoverable: the raw source is
    # lossless (decode the strings with .encode("utf-8", "surrogateescape")).
    return zlib.compress(json.dumps(obj).encode("ascii"), RAW_COMPRESSION)


def parse_episode_dir(
    directory: Path,
    result_bytes: bytes | None,
    session_bytes: bytes | None,
    options: ConvertOptions,
    digest: str,
) -> ParsedEpisode:
    warnings: list[str] = []
    result_path = directory / RESULT_FILE
    session_path = directory / SESSION_FILE
    if result_bytes is None:
        raise IngestError(f"missing {RESULT_FILE}", path=str(directory))
    result_read, result_kept = _decode(result_bytes, result_path, warnings)
    result_text = _replace_nul(result_read, warnings, f"{RESULT_FILE}: ")
    result = _load_json_object(result_text, result_path)
    if result.get("episode_reward") is None:
        reason = "no reward yet"
        if result.get("error"):
            error = result["error"]
            reason += f" (episode failed: {error[:120] if isinstance(error, str) else _describe(error)})"
        raise SkipEpisode(reason)
    if session_bytes is None:
        raise SkipEpisode(f"no {SESSION_FILE}")
    session_text, session_kept = _decode(session_bytes, session_path, warnings)
    if not session_text.strip():
        raise SkipEpisode(f"empty {SESSION_FILE}")
    entries, fmt = parse_pi_session(_replace_nul(session_text, warnings, f"{SESSION_FILE}: "), session_path, warnings)
    with _located(result_path):
        outcome = _outcome(result)
    entries = _compacted(entries, options.compaction, session_path, warnings)
    messages, full_tool_text = _build_messages(_pi_turns(entries, session_path), options, warnings)
    raw = _compress({"result.json": result_kept, SESSION_FILE: session_kept})
    with _located(directory):
        return _finish(
            source_format=fmt,
            digest=digest,
            raw=raw,
            outcome=outcome,
            messages=messages,
            full_tool_text=full_tool_text,
            warnings=warnings,
        )


def _load_json_object(text: str, path: Path) -> dict[str, Any]:
    try:
        obj = _parse_json(text)
    except _BadJson as exc:
        raise IngestError(f"invalid JSON: {exc}", path=str(path), line=exc.line) from exc
    if not isinstance(obj, dict):
        raise IngestError(f"expected a JSON object, got {_describe(obj)}", path=str(path))
    return obj


def parse_pi_session(text: str, path: Path, warnings: list[str]) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    """Parse the session lines; return ([(line number, entry)], "pi_v1"|"pi_v2"|"pi_v3").

    A malformed line fails the episode with its line number, except a truncated LAST
    line without a newline (the writer was killed mid-line): that entry is dropped
    with a warning, since everything before it is intact.
    """
    lines = text.split("\n")
    entries: list[tuple[int, dict[str, Any]]] = []
    version: int | None = None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = _parse_json(line)
        except _BadJson as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                warnings.append(f"{path.name}:{lineno}: truncated last line dropped ({exc.msg})")
                continue
            raise IngestError(f"malformed JSON line: {exc}", path=str(path), line=lineno) from exc
        if not isinstance(entry, dict):
            raise IngestError(f"expected a JSON object, got {_describe(entry)}", path=str(path), line=lineno)
        if entry.get("type") == "session" and not entries:
            version = _session_version(entry.get("version"), path, lineno)
        entries.append((lineno, entry))
    if version is None:
        warnings.append(f"{path.name}: no session header; read as Pi session v1")
        version = 1
    return entries, f"pi_v{version}"


def _session_version(value: Any, path: Path, lineno: int) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SESSION_VERSION:
        raise IngestError(
            f"session version must be an integer from 1 to {MAX_SESSION_VERSION}, got {_describe(value)}",
            path=str(path),
            line=lineno,
        )
    return value


def _compacted(
    entries: list[tuple[int, dict[str, Any]]], mode: str, path: Path, warnings: list[str]
) -> list[tuple[int, dict[str, Any]]]:
    """The entries to read: all of them (``full``), or (``context``) what the agent saw after the
    session's last compaction: its summary, then the entries from ``firstKeptEntryId`` on. A
    compacted session is said in a warning either way."""
    at = [i for i, (_, e) in enumerate(entries) if e.get("type") == "compaction"]
    if not at:
        return entries
    lines = ", ".join(str(entries[i][0]) for i in at)
    if mode == "full":
        warnings.append(
            f"{path.name}: {len(at)} compaction(s) (line {lines}): the agent saw a summary in place of the "
            "earlier messages, but the steps are read from the full transcript "
            "(ingest --compaction context renders what it saw)"
        )
        return entries
    last_line, last = entries[at[-1]]
    kept = last.get("firstKeptEntryId")
    start = next((i for i, (_, e) in enumerate(entries) if kept is not None and e.get("id") == kept), None)
    summary = last.get("summary")
    if start is None or start > at[-1] or not isinstance(summary, str):
        warnings.append(
            f"{path.name}:{last_line}: compaction without a readable summary or firstKeptEntryId "
            f"({_describe(kept)}) before it: read as the full transcript"
        )
        return entries
    dropped = sum(1 for _, e in entries[:start] if e.get("type") == "message")
    warnings.append(
        f"{path.name}: {len(at)} compaction(s) (line {lines}): rendered as the agent's context after the "
        f"last: its summary, then the entries from line {entries[start][0]} on ({dropped} earlier message(s) left out)"
    )
    note = {"type": "message", "message": {"role": "user", "content": COMPACTION_SUMMARY.format(summary=summary)}}
    rest = [x for x in entries[start:] if x[1].get("type") != "compaction"]
    return [(last_line, note), *rest]


def _pi_turns(entries: list[tuple[int, dict[str, Any]]], path: Path) -> list[_Turn]:
    """Pi message entries in order (compaction and other entries skipped)."""
    turns: list[_Turn] = []
    lineno = None
    try:  # one handler for all lines (a context manager per line cost ~5 % of ingest)
        for lineno, entry in entries:  # noqa: B007 (the handler names the line)
            if entry.get("type") == "message":
                turns.append(_pi_turn(_obj(entry.get("message"), "message")))
    except _CONVERSION_ERRORS as exc:
        raise _located_error(exc, path, lineno) from exc
    return turns


def _pi_turn(msg: dict[str, Any]) -> _Turn:
    role = _text(msg.get("role"), "message.role")
    if role == "user":
        return _Turn("user", [("text", _text_blocks(msg.get("content"), "message.content"))])
    if role == "assistant":
        return _pi_assistant(msg.get("content"))
    if role == "toolResult":
        return _Turn(
            "tool",
            [("text", _text_blocks(msg.get("content"), "message.content"))],
            name=_text(msg.get("toolName"), "message.toolName") or "unknown",
            call_id=_text(msg.get("toolCallId"), "message.toolCallId") or "",
            is_error=_flag(msg.get("isError"), "message.isError"),
        )
    return _Turn(str(role), kept=False)


def _pi_assistant(content: Any) -> _Turn:
    if not isinstance(content, list):
        return _Turn("assistant", [("text", _text(content, "message.content") or "")])
    turn = _Turn("assistant")
    for i, block in enumerate(content):
        what = f"message.content[{i}]"
        kind = _obj(block, what).get("type")
        if kind == "thinking":
            # The original read block["text"] here and so never kept thinking (Q2).
            turn.parts.append(("thinking", _text(block.get("thinking"), f"{what}.thinking") or ""))
        elif kind == "text":
            turn.parts.append(("text", _text(block.get("text"), f"{what}.text") or ""))
        elif kind == "toolCall":
            turn.calls.append(
                _tool_call(
                    block.get("id"),
                    block.get("name"),
                    block.get("arguments", block.get("input")),
                    id_what=f"{what}.id",
                    fn_what=what,
                )
            )
    return turn


# ---------------------------------------------------------------------------
# OpenAI-format JSONL (one episode per line)


def parse_jsonl_line(
    path: Path, lineno: int, line: bytes, options: ConvertOptions, digest: str, source_format: str = "openai_jsonl"
) -> ParsedEpisode:
    """One JSONL line (or one element of a JSON array read with ``--format``: ``source_format``)."""
    warnings: list[str] = []
    try:
        obj = _parse_json(_replace_nul(line.decode("utf-8"), warnings, ""))
    except (_BadJson, UnicodeDecodeError) as exc:
        msg = exc.msg if isinstance(exc, _BadJson) else "invalid UTF-8"
        raise IngestError(f"malformed JSON line: {msg}", path=str(path), line=lineno) from exc
    if not isinstance(obj, dict):
        raise IngestError("expected a JSON object per line", path=str(path), line=lineno)
    reward_key = "reward" if "reward" in obj else "episode_reward"
    if obj.get(reward_key) is None:
        raise SkipEpisode("no reward yet")
    with _located(path, lineno):
        outcome = _outcome(obj, reward_key)
        raw_messages = obj.get("messages")
        if not isinstance(raw_messages, list):
            raise _wrong("messages", "a list", raw_messages)
        messages, full_tool_text = _build_messages(_openai_turns(raw_messages), options, warnings)
        return _finish(
            source_format=source_format,
            digest=digest,
            raw=zlib.compress(line, RAW_COMPRESSION),
            outcome=outcome,
            messages=messages,
            full_tool_text=full_tool_text,
            warnings=warnings,
            dense=bool(outcome["plan"]) or "plan_score" in obj,
        )


def _openai_turns(raw: list[Any]) -> Iterator[_Turn]:
    for i, m in enumerate(raw):
        what = f"messages[{i}]"
        role = _text(_obj(m, what).get("role"), f"{what}.role")
        if role in ("system", "user"):
            yield _Turn(role, [("text", _text_blocks(m.get("content"), f"{what}.content"))])
        elif role == "assistant":
            reasoning = (
                _text(m.get("reasoning_content"), f"{what}.reasoning_content")
                or _text(m.get("reasoning"), f"{what}.reasoning")
                or ""
            )
            yield _Turn(
                "assistant",
                [("thinking", reasoning), ("text", _text_blocks(m.get("content"), f"{what}.content"))],
                calls=[
                    _openai_call(tc, f"{what}.tool_calls[{j}]")
                    for j, tc in enumerate(_list(m.get("tool_calls"), f"{what}.tool_calls"))
                ],
            )
        elif role == "tool":
            yield _Turn(
                "tool",
                [("text", _text_blocks(m.get("content"), f"{what}.content"))],
                name=_text(m.get("name"), f"{what}.name") or "unknown",
                call_id=_text(m.get("tool_call_id"), f"{what}.tool_call_id") or "",
            )
        else:
            yield _Turn(str(role), kept=False)


def _openai_call(call: Any, what: str) -> dict[str, Any]:
    fn = _obj(call, what).get("function")
    fn = {} if fn is None else _obj(fn, f"{what}.function")
    return _tool_call(
        call.get("id"), fn.get("name"), fn.get("arguments"), id_what=f"{what}.id", fn_what=f"{what}.function"
    )
