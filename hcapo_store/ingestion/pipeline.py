"""Incremental ingest: sources → episodes, messages, steps, subtasks, tags.

Keyed by the episode's identity + content hash (ingestion/episode_keys.py): an unchanged episode
is a no-op wherever its files sit now, a changed one becomes a new version (the old version
stays, marked not current, with its scores) under the same name. Two sources with one
identity but different contents in one ingest are a conflict: the later one fails, naming
the earlier (nothing supersedes silently). Each episode
is parsed completely before anything is written, and episodes are committed in small
batches, so an interrupt (Ctrl-C, kill) loses at most the uncommitted batch and never
leaves half an episode. Sources are read at most two chunks ahead (parallel.py parses them
in worker processes meanwhile) and stored one at a time, in order: memory does not grow with
the number of episodes.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, SQLAlchemyError

from hcapo_store.clock import utcnow
from hcapo_store.errors import IngestError, SkipEpisode, UsageError
from hcapo_store.ingestion import episode_keys
from hcapo_store.ingestion.discovery import JsonlCursor, NoEpisodesHere, Source, iter_sources
from hcapo_store.ingestion.parallel import default_jobs, parse_ahead
from hcapo_store.ingestion.parsing import ConvertOptions, MessageRow, ParsedEpisode
from hcapo_store.storage import db
from hcapo_store.storage.bulk import insert_rows
from hcapo_store.storage.models import TAG_KEY_LENGTH, Episode, Message, Step, Subtask, Tag
from hcapo_store.storage.once import insert_once
from hcapo_store.storage.store import Store
from hcapo_store.tool_arguments import dumps_text

# rows go to the driver as tuples (storage/bulk.py): the message row's fields are MessageRow's
MESSAGE_COLUMNS = ("episode_id", "message_index", *MessageRow._fields)
STEP_COLUMNS = ("episode_id", "step_index", "message_index", "phase", "subtask_id", "subtask_reward")
BATCH_EPISODES = 64
BATCH_SECONDS = 1.0
MAX_LISTED = 200  # failures/skips/warnings listed by name; counts are always complete
STORE_TRIES = 5  # looks again after another writer stored the same key (or name) first
MAX_KEY_BYTES = 2000  # PostgreSQL's btree refuses index rows over ~2700 bytes
WARNINGS_QUERY = "SELECT name, warnings FROM episodes WHERE is_current AND warnings IS NOT NULL"


@dataclass
class IngestReport:
    new: int = 0
    changed: int = 0
    unchanged: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    failed: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (source, message)
    skips: list[tuple[str, str]] = field(default_factory=list)
    warnings: int = 0
    warning_list: list[tuple[str, str]] = field(default_factory=list)  # (episode name, warning)
    steps: int = 0
    interrupted: bool = False
    # Unchanged sources first read from another place (a copied or moved tree): (source, name).
    elsewhere: list[tuple[str, str]] = field(default_factory=list)
    elsewhere_count: int = 0
    # Changed sources whose episode was read from another place: a corrected copy, or (JSONL
    # ids are scoped by file name) another run's same-named file. Said, never silent.
    changed_elsewhere: list[tuple[str, str]] = field(default_factory=list)
    changed_elsewhere_count: int = 0

    @property
    def seen(self) -> int:
        return self.new + self.changed + self.unchanged + sum(self.skipped.values()) + self.failed

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{reason}: {n}" for reason, n in self.skipped.most_common())
        line = (
            f"{self.new} new, {self.changed} changed, {self.unchanged} unchanged, "
            f"{skipped} skipped{f' ({reasons})' if reasons else ''}, {self.failed} failed"
        )
        if self.elsewhere_count:
            source, name = self.elsewhere[0]
            line += f"; {self.elsewhere_count} unchanged already stored from another place (e.g. {source} is {name})"
        if self.changed_elsewhere_count:
            source, name = self.changed_elsewhere[0]
            line += (
                f"; {self.changed_elsewhere_count} changed an episode read from another place "
                f"(e.g. {source} is a new version of {name}; if it is another episode, give it its own id)"
            )
        if self.warnings:
            line += f'; {self.warnings} warning(s) stored with the episodes (hcapo-store sql "{WARNINGS_QUERY}")'
        return line + (" — interrupted" if self.interrupted else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "new": self.new,
            "changed": self.changed,
            "unchanged": self.unchanged,
            "skipped": sum(self.skipped.values()),
            "skipped_reasons": dict(self.skipped),
            "failed": self.failed,
            "failures": [{"source": s, "error": e} for s, e in self.failures],
            "skips": [{"source": s, "reason": r} for s, r in self.skips],
            "warnings": self.warnings,
            "warning_list": [{"episode": n, "warning": w} for n, w in self.warning_list],
            "steps": self.steps,
            "interrupted": self.interrupted,
            "already_stored": [{"source": s, "name": n} for s, n in self.elsewhere],
            "changed_elsewhere": [{"source": s, "name": n} for s, n in self.changed_elsewhere],
        }


@dataclass(frozen=True)
class SourceOutcome:
    """What became of one source (``ingest(on_outcome=...)``): ``follow`` keeps its batches'
    members by these. ``episode_id`` is the stored current version (new, changed, unchanged);
    ``reason`` the failure or skip message."""

    location: str  # path, or path:line of a JSONL line
    path: str  # the directory or file
    outcome: str  # new | changed | unchanged | skipped | failed
    reason: str | None = None
    episode_id: int | None = None
    elsewhere: bool = False  # unchanged, but stored from another place


def _reason_class(reason: str) -> str:
    """Group skip reasons for the summary ("no reward yet (episode failed: …)" → "no reward yet")."""
    return reason.split(" (", 1)[0]


@dataclass
class _Pending:
    """Counts of the open batch; folded into the report only when the batch commits."""

    new: int = 0
    changed: int = 0
    steps: int = 0
    warnings: int = 0
    changed_elsewhere: list[tuple[str, str]] = field(default_factory=list)
    listed: list[tuple[str, str]] = field(default_factory=list)
    outcomes: list[SourceOutcome] = field(default_factory=list)  # this batch's, told once it commits


def ingest(
    store: Store,
    paths: Iterable[Path | str],
    *,
    options: ConvertOptions = ConvertOptions(),
    tags: dict[str, str] | None = None,
    on_episode: Callable[[str, str], None] | None = None,
    name_root: Path | str | None = None,
    jobs: int | None = None,
    cursors: dict[Path, JsonlCursor] | None = None,
    roots: list[Path] | None = None,
    on_outcome: Callable[[SourceOutcome], None] | None = None,
    input_format: str | None = None,
) -> IngestReport:
    """Ingest every episode under ``paths``; one bad source never stops the others.

    ``on_episode(source, outcome)`` is called after each source (for progress display).
    ``name_root``: name episodes relative to this directory when they are inside it.
    ``jobs``: worker processes that parse episodes while this one stores them (default: one
    per core; 1 parses here). The result does not depend on it.
    ``cursors``, ``roots``: see ``discovery.iter_sources`` (``follow`` reads growing JSONL
    files from where it stopped, and no link out of its folders). ``on_outcome`` is called
    with each source's ``SourceOutcome`` once its batch is committed. ``input_format``: files
    given are JSON arrays in this format (``discovery.INPUT_FORMATS``), not JSONL.
    """
    tags = dict(tags or {})
    check_tags(tags)
    if jobs is not None and jobs < 1:
        raise UsageError(f"jobs must be at least 1, got {jobs}")
    report = IngestReport()
    found = iter_sources(
        [Path(p) for p in paths],
        options,
        None if name_root is None else Path(name_root),
        cursors=cursors,
        roots=roots,
        input_format=input_format,
    )
    sources = parse_ahead(
        found, jobs=default_jobs() if jobs is None else jobs, stored=lambda chunk: _stored(store, chunk)
    )
    seen: dict[str, tuple[str, str]] = {}  # key -> (content hash, location) in this ingest
    with closing(sources):  # stops the parse workers, however ingest ends
        try:
            while True:
                pending = _Pending()
                with db.write(store.engine) as conn:  # an interrupt rolls the open batch back
                    more = _ingest_batch(conn, sources, options, tags, report, pending, on_episode, seen)
                _fold(report, pending)
                if on_outcome is not None:
                    for outcome in pending.outcomes:
                        on_outcome(outcome)
                if not more:
                    return report
        except KeyboardInterrupt:
            report.interrupted = True
            return report


def _stored(store: Store, chunk: list[Source]) -> set[tuple[str, str]]:
    """(key, content hash) of the chunk's sources stored as current: not worth parsing ahead."""
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(Episode.source_key, Episode.content_hash).where(
                Episode.is_current, Episode.source_key.in_({s.key for s in chunk})
            )
        )
        return {(key, digest) for key, digest in rows}


