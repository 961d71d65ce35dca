"""Reading inputs: episode directories (result.json + Pi session JSONL) and OpenAI JSONL.

Conversion follows the original loader (``build_training_dataset.load_trajectory``) with
the fixes of DESIGN.md §4: thinking is read from the block's ``thinking`` key, ``plan`` is
kept, a null ``plan_score`` stays null, a malformed line names its file and line number.
Nothing here touches the database; ``ingest.py`` stores what this module returns.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from hcapo_store.errors import IngestError, SkipEpisode
from hcapo_store.ingestion import identity

SESSION_FILE = "pi_session.jsonl"
RESULT_FILE = "result.json"
TRUNCATION_SUFFIX = "\n... [truncated, {n} chars total]"
TOOL_ERROR_PREFIX = "[tool_error]"


@dataclass(frozen=True)
class ConvertOptions:
    """Options that change the converted messages (and so belong to the scorer identity)."""

    include_thinking: bool = True
    max_tool_result_chars: int = 4000

    def as_dict(self) -> dict[str, Any]:
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
    messages: list[dict[str, Any]]
    # Untruncated tool-result text per message index: transitions are judged on it (Q9).
    full_tool_text: dict[int, str]
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Source:
    """A lazily read input: ``load()`` returns a ParsedEpisode or raises Skip/IngestError.

    ``key`` and ``name`` are the episode's identity and readable name (ingestion/identity.py);
    ``path`` is the directory or file it was read from (stored as ``episodes.source_path``),
    ``location`` the same for messages (``path`` or ``path:line``).
    """

    key: str
    name: str
    path: str
    location: str
    content_hash: str
    load: Callable[[], ParsedEpisode]
    prefixes: tuple[str, ...] = ()  # the root's parent directory names, to make the name unique


# ---------------------------------------------------------------------------
# discovery


def iter_sources(paths: list[Path], options: ConvertOptions) -> Iterator[Source | IngestError]:
    """Yield sources in a stable order; an unreadable path yields its error instead."""
    for path in paths:
        path = Path(path)
        if not path.exists():
            yield IngestError("no such file or directory", path=str(path))
            continue
        path = path.resolve()  # names come from real directory names ("." too)
        if path.is_file():
            yield from _jsonl_sources(path, options, path)
        elif (path / RESULT_FILE).exists() or (path / SESSION_FILE).exists():
            yield _safe_dir_source(path, options, path)
        else:
            children = sorted(p for p in path.glob("episode_*") if p.is_dir())
            jsonl = sorted(p for p in path.glob("*.jsonl") if p.is_file())
            if not children and not jsonl:
                yield IngestError(
                    f"no episodes here: expected {RESULT_FILE} + {SESSION_FILE}, episode_* "
                    "directories, or *.jsonl files",
                    path=str(path),
                )
            for child in children:
                yield _safe_dir_source(child, options, path)
            for file in jsonl:
                yield from _jsonl_sources(file, options, path)


def _hash(options: ConvertOptions, *parts: bytes) -> str:
    h = hashlib.sha256(json.dumps(options.as_dict(), sort_keys=True).encode())
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IngestError(f"cannot read: {exc.strerror}", path=str(path)) from exc


def _safe_dir_source(directory: Path, options: ConvertOptions, root: Path) -> Source | IngestError:
    try:
        return _episode_dir_source(directory, options, root)
    except IngestError as exc:
        return exc


def _episode_dir_source(directory: Path, options: ConvertOptions, root: Path) -> Source:
    result_bytes = _read(directory / RESULT_FILE)
    session_bytes = _read(directory / SESSION_FILE)
    digest = _hash(options, result_bytes or b"", b"\x00" if session_bytes is None else session_bytes)

    def load() -> ParsedEpisode:
        return parse_episode_dir(directory, result_bytes, session_bytes, options, digest)

    return Source(key=identity.session_key(session_bytes), name=identity.label(directory, root),
                  path=str(directory), location=str(directory), content_hash=digest, load=load, prefixes=identity.ancestors(root))


@dataclass(frozen=True)
class _Line:
    lineno: int
    offset: int
    key: str
    ident: str | None
    digest: str


def _jsonl_sources(path: Path, options: ConvertOptions, root: Path) -> Iterator[Source | IngestError]:
    """One source per line. Lines of one file that share a key but differ are all refused:
    neither may silently supersede the other (identical repeats are one episode)."""
    try:
        lines = _index_jsonl(path, options)
    except OSError as exc:
        yield IngestError(f"cannot read: {exc.strerror}", path=str(path))
        return
    by_key: dict[str, list[_Line]] = {}
    for entry in lines:
        if isinstance(entry, _Line):
            by_key.setdefault(entry.key, []).append(entry)
    file_label, prefixes = identity.label(path, root), identity.ancestors(root)
    for entry in lines:
        if not isinstance(entry, _Line):
            yield entry
            continue
        same = by_key[entry.key]
        if len({e.digest for e in same}) > 1:
            where = ", ".join(str(e.lineno) for e in same)
            yield IngestError(f"lines {where} are the same episode ({entry.key}) with different contents: none is "
                              "stored; give each its own episode_id", path=str(path), line=entry.lineno)
            continue

        def load(entry: _Line = entry) -> ParsedEpisode:
            return parse_jsonl_line(path, entry.lineno, _line_at(path, entry, options), options, entry.digest)

        yield Source(key=entry.key, name=identity.jsonl_name(file_label, entry.ident, entry.lineno),
                     path=str(path), location=f"{path}:{entry.lineno}", content_hash=entry.digest, load=load, prefixes=prefixes)


def _index_jsonl(path: Path, options: ConvertOptions) -> list[_Line | IngestError]:
    """Every non-blank line's key and hash (the lines themselves are read again on load)."""
    out: list[_Line | IngestError] = []
    offset = 0
    with path.open("rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                key, ident = identity.jsonl_identity(path.name, line, _json_or_none(line))
            except identity.BadEpisodeId as exc:
                out.append(IngestError(str(exc), path=str(path), line=lineno))
                continue
            out.append(_Line(lineno, start, key, ident, _hash(options, line)))
    return out


def _line_at(path: Path, entry: _Line, options: ConvertOptions) -> bytes:
    try:
        with path.open("rb") as handle:
            handle.seek(entry.offset)
            line = handle.readline()
    except OSError as exc:
        raise IngestError(f"cannot read: {exc.strerror}", path=str(path), line=entry.lineno) from exc
    if _hash(options, line) != entry.digest:
        raise IngestError("the file changed while it was read: ingest it again", path=str(path), line=entry.lineno)
    return line


def _json_or_none(line: bytes) -> Any:
    """The parsed line, or None when it is not JSON (``load`` then reports it with its line)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


# ---------------------------------------------------------------------------
# episode directories


def _decode(data: bytes, path: Path, warnings: list[str]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        warnings.append(f"{path.name}: invalid UTF-8 at byte {exc.start} replaced (raw bytes kept)")
        return data.decode("utf-8", errors="replace")


def _compress(obj: dict[str, Any]) -> bytes:
    # ASCII JSON keeps surrogate-escaped invalid bytes recoverable: the raw source is
    # lossless (decode the strings with .encode("utf-8", "surrogateescape")).
    return zlib.compress(json.dumps(obj).encode("ascii"), 6)


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
    result = _load_json_object(_decode(result_bytes, result_path, warnings), result_path)
    if result.get("episode_reward") is None:
        reason = "no reward yet"
        if result.get("error"):
            reason += f" (episode failed: {str(result['error'])[:120]})"
        raise SkipEpisode(reason)
    if session_bytes is None:
        raise SkipEpisode(f"no {SESSION_FILE}")
    session_text = _decode(session_bytes, session_path, warnings)
    if not session_text.strip():
        raise SkipEpisode(f"empty {SESSION_FILE}")
    entries, fmt = parse_pi_session(session_text, session_path, warnings)
    messages, full_tool_text = convert_pi_entries(entries, options, warnings)
    outcome = _outcome(result, result_path)
    raw = _compress({"result.json": result_bytes.decode("utf-8", "surrogateescape"),
                     SESSION_FILE: session_bytes.decode("utf-8", "surrogateescape")})
    return _finish(
        source_format=fmt, digest=digest, raw=raw,
        outcome=outcome, messages=messages, full_tool_text=full_tool_text, warnings=warnings,
    )


def _load_json_object(text: str, path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise IngestError(f"invalid JSON: {exc.msg} (column {exc.colno})", path=str(path), line=exc.lineno) from exc
    if not isinstance(obj, dict):
        raise IngestError(f"expected a JSON object, got {type(obj).__name__}", path=str(path))
    return obj


def _number(value: Any, what: str, path: Path, *, nullable: bool) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise IngestError(f"{what} must be a number, got {value!r}", path=str(path))
    return float(value)


def _outcome(result: dict[str, Any], path: Path) -> dict[str, Any]:
    frozen = result.get("frozen_scores") or {}
    if not isinstance(frozen, dict):
        raise IngestError(f"frozen_scores must be an object, got {type(frozen).__name__}", path=str(path))
    plan = result.get("plan") or []
    if not isinstance(plan, list) or not all(isinstance(p, dict) and "id" in p for p in plan):
        raise IngestError("plan must be a list of objects with an 'id'", path=str(path))
    ext = result.get("episode_id")
    return {
        "external_id": None if ext is None else str(ext),
        "reward": _number(result.get("episode_reward", result.get("reward")), "episode_reward", path, nullable=False),
        "phase": result.get("phase"),
        "plan_score": _number(result.get("plan_score"), "plan_score", path, nullable=True),
        "frozen_scores": {str(k): _number(v, f"frozen_scores[{k}]", path, nullable=False) for k, v in frozen.items()},
        "plan": plan,
        "turns": result.get("turns") if isinstance(result.get("turns"), int) else None,
        "tool_call_count": result.get("tool_call_count") if isinstance(result.get("tool_call_count"), int) else None,
        "reward_backfilled": bool(result.get("_reward_backfilled", False)),
    }


def _finish(*, source_format: str, digest: str, raw: bytes,
            outcome: dict[str, Any], messages: list[dict[str, Any]], full_tool_text: dict[int, str],
            warnings: list[str]) -> ParsedEpisode:
    if len(messages) < 2:
        raise SkipEpisode(f"fewer than 2 messages after conversion ({len(messages)})")
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipEpisode("no assistant messages")
    if outcome["plan_score"] is None:
        warnings.append("plan_score is null: planning steps get no dense reward (treated as 0 in credits)")
    return ParsedEpisode(
        source_format=source_format, content_hash=digest,
        raw_source=raw, messages=messages, full_tool_text=full_tool_text, warnings=warnings, **outcome,
    )


# ---------------------------------------------------------------------------
# Pi session JSONL


def parse_pi_session(text: str, path: Path, warnings: list[str]) -> tuple[list[dict[str, Any]], str]:
    """Parse the session lines; return (entries, "pi_v1"|"pi_v2"|"pi_v3").

    A malformed line fails the episode with its line number, except a truncated LAST
    line without a newline (the writer was killed mid-line): that entry is dropped
    with a warning, since everything before it is intact.
    """
    lines = text.split("\n")
    entries: list[dict[str, Any]] = []
    version: int | None = None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                warnings.append(f"{path.name}:{lineno}: truncated last line dropped ({exc.msg})")
                continue
            raise IngestError(f"malformed JSON line: {exc.msg} (column {exc.colno})", path=str(path), line=lineno) from exc
        if not isinstance(entry, dict):
            raise IngestError(f"expected a JSON object, got {type(entry).__name__}", path=str(path), line=lineno)
        if entry.get("type") == "session" and not entries:
            version = entry.get("version") if isinstance(entry.get("version"), int) else 1
        entries.append(entry)
    if version is None:
        warnings.append(f"{path.name}: no session header; read as Pi session v1")
        version = 1
    return entries, f"pi_v{version}"


def _text_blocks(content: Any) -> str:
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        parts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        return "\n".join(p for p in parts if isinstance(p, str)).strip()
    return "" if content is None else str(content).strip()


def _arguments_json(args: Any) -> str:
    if isinstance(args, str):
        return args
    if args is None:
        return "{}"
    return json.dumps(args, ensure_ascii=False)


def _truncate(text: str, limit: int) -> str:
    if limit > 0 and len(text) > limit:
        return text[:limit] + TRUNCATION_SUFFIX.format(n=len(text))
    return text


def _error_prefixed(text: str, is_error: bool) -> str:
    if not is_error:
        return text
    return f"{TOOL_ERROR_PREFIX}\n{text}" if text else TOOL_ERROR_PREFIX


def convert_pi_entries(
    entries: list[dict[str, Any]], options: ConvertOptions, warnings: list[str]
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Pi entries → OpenAI-style messages, in file order (compaction and non-messages skipped)."""
    messages: list[dict[str, Any]] = []
    full_tool_text: dict[int, str] = {}
    dropped_roles: dict[str, int] = {}
    for entry in entries:
        if entry.get("type") != "message":
            continue
        msg = entry.get("message")
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role == "user":
            text = _text_blocks(msg.get("content"))
            if text:
                messages.append({"role": "user", "content": text})
        elif role == "assistant":
            converted = _convert_assistant(msg.get("content"), options)
            if converted is not None:
                messages.append(converted)
        elif role == "toolResult":
            text = _text_blocks(msg.get("content"))
            is_error = bool(msg.get("isError"))
            full_tool_text[len(messages)] = _error_prefixed(text, is_error)
            messages.append({
                "role": "tool",
                "name": msg.get("toolName") or "unknown",
                "tool_call_id": msg.get("toolCallId") or "",
                "content": _error_prefixed(_truncate(text, options.max_tool_result_chars), is_error),
            })
        else:
            dropped_roles[str(role)] = dropped_roles.get(str(role), 0) + 1
    for role, n in sorted(dropped_roles.items()):
        warnings.append(f"{n} message(s) of role {role!r} dropped (not part of the model's context)")
    return messages, full_tool_text


def _convert_assistant(content: Any, options: ConvertOptions) -> dict[str, Any] | None:
    if not isinstance(content, list):
        text = "" if content is None else str(content).strip()
        return {"role": "assistant", "content": text} if text else None
    parts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "thinking" and options.include_thinking:
            # The original read block["text"] here and so never kept thinking (Q2).
            thinking = (block.get("thinking") or "").strip()
            if thinking:
                parts.append(f"<think>\n{thinking}\n</think>")
        elif kind == "text":
            text = (block.get("text") or "").strip()
            if text:
                parts.append(text)
        elif kind == "toolCall":
            args = block.get("arguments", block.get("input"))
            calls.append({
                "id": block.get("id") or "",
                "type": "function",
                "function": {"name": block.get("name") or "unknown", "arguments": _arguments_json(args)},
            })
    text = "\n\n".join(parts).strip()
    if not text and not calls:
        return None
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = calls
    return out


# ---------------------------------------------------------------------------
# OpenAI-format JSONL (one episode per line)


def parse_jsonl_line(path: Path, lineno: int, line: bytes, options: ConvertOptions, digest: str) -> ParsedEpisode:
    warnings: list[str] = []
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "invalid UTF-8"
        raise IngestError(f"malformed JSON line: {msg}", path=str(path), line=lineno) from exc
    if not isinstance(obj, dict):
        raise IngestError("expected a JSON object per line", path=str(path), line=lineno)
    if obj.get("reward", obj.get("episode_reward")) is None:
        raise SkipEpisode("no reward yet")
    raw_messages = obj.get("messages")
    if not isinstance(raw_messages, list):
        raise IngestError("'messages' must be a list", path=str(path), line=lineno)
    where = Path(f"{path}:{lineno}")
    outcome = _outcome({**obj, "episode_reward": obj.get("reward", obj.get("episode_reward"))}, where)
    messages, full_tool_text = convert_openai_messages(raw_messages, options, warnings)
    return _finish(
        source_format="openai_jsonl",
        digest=digest, raw=zlib.compress(line, 6), outcome=outcome, messages=messages,
        full_tool_text=full_tool_text, warnings=warnings,
    )


def convert_openai_messages(
    raw: list[Any], options: ConvertOptions, warnings: list[str]
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    messages: list[dict[str, Any]] = []
    full_tool_text: dict[int, str] = {}
    dropped: dict[str, int] = {}
    for m in raw:
        role = m.get("role") if isinstance(m, dict) else None
        if role in ("system", "user"):
            text = _text_blocks(m.get("content"))
            if text:
                messages.append({"role": role, "content": text})
        elif role == "assistant":
            parts = []
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if options.include_thinking and isinstance(reasoning, str) and reasoning.strip():
                parts.append(f"<think>\n{reasoning.strip()}\n</think>")
            text = _text_blocks(m.get("content"))
            if text:
                parts.append(text)
            calls = []
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function", {}) if isinstance(tc, dict) else {}
                calls.append({
                    "id": tc.get("id") or "",
                    "type": "function",
                    "function": {"name": fn.get("name") or "unknown", "arguments": _arguments_json(fn.get("arguments"))},
                })
            content = "\n\n".join(parts).strip()
            if content or calls:
                out: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    out["tool_calls"] = calls
                messages.append(out)
        elif role == "tool":
            text = _text_blocks(m.get("content"))
            full_tool_text[len(messages)] = text
            messages.append({
                "role": "tool",
                "name": m.get("name") or "unknown",
                "tool_call_id": m.get("tool_call_id") or "",
                "content": _truncate(text, options.max_tool_result_chars),
            })
        else:
            dropped[str(role)] = dropped.get(str(role), 0) + 1
    for role, n in sorted(dropped.items()):
        warnings.append(f"{n} message(s) of role {role!r} dropped")
    return messages, full_tool_text