def _ingest_batch(
    conn: Connection,
    sources: Iterator[Source | IngestError],
    options: ConvertOptions,
    tags: dict[str, str],
    report: IngestReport,
    pending: _Pending,
    on_episode: Callable[[str, str], None] | None,
    seen: dict[str, tuple[str, str]],
) -> bool:
    """Ingest sources until the batch is full (True) or the sources run out (False)."""
    started = time.monotonic()
    written = 0
    for item in sources:
        result = _ingest_one(conn, item, options, tags, report, pending, seen)
        pending.outcomes.append(result)
        outcome = result.outcome
        if on_episode is not None and not isinstance(item, NoEpisodesHere):
            on_episode(item.location if isinstance(item, Source) else str(item.path or item), outcome)
        if outcome in ("new", "changed"):
            written += 1
        if written >= BATCH_EPISODES or (written and time.monotonic() - started > BATCH_SECONDS):
            return True
    return False


def _fold(report: IngestReport, pending: _Pending) -> None:
    report.new += pending.new
    report.changed += pending.changed
    report.steps += pending.steps
    report.warnings += pending.warnings
    report.changed_elsewhere_count += len(pending.changed_elsewhere)
    room = MAX_LISTED - len(report.changed_elsewhere)
    report.changed_elsewhere.extend(pending.changed_elsewhere[: max(room, 0)])
    report.warning_list += pending.listed[: MAX_LISTED - len(report.warning_list)]


def _ingest_one(
    conn: Connection,
    item: Source | IngestError,
    options: ConvertOptions,
    tags: dict[str, str],
    report: IngestReport,
    pending: _Pending,
    seen: dict[str, tuple[str, str]],
) -> SourceOutcome:
    if isinstance(item, IngestError):
        _fail(report, str(item.path or ""), str(item))
        where = str(item.path or "") + ("" if item.line is None else f":{item.line}")
        return SourceOutcome(where, str(item.path or ""), "failed", str(item))
    where = item.location
    problem = _key_problem(item.key)
    if problem:
        _fail(report, where, problem)
        return SourceOutcome(where, item.path, "failed", problem)
    first = seen.get(item.key)  # only stored (or unchanged) sources count: a skipped one claims nothing
    if first is not None and first[0] != item.content_hash:
        why = (
            f"{where}: same episode as {first[1]} ({item.key}) with different "
            "content: not stored (give each episode its own id)"
        )
        _fail(report, where, why)
        return SourceOutcome(where, item.path, "failed", why)
    parsed: ParsedEpisode | None = None
    name = ""  # set together with parsed
    stored_id: int | None = None
    try:
        # A savepoint per episode: a database error on this episode undoes only this episode.
        with conn.begin_nested():
            for _ in range(STORE_TRIES):
                latest = _latest(conn, item.key)
                current = latest if latest is not None and latest.is_current else None
                if current is not None and item.is_stored_as(current.content_hash):
                    if tags:
                        _set_tags(conn, current.id, tags)
                    break
                if parsed is None:
                    parsed = item.load()
                # One name for all versions of an episode; a new episode gets a free one.
                name = latest.name if latest is not None else _free_name(conn, item)
                stored_id = _store_version(conn, parsed, item, name, latest, current, options, tags)
                if stored_id is not None:
                    break
                # Another writer stored this version (or took this name) first: look again.
            else:
                raise IngestError(
                    f"other writers stored this episode's key or name first {STORE_TRIES} times in a row: "
                    "not stored (ingest it again)",
                    path=where,
                )
    except SkipEpisode as exc:
        report.skipped[_reason_class(str(exc))] += 1
        if len(report.skips) < MAX_LISTED:
            report.skips.append((where, str(exc)))
        return SourceOutcome(where, item.path, "skipped", str(exc))
    except IngestError as exc:
        _fail(report, where, str(exc))
        return SourceOutcome(where, item.path, "failed", str(exc))
    except SQLAlchemyError as exc:
        if not _caused_by_episode(exc):
            raise
        why = f"{where}: the database refused this episode: {_first_line(exc)}"
        _fail(report, where, why)
        return SourceOutcome(where, item.path, "failed", why)
    if stored_id is None:
        assert current is not None  # unchanged: the current version holds this content
        seen.setdefault(item.key, (item.content_hash, where))
        _unchanged(report, item, current)
        return SourceOutcome(
            where, item.path, "unchanged", episode_id=int(current.id), elsewhere=current.source_path != item.path
        )
    assert parsed is not None  # stored: parsed to be written
    seen[item.key] = (item.content_hash, where)
    pending.steps += len(parsed.steps)
    pending.warnings += len(parsed.warnings)
    pending.listed += [(name, w) for w in parsed.warnings[: MAX_LISTED - len(pending.listed)]]
    if latest is None:
        pending.new += 1
        return SourceOutcome(where, item.path, "new", episode_id=stored_id)
    pending.changed += 1
    if latest.source_path != item.path:
        pending.changed_elsewhere.append((where, latest.name))
    return SourceOutcome(where, item.path, "changed", episode_id=stored_id, elsewhere=latest.source_path != item.path)


def _unchanged(report: IngestReport, item: Source, current: Any) -> None:
    report.unchanged += 1
    if current.source_path != item.path:
        report.elsewhere_count += 1
        if len(report.elsewhere) < MAX_LISTED:
            report.elsewhere.append((item.location, current.name))


def _free_name(conn: Connection, item: Source) -> str:
    """The first of the source's name candidates that no other episode has."""
    for name in episode_keys.name_candidates(item.name, item.prefixes):
        if conn.execute(select(Episode.id).where(Episode.name == name).limit(1)).first() is None:
            return name
    raise AssertionError("unreachable: name candidates are endless")  # pragma: no cover


def _latest(conn: Connection, key: str) -> Any:
    """The key's latest version: current unless every version was retired by hand (SQL)."""
    return conn.execute(
        select(Episode.id, Episode.content_hash, Episode.version, Episode.name, Episode.is_current, Episode.source_path)
        .where(Episode.source_key == key)
        .order_by(Episode.version.desc())
        .limit(1)
    ).first()


def _store_version(
    conn: Connection,
    parsed: ParsedEpisode,
    item: Source,
    name: str,
    latest: Any,
    current: Any,
    options: ConvertOptions,
    tags: dict[str, str],
) -> int | None:
    """The new version's id, or None when another writer stored this key's version (or an
    episode with this name) first: nothing was written, the caller looks again."""
    episode_id = _insert_episode(
        conn, parsed, options, source=item, name=name, version=1 if latest is None else latest.version + 1
    )
    if episode_id is None:
        return None
    if current is not None:
        conn.execute(update(Episode).where(Episode.id == current.id).values(is_current=False))
        old_tags = conn.execute(select(Tag.key, Tag.value).where(Tag.episode_id == current.id)).all()
        _set_tags(conn, episode_id, {k: v for k, v in old_tags})
    if tags:
        _set_tags(conn, episode_id, tags)
    return episode_id


def _key_problem(key: str) -> str | None:
    """Keys every database can store and index (PostgreSQL refuses NUL and over-long index rows)."""
    if "\x00" in key:
        return "its episode key contains a NUL character (\\u0000)"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"its episode key is longer than {MAX_KEY_BYTES} bytes"
    return None


def _caused_by_episode(exc: SQLAlchemyError) -> bool:
    """A database error due to this episode's values, not to the database or the connection."""
    if isinstance(exc, (DataError, IntegrityError)):
        return True
    # PostgreSQL class 54 (program limit exceeded: e.g. an index row too large), SQLite "too big".
    orig = getattr(exc, "orig", None)
    return isinstance(exc, OperationalError) and (
        str(getattr(orig, "sqlstate", "") or "").startswith("54") or "too big" in str(orig)
    )


def _first_line(exc: SQLAlchemyError) -> str:
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0]


def _fail(report: IngestReport, source: str, message: str) -> None:
    report.failed += 1
    if len(report.failures) < MAX_LISTED:
        report.failures.append((source, message))


def check_tags(tags: dict[str, str]) -> None:
    """Refuse, before anything is read, tags that a database column cannot hold."""
    for key, value in tags.items():
        if not key or len(key) > TAG_KEY_LENGTH:
            raise UsageError(
                f"tag key {key[:40]!r}{'…' if len(key) > 40 else ''} is {len(key)} characters long: "
                f"a tag key has 1 to {TAG_KEY_LENGTH} characters"
            )
        if "\x00" in key + value:
            raise UsageError(f"tag {key[:40]!r} contains a NUL character, which databases cannot store")
        try:
            (key + value).encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are no UTF-8 (surrogate-escaped)
            shown = key.encode("utf-8", "backslashreplace").decode()[:40]
            raise UsageError(f"tag {shown!r} is not valid UTF-8 text; databases store text: pass it as UTF-8") from None


def _set_tags(conn: Connection, episode_id: int, tags: dict[str, str]) -> None:
    if not tags:
        return
    conn.execute(delete(Tag).where(Tag.episode_id == episode_id, Tag.key.in_(list(tags))))
    conn.execute(insert(Tag), [{"episode_id": episode_id, "key": k, "value": v} for k, v in tags.items()])


def _insert_episode(
    conn: Connection, ep: ParsedEpisode, options: ConvertOptions, *, source: Source, name: str, version: int
) -> int | None:
    """Insert once (storage/once.py): two ingesters of the same episode version never see an
    error; the one that comes second gets None (on PostgreSQL after the first one commits)."""
    episode_id = insert_once(
        conn,
        "episodes",
        {
            "source_key": source.key,
            "source_path": source.path,
            "version": version,
            "is_current": True,
            "content_hash": ep.content_hash,
            "source_format": ep.source_format,
            "external_id": ep.external_id,
            "name": name,
            "reward": ep.reward,
            "phase": ep.phase,
            "plan_score": ep.plan_score,
            "frozen_scores": json.dumps(ep.frozen_scores),
            "turns": ep.turns,
            "tool_call_count": ep.tool_call_count,
            "reward_backfilled": ep.reward_backfilled,
            "include_thinking": options.include_thinking,
            "max_tool_result_chars": options.max_tool_result_chars,
            "num_messages": len(ep.messages),
            "num_steps": len(ep.steps),
            "warnings": json.dumps(ep.warnings) if ep.warnings else None,
            "raw_source": ep.raw_source,
            "ingested_at": utcnow().isoformat(timespec="seconds"),
        },
        unique=None,  # key+version or name+version: whichever a racing writer took first
    )
    if episode_id is None:
        return None
    episode_id = int(episode_id)
    insert_rows(
        conn,
        Message,
        MESSAGE_COLUMNS,
        [(episode_id, i, *m) for i, m in enumerate(ep.messages)],
    )
    insert_rows(
        conn,
        Step,
        STEP_COLUMNS,
        [(episode_id, s.step_index, s.message_index, s.phase, s.subtask_id, s.subtask_reward) for s in ep.steps],
    )
    if ep.plan:
        conn.execute(
            insert(Subtask),
            [
                {
                    "episode_id": episode_id,
                    "position": pos,
                    "subtask_id": str(p["id"]),
                    "description": _text_or_none(p.get("description")),
                    "acceptance_criteria": _text_or_none(p.get("acceptance_criteria")),
                    "frozen_score": ep.frozen_scores.get(str(p["id"])),
                }
                for pos, p in enumerate(ep.plan)
            ],
        )
    return episode_id


def _text_or_none(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else dumps_text(value)
