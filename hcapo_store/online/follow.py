"""Follow a collection as it is written: ingest, score, and publish each batch's credits.

One ``cycle``:

1. **scan** the paths (``stat`` only): episode directories (a ``result.json`` or a session
   file) and JSONL files, each with a signature of sizes and modification times; only the
   new and changed ones go to ingest. An episode whose ``result.json`` has no reward yet is
   *waiting* (ingest skips it; it is read again when it changes), as is a JSONL file's last
   line before its newline.
2. **ingest** those (the normal pipeline: versions, identity, one bad file never the batch).
3. **score** the missing steps of the episodes under the paths with the follower's scorer
   (the normal leased queue: several followers on one PostgreSQL database share it; a
   killed one's leases come back).
4. **publish** every complete batch: the current episodes under the paths sharing a key
   (``parent``: the directory that holds them; ``tag:KEY``: a tag's value), at least
   ``group_size`` of them, every step scored or failed for good (or, after
   ``batch_timeout`` seconds, whatever is there). Its credits are a credit run over exactly
   those episode versions (``compute_credits(episodes=...)``: the batch's own group
   statistics); its row in ``batches`` is the change feed. The batch's identity is its run's
   hash (scorer + parameters + episode versions), unique in the table: nothing is
   published twice, by a restarted follower or by two at once. When an episode changes
   after publication its batch is published again under a new id and the old row is
   marked ``superseded``.

Everything a cycle did is in the database before it returns, so ``kill -9`` loses at most
the cycle in flight, which the next start redoes from the database.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import stat
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from hcapo_store.canonical import canonical_json
from hcapo_store.clock import utcnow
from hcapo_store.credits.compute import compute_credits, scoped_run_hash
from hcapo_store.credits.equations import CreditParams
from hcapo_store.errors import CreditError, InferenceError, IngestError, StoreError, UsageError
from hcapo_store.ingestion.fields import source_field as _source_field
from hcapo_store.ingestion.files import lstat_or_none, outside, read_regular, why_unreadable
from hcapo_store.ingestion.pipeline import IngestReport, SourceOutcome, ingest
from hcapo_store.ingestion.sources import (
    MAX_RESULT_BYTES,
    RESULT_FILE,
    SESSION_FILE,
    ConvertOptions,
    JsonlCursor,
)
from hcapo_store.online.batches import BatchInfo, BatchMember, FailedEpisode, failed_json
from hcapo_store.scoring.health import PROBE_SECONDS
from hcapo_store.scoring.job import Prepared, run_scoring, run_sync
from hcapo_store.scoring.scheduler import RunOptions, ScoreReport
from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

Signature = tuple[tuple[int, int], ...]
MAX_LISTED = 200


@dataclass
class FollowConfig:
    paths: Sequence[Path]
    group_size: int
    batch_by: str = "parent"  # parent | tag:KEY | field:NAME (of result.json, or of the JSONL line)
    batch_timeout: float | None = None  # seconds after a batch's last arrival: publish what is there
    params: CreditParams = field(default_factory=CreditParams)
    conversion: ConvertOptions = field(default_factory=ConvertOptions)
    follow_links: bool = False  # read symbolic links that lead out of ``paths`` (refused by default)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise UsageError(f"--group-size must be at least 1, not {self.group_size}")
        kind, _, name = self.batch_by.partition(":")
        if self.batch_by != "parent" and not (kind in ("tag", "field") and name):
            raise UsageError(f"--batch-by {self.batch_by!r}: use parent, tag:KEY or field:NAME")
        self.paths = [Path(p).resolve() for p in self.paths]


@dataclass
class FollowStatus:
    """What the live line shows."""

    seen: int = 0
    waiting: int = 0
    ingested: int = 0
    scored: int = 0
    failed: int = 0
    ingest_failed: int = 0
    batches: int = 0
    last_lag: float | None = None
    known_elsewhere: int = 0  # unchanged episodes first stored from another place
    # What to print, drained by the caller (the CLI, each cycle); at most MAX_LISTED kept
    # between drains, the rest counted in ``unlisted``: memory stays bounded in a week's run.
    failures: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # e.g. waiting for the server
    unlisted: int = 0

    def fail(self, message: str) -> None:
        self._add(self.failures, message)

    def notice(self, message: str) -> None:
        self._add(self.notices, message)

    def _add(self, into: list[str], message: str) -> None:
        if len(into) < MAX_LISTED:
            into.append(message)
        else:
            self.unlisted += 1

    def line(self) -> str:
        lag = "—" if self.last_lag is None else f"{self.last_lag:.1f} s"
        known = f" · {self.known_elsewhere} already stored from another place" if self.known_elsewhere else ""
        return (
            f"follow: {self.seen} seen · {self.waiting} waiting · {self.ingested} ingested{known} · "
            f"{self.scored} scored · {self.failed + self.ingest_failed} failed · {self.batches} batch(es) ready · "
            f"lag {lag}"
        )


@dataclass
class CycleReport:
    changed: int = 0  # sources sent to ingest
    ingest: IngestReport | None = None
    score: ScoreReport | None = None
    published: list[BatchInfo] = field(default_factory=list)
    busy: bool = False  # something was ingested, scored or published


# ---- scanning ----------------------------------------------------------------------------


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_size)


@dataclass
class Scan:
    """What one look at the paths found (``stat`` only, nothing read)."""

    found: dict[Path, Signature] = field(default_factory=dict)  # episode directories and JSONL files
    refused: dict[Path, str] = field(default_factory=dict)  # entries that are not read, and why


def scan(paths: Sequence[Path], *, follow_links: bool = False) -> Scan:
    """Episode directories and JSONL files under ``paths`` with their signatures; a FIFO,
    device or socket, a broken link, or (unless ``follow_links``) a link out of the paths is
    refused by name. Nothing is opened: a FIFO cannot block a look."""
    out = Scan()
    roots = [Path(p) for p in paths]

    def check_file(path: Path) -> str | None:
        if not follow_links and (real := outside(path, roots)) is not None:
            return f"a symbolic link out of the followed folders (to {real}): not read (--follow-links reads it)"
        own = lstat_or_none(path)
        if own is None:
            return None  # not there (yet)
        return why_unreadable(path)

    def visit(path: Path, *, top: bool) -> None:
        own = lstat_or_none(path)
        if own is None:
            return
        if not stat.S_ISDIR(own.st_mode) and not (top and stat.S_ISLNK(own.st_mode)):
            if path.name.endswith(".jsonl") and path.name != SESSION_FILE:
                why = check_file(path)
                if why is None and not stat.S_ISREG(path.stat().st_mode):
                    why = "not a regular file"
                if why is not None:
                    out.refused[path] = why
                else:
                    out.found[path] = (_stat(path),)
            return
        if not path.is_dir():
            return
        result, session = path / RESULT_FILE, path / SESSION_FILE
        if lstat_or_none(result) is not None or lstat_or_none(session) is not None:
            why = check_file(result) or check_file(session)
            if why is not None:
                out.refused[path] = why
            else:
                out.found[path] = (_stat(result), _stat(session))
            return
        try:
            children = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:  # mode 000: one entry's failure, never the scan's
            out.refused[path] = f"cannot list this folder: {exc.strerror}"
            return
        for child in children:
            try:
                is_dir = child.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir or child.name.endswith(".jsonl"):
                visit(Path(child.path), top=False)

    for p in roots:
        visit(p, top=True)
    return out


def _result_state(directory: Path, roots: Sequence[Path] | None) -> str | None:
    """``None`` when the episode's result.json has a reward (or an error: the collector gave
    up on it, ingest says so); else why it waits. Read through the one gate (regular, bounded):
    an ``IngestError`` is the episode's failure."""
    data = read_regular(directory / RESULT_FILE, MAX_RESULT_BYTES, roots=roots)
    if data is None:
        return f"no {RESULT_FILE} yet"
    try:
        result = json.loads(data.decode("utf-8-sig", errors="replace"))
    except ValueError:
        return f"{RESULT_FILE} is not whole JSON yet"
    if isinstance(result, dict) and (result.get("episode_reward") is not None or result.get("error")):
        return None
    return "no reward yet"


# ---- the follower ----------------------------------------------------------------------------


@dataclass
class _Member:
    """One arrival of a batch: a stored episode version, or an input that failed (no row)."""

    location: str  # the episode directory, or file:line
    episode_id: int | None = None
    failure: str | None = None
    name: str = ""  # the failure's readable name
    arrived: dt.datetime | None = None  # when a failure was seen


# The counts walk the episode's steps and look each one up (EXISTS): as joins, SQLite's planner
# walked every score of the scorer (ix_scores_scorer_step) to find the episode's few.
MEMBERS_SQL = """
SELECT e.id, e.name, e.external_id, e.version, e.is_current, e.source_path, e.ingested_at, e.num_steps,
       (SELECT COUNT(*) FROM steps s WHERE s.episode_id = e.id AND EXISTS
          (SELECT 1 FROM scores sc WHERE sc.step_id = s.id AND sc.scorer_id = :scorer)) AS scored,
       (SELECT COUNT(*) FROM steps s WHERE s.episode_id = e.id AND EXISTS
          (SELECT 1 FROM attempts a WHERE a.step_id = s.id AND a.scorer_id = :scorer AND a.status = 'failed')) AS failed
FROM episodes e
WHERE e.id IN ({ids}) AND e.include_thinking = :thinking AND e.max_tool_result_chars = :tool_chars
"""
SQL_CHUNK = 500  # ids per IN list


class Follower:
    """Follows ``cfg.paths`` for one scorer (``prep``); ``cycle()`` does one round of work.

    It keeps, in memory, every arrival by its batch key and the keys with work left (*open*):
    a cycle reads from the database only the members of open keys, so an idle cycle costs no
    query whatever the store holds. A restart rebuilds this from one full look (everything is
    read again, as unchanged) and the database (what is scored and published)."""

    def __init__(
        self,
        store: Store,
        prep: Prepared,
        cfg: FollowConfig,
        options: RunOptions,
        *,
        now: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self.store, self.prep, self.cfg, self.options = store, prep, cfg, options
        self.weight_version = prep.spec.get("weight_version")  # the scorer's
        self.now = now
        self.roots: list[Path] | None = None if cfg.follow_links else list(cfg.paths)
        self.seen: dict[Path, Signature] = {}
        self.refused: dict[Path, str] = {}
        self.waiting: dict[str, str] = {}  # location -> why it waits (no reward yet, a line being written)
        self.cursors: dict[Path, JsonlCursor] = {}
        self.members: dict[str, _Member] = {}  # location -> its latest arrival
        self.key_of: dict[str, str] = {}  # location -> batch key
        self.groups: dict[str, set[str]] = {}  # batch key -> locations
        self.open: set[str] = set()  # keys with something left to do
        self.status = FollowStatus()
        self._fields: dict[int, str | None] = {}  # episode version id -> its --batch-by field value
        self._looked_once = False

    # -- 1, 2: scan and ingest ----------------------------------------------------------------
    def _ingest_changes(self, report: CycleReport) -> None:
        look = scan(self.cfg.paths, follow_links=self.cfg.follow_links)
        changed = [p for p, sig in look.found.items() if self.seen.get(p) != sig]
        self.status.seen = len(look.found)
        for path, why in look.refused.items():
            if self.refused.get(path) != why:
                self._arrival_failed(path, why)
        self.refused = dict(look.refused)
        ready = []
        for path in changed:
            self.seen[path] = look.found[path]
            self.waiting.pop(str(path), None)
            if path.is_dir():
                try:
                    state = _result_state(path, self.roots)
                except IngestError as exc:
                    self._arrival_failed(path, f"{RESULT_FILE}: " + str(exc).removeprefix(f"{path / RESULT_FILE}: "))
                    continue
                if state is not None:
                    self.waiting[str(path)] = state  # read again when it changes
                    self._forget(str(path))
                    continue
            else:  # a JSONL file: its waiting line is looked at again
                for loc in [w for w in self.waiting if w.startswith(f"{path}:")]:
                    del self.waiting[loc]
            ready.append(path)
        report.changed = len(ready)
        if ready:
            self._ingest(ready, report)
        self.status.waiting = len(self.waiting)
        if not self._looked_once:
            self._looked_once = True
            if not look.found and not look.refused:
                self.status.notice(
                    f"nothing to follow yet under {', '.join(map(str, self.cfg.paths))}: waiting for episode "
                    f"directories ({RESULT_FILE} + {SESSION_FILE}) or *.jsonl files (docs/INGEST.md)"
                )

    def _ingest(self, ready: list[Path], report: CycleReport) -> None:
        outcomes: dict[str, SourceOutcome] = {}
        result = IngestReport()
        for root in self.cfg.paths:  # named as if each root was ingested whole
            mine = [p for p in ready if p == root or root in p.parents]
            if not mine:
                continue
            kw: dict[str, Any] = {
                "options": self.cfg.conversion,
                "name_root": root,
                "cursors": self.cursors,
                "roots": self.roots,
            }
            part = ingest(self.store, mine, on_outcome=lambda o: outcomes.__setitem__(o.location, o), **kw)
            raced = {o.location for o in outcomes.values() if o.outcome == "failed" and _lost_a_race(o.reason or "")}
            if raced:  # another follower stored the same version first: read again, now unchanged
                part.failures = [(src, error) for src, error in part.failures if src not in raced]
                part.failed -= len(raced)
                again = sorted({Path(outcomes[loc].path) for loc in raced})
                for file in again:  # a JSONL file: its cursor goes back to read the raced lines again
                    self.cursors.pop(file, None)
                _merge(part, ingest(self.store, again, on_outcome=lambda o: outcomes.__setitem__(o.location, o), **kw))
            _merge(result, part)
        report.ingest = result
        for file, cursor in self.cursors.items():
            if cursor.waiting_line is not None:
                self.waiting[f"{file}:{cursor.waiting_line}"] = "a line still being written"
        for outcome in outcomes.values():
            if outcome.outcome in ("new", "changed", "unchanged"):
                assert outcome.episode_id is not None
                self._arrived(outcome.location, _Member(outcome.location, episode_id=outcome.episode_id))
                self.status.known_elsewhere += outcome.elsewhere and outcome.outcome == "unchanged"
            elif outcome.outcome == "skipped" and outcome.reason == "no reward yet":
                self.waiting[outcome.location] = "no reward yet"
            else:  # cannot be stored: a failed member of its batch, named with its reason
                reason = outcome.reason or outcome.outcome
                location, path = outcome.location, Path(outcome.path)
                if path.name in (RESULT_FILE, SESSION_FILE):  # one file of an episode directory
                    location = str(path.parent)
                self._arrival_failed(Path(location), reason.removeprefix(f"{outcome.location}: "), location)
        self.status.ingested += result.new + result.changed
        report.busy |= bool(result.new or result.changed)

    def _arrival_failed(self, path: Path, why: str, location: str | None = None) -> None:
        where = location or str(path)
        member = _Member(where, failure=why, name=self._label(where), arrived=self.now())
        self.status.ingest_failed += 1
        self.status.fail(f"{where}: {why}")
        self._arrived(where, member)

    def _forget(self, location: str) -> None:
        """An arrival that is waiting again (its result.json lost its reward) is no member."""
        self.members.pop(location, None)
        key = self.key_of.pop(location, None)
        if key is not None:
            self.groups.get(key, set()).discard(location)
            self.open.add(key)

    def _label(self, location: str) -> str:
        """A failed input's name as the store would name it: relative to its root."""
        path, line = _split_location(location)
        tail = "" if line is None else f":{line}"
        for root in self.cfg.paths:
            if path == root or root in path.parents:
                return str(Path(root.name) / path.relative_to(root)) + tail
        return location

    def _arrived(self, location: str, member: _Member) -> None:
        """File an arrival under its batch key (found later for stored versions batched by tag
        or field: their key is in the database)."""
        self.members[location] = member
        old = self.key_of.pop(location, None)
        if old is not None:
            self.groups.get(old, set()).discard(location)
            self.open.add(old)
        key = self._key_of_location(location, member)
        if key is None:
            return
        self.key_of[location] = key
        self.groups.setdefault(key, set()).add(location)
        self.open.add(key)

    def _key_of_location(self, location: str, member: _Member) -> str | None:
        if self.cfg.batch_by.startswith("tag:"):
            if member.episode_id is None:
                return None  # a failed input has no tags
            return self._tag(member.episode_id, self.cfg.batch_by[4:])
        if self.cfg.batch_by.startswith("field:"):
            name = self.cfg.batch_by[6:]
            if member.episode_id is not None:
                return self._field(member.episode_id, name)
            return _file_field(Path(location), name, self.roots)
        parent = _split_location(location)[0].parent  # of the episode directory or the JSONL file
        for root in self.cfg.paths:
            if parent == root or root in parent.parents:
                return str(Path(root.name) / parent.relative_to(root))
        return str(parent)

    def _tag(self, episode_id: int, key: str) -> str | None:
        with db.read(self.store.engine) as conn:
            value = conn.execute(
                text("SELECT value FROM tags WHERE episode_id = :e AND key = :k"), {"e": episode_id, "k": key}
            ).scalar()
        return None if value is None else str(value)

    # -- 3: score -------------------------------------------------------------------------------
    def _rows(self, keys: set[str]) -> dict[int, dict[str, Any]]:
        """The stored members of ``keys``, with their scored and failed step counts."""
        ids = sorted(
            {
                m.episode_id
                for key in keys
                for loc in self.groups.get(key, ())
                if (m := self.members[loc]).episode_id is not None
            }
        )
        conv = self.prep.spec["conversion"]
        out: dict[int, dict[str, Any]] = {}
        with db.read(self.store.engine) as conn:
            for start in range(0, len(ids), SQL_CHUNK):
                chunk = ids[start : start + SQL_CHUNK]
                bind: dict[str, Any] = {f"i{n}": i for n, i in enumerate(chunk)}
                sql = MEMBERS_SQL.format(ids=", ".join(f":{k}" for k in bind))
                bind |= {
                    "scorer": self.prep.scorer_id,
                    "thinking": conv["include_thinking"],
                    "tool_chars": conv["max_tool_result_chars"],
                }
                for r in conn.execute(text(sql), bind).mappings():
                    out[int(r["id"])] = dict(r)
        return out

    def _score(self, rows: dict[int, dict[str, Any]], report: CycleReport) -> None:
        todo = [c for c in rows.values() if c["is_current"] and c["scored"] + c["failed"] < c["num_steps"]]
        if not todo:
            return
        names = tuple(str(c["id"]) for c in todo)
        options = dataclasses.replace(self.options, filters=Filters(episodes=names))
        try:
            result = run_scoring(self.store, self.prep, options)
        except InferenceError as exc:  # the server is gone before the first request (its info)
            raise ServerDown(str(exc)) from exc
        report.score = result
        self.status.scored += result.scored
        self.status.failed += result.failed
        report.busy |= bool(result.scored or result.failed)
        if result.interrupted:
            raise KeyboardInterrupt
        if result.server_down:
            raise ServerDown(result.server_down)

    # -- 4: publish -----------------------------------------------------------------------------
    def _field(self, episode_id: int, name: str) -> str | None:
        """The value of ``name`` in the episode's result.json (or JSONL line), read once per version
        from the stored source (lossless: what the file said)."""
        if episode_id not in self._fields:
            with db.read(self.store.engine) as conn:
                raw = conn.execute(text("SELECT raw_source FROM episodes WHERE id = :i"), {"i": episode_id}).scalar()
            value = _source_field(bytes(raw) if raw is not None else b"", name)
            self._fields[episode_id] = value
            if value is None:
                self.status.notice(f"episode {episode_id} has no field {name!r}: it is in no batch")
        return self._fields[episode_id]

    def _publish(self, rows: dict[int, dict[str, Any]], report: CycleReport) -> None:
        now = self.now()
        for key in sorted(self.open):
            stored, failed = [], []
            for loc in sorted(self.groups.get(key, ())):
                m = self.members[loc]
                if m.failure is not None:
                    failed.append(m)
                elif m.episode_id in rows and rows[m.episode_id]["is_current"]:
                    stored.append(rows[m.episode_id])
            if not stored and not failed:
                self.open.discard(key)
                continue
            done = all(m["scored"] + m["failed"] >= m["num_steps"] for m in stored)
            times = [_parse_time(m["ingested_at"]) for m in stored] + [m.arrived for m in failed if m.arrived]
            arrived = max(times)
            timed_out = self.cfg.batch_timeout is not None and (now - arrived).total_seconds() >= self.cfg.batch_timeout
            if not done or (len(stored) + len(failed) < self.cfg.group_size and not timed_out):
                continue  # open: members to come or steps to score
            self.open.discard(key)
            info = self._publish_one(key, stored, failed, arrived, now)
            if info is not None:
                report.published.append(info)
                report.busy = True
                self.status.batches += 1
                self.status.last_lag = info.lag_s
                if info.failed_episodes:
                    self.status.fail(
                        f"batch {info.id} ({key}): failed episode(s) "
                        + ", ".join(f"{f.name} ({f.reason})" for f in info.failed_episodes)
                    )

    def still_waiting(self) -> list[str]:
        """What is not done, by name: inputs waiting for their end (no reward yet, a line being
        written) and batches waiting for members (``key: n of group size``)."""
        out = [f"{loc}: {why}" for loc, why in sorted(self.waiting.items())]
        for key in sorted(self.open):
            n = len(self.groups.get(key, ()))
            if n:
                out.append(f"batch {key}: {n} of {self.cfg.group_size} episode(s)")
        return out

    def _publish_one(
        self,
        key: str,
        members: list[dict[str, Any]],
        failed_inputs: list[_Member],
        arrived: dt.datetime,
        complete: dt.datetime,
    ) -> BatchInfo | None:
        ids = sorted(int(m["id"]) for m in members)
        with db.read(self.store.engine) as conn:  # the hash names episodes by content, not by id
            batch_hash = scoped_run_hash(conn, self.prep.scorer_id, self.cfg.params, ids)
        if failed_inputs:  # the same stored episodes with other failed arrivals: another batch
            extra = canonical_json(sorted(m.name for m in failed_inputs))
            batch_hash = hashlib.sha256(f"{batch_hash}\n{extra}".encode()).hexdigest()
        if _already_there(self.store, batch_hash):
            return None  # published already (by us before a restart, or by another follower)
        members = sorted(members, key=lambda m: m["name"])
        failed = [FailedEpisode(m.name, m.failure or "", "ingest") for m in sorted(failed_inputs, key=lambda m: m.name)]
        failed += [
            FailedEpisode(
                m["name"], f"{m['failed']} of {m['num_steps']} step(s) failed for good", "score", m["external_id"]
            )
            for m in members
            if m["failed"]
        ]
        run_name: str | None = None
        run_id: int | None = None
        if ids:
            try:
                result = _compute(self.store, self.cfg.params, f"batch-{batch_hash[:12]}", self.prep.scorer_id, ids)
                run_id, run_name = result.run.id, result.run.name
            except CreditError:  # every episode of the batch failed: the row says so, no run
                pass
        ready = self.now()
        row: dict[str, Any] = {
            "key": key,
            "h": batch_hash,
            "status": "ready" if run_id is not None else "failed",
            "episodes": len(members) + len(failed_inputs),
            "steps": sum(int(m["num_steps"]) for m in members),
            "scored": sum(int(m["scored"]) for m in members),
            "failed": sum(int(m["failed"]) for m in members),
            "failed_episodes": failed_json(failed),
            "scorer": self.prep.scorer_id,
            "run_id": run_id,
            "run": run_name,
            "wv": self.weight_version,
            "complete_at": complete.isoformat(timespec="milliseconds"),
            "ready_at": ready.isoformat(timespec="milliseconds"),
            "lag": round((ready - arrived).total_seconds(), 3),
        }
        try:
            with db.write(self.store.engine) as conn:
                new_id = conn.execute(
                    text(
                        "INSERT INTO batches (key, batch_hash, status, episodes, steps, scored, failed, "
                        "failed_episodes, scorer_id, credit_run_id, credit_run, weight_version, complete_at, "
                        "ready_at, lag_s) VALUES (:key, :h, :status, :episodes, :steps, :scored, :failed, "
                        ":failed_episodes, :scorer, :run_id, :run, :wv, :complete_at, :ready_at, :lag) RETURNING id"
                    ),
                    row,
                ).scalar_one()
                if ids:
                    conn.execute(
                        text("INSERT INTO batch_episodes (batch_id, episode_id) VALUES (:b, :e)"),
                        [{"b": new_id, "e": i} for i in ids],
                    )
                conn.execute(
                    text(
                        "UPDATE batches SET status = 'superseded', superseded_by = :new "
                        "WHERE key = :key AND scorer_id = :scorer AND id <> :new AND status <> 'superseded'"
                    ),
                    {"new": new_id, "key": key, "scorer": self.prep.scorer_id},
                )
        except (IntegrityError, StoreError) as exc:
            if _already_there(self.store, batch_hash):
                return None  # another follower published it between our check and our insert
            raise exc
        return BatchInfo(
            int(new_id),
            key,
            row["episodes"],
            row["steps"],
            row["scored"],
            row["failed"],
            failed,
            row["status"],
            run_name,
            self.weight_version,
            row["complete_at"],
            row["ready_at"],
            row["lag"],
            members=[BatchMember(m["name"], m["external_id"], int(m["id"]), int(m["version"])) for m in members],
        )

    # -- one round ------------------------------------------------------------------------------
    def cycle(self) -> CycleReport:
        report = CycleReport()
        self._ingest_changes(report)
        if not self.open:
            return report  # nothing left to do: no query at all
        rows = self._rows(self.open)
        self._score(rows, report)
        if report.score is not None and (report.score.scored or report.score.failed):
            rows = self._rows(self.open)
        self._publish(rows, report)
        return report


def _split_location(location: str) -> tuple[Path, int | None]:
    """``file:line`` (a JSONL line) or a path."""
    head, _, tail = location.rpartition(":")
    if head and tail.isdigit() and not Path(location).exists():
        return Path(head), int(tail)
    return Path(location), None


def _file_field(path: Path, name: str, roots: Sequence[Path] | None) -> str | None:
    """A field of a failed episode directory's result.json, when it can be read at all."""
    try:
        data = read_regular(path / RESULT_FILE, MAX_RESULT_BYTES, roots=roots) if path.is_dir() else None
    except IngestError:
        return None
    return None if data is None else _source_field(zlib.compress(data), name)


def _lost_a_race(error: str) -> bool:
    """An insert refused because the same episode version was just stored by someone else."""
    return "refused this episode" in error and ("duplicate key" in error or "UNIQUE constraint failed" in error)


def _merge(total: IngestReport, part: IngestReport) -> None:
    total.new += part.new
    total.changed += part.changed
    total.unchanged += part.unchanged
    total.failed += part.failed
    total.failures += part.failures
    total.skipped.update(part.skipped)
    total.steps += part.steps


def _wait_for_server(backend: Any, seconds: float, stop: Any) -> bool:
    """Wait up to ``seconds`` for a server that stopped answering; True when it answered a
    probe before that. Online loops restart the server at every weight sync: a blind wait grown
    to a minute would leave the batch idle long after the server is back."""
    import time

    ping = getattr(backend, "ping", None)
    end = time.monotonic() + seconds
    while not stop.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return False
        if stop.wait(min(PROBE_SECONDS, left)):  # as often as a scoring run's retry asks
            return False
        if ping is not None and run_sync(lambda: _ping_once(backend)):
            return True
    return False


async def _ping_once(backend: Any) -> bool:
    try:
        return bool(await backend.ping())
    finally:
        await backend.close()  # the probe's own client; the next cycle starts the backend afresh


class ServerDown(Exception):
    """The scoring server stopped answering; ``follow`` waits and tries again."""


def _compute(store: Store, params: CreditParams, name: str, scorer: str, ids: list[int]) -> Any:
    try:
        return compute_credits(store, params, name=name, scorer=scorer, episodes=ids)
    except (IntegrityError, StoreError):
        # two followers computed the same run at once: the other one's is the same run
        return compute_credits(store, params, name=name, scorer=scorer, episodes=ids)


def _already_there(store: Store, batch_hash: str) -> bool:
    with db.read(store.engine) as conn:
        return conn.execute(text("SELECT 1 FROM batches WHERE batch_hash = :h"), {"h": batch_hash}).first() is not None


def _parse_time(value: str) -> dt.datetime:
    t = dt.datetime.fromisoformat(value)
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.timezone.utc)


# ---- the loop -------------------------------------------------------------------------------------


@dataclass
class FollowResult:
    cycles: int
    batches: int
    status: FollowStatus
    stopped: str  # "once" | "idle" | "signal"
    waiting: list[str] = field(default_factory=list)  # at "idle": what was still waiting, by name


class _Waiter:
    """Between cycles: wake on a file-system event under the paths (watchfiles, in a thread
    started before the first scan, so no change falls between a scan and the watch) or after
    ``poll_seconds``, whichever comes first. ``poll_only`` (network file systems, where no
    event arrives) just waits; the scan finds the changes either way."""

    def __init__(self, paths: Sequence[Path], poll_seconds: float, stop: Any, poll_only: bool) -> None:
        import threading

        self.poll_seconds, self.stop = poll_seconds, stop
        self.changed = threading.Event()
        if poll_only:
            return
        try:
            import watchfiles
        except ImportError:  # the periodic scan alone still finds every change
            return
        ready = threading.Event()

        def run() -> None:
            try:
                for changes in watchfiles.watch(
                    *[str(p) for p in paths],
                    stop_event=stop,
                    rust_timeout=100,
                    yield_on_timeout=True,
                    debounce=50,
                    raise_interrupt=False,
                ):
                    ready.set()
                    if changes:
                        self.changed.set()
            except Exception:
                pass
            finally:
                ready.set()

        threading.Thread(target=run, name="hcapo-follow-watch", daemon=True).start()
        ready.wait(30)

    def wait(self) -> None:
        """Until a change, ``poll_seconds``, or the stop; the change flag is cleared before the
        next scan, so a change during that scan wakes the wait after it."""
        import time

        end = time.monotonic() + self.poll_seconds
        while not self.stop.is_set() and not self.changed.is_set():
            left = end - time.monotonic()
            if left <= 0:
                break
            self.changed.wait(min(left, 0.2))
        self.changed.clear()


def follow(
    follower: Follower,
    *,
    once: bool = False,
    until_idle: float | None = None,
    poll_seconds: float = 1.0,
    stop: Any = None,
    on_cycle: Callable[[CycleReport, FollowStatus], None] | None = None,
    clock: Callable[[], float] | None = None,
    poll_only: bool = False,
) -> FollowResult:
    """Cycle until stopped: ``once`` (one cycle, then every batch it can complete), ``until_idle``
    (seconds in which nothing new arrived and nothing was scored or published; what still
    waits is named in ``FollowResult.waiting``), or ``stop`` (a ``threading.Event``, set
    by a signal handler). A server that stops answering pauses the loop with a growing wait
    (up to a minute) instead of ending it; the steps stay queued."""
    import threading
    import time

    clock = clock or time.monotonic
    stop = stop or threading.Event()
    waiter = None if once else _Waiter(follower.cfg.paths, poll_seconds, stop, poll_only)
    cycles = batches = 0
    idle_since = clock()
    backoff = 1.0
    while not stop.is_set():
        try:
            report = follower.cycle()
            backoff = 1.0
        except ServerDown as exc:
            follower.status.notice(
                f"the scoring server stopped answering ({exc}); trying again as soon as it answers "
                f"(at most {backoff:.0f} s), nothing is lost"
            )
            report = CycleReport(busy=True)
            if on_cycle is not None:
                on_cycle(report, follower.status)
            if _wait_for_server(follower.prep.backend, backoff, stop):
                follower.status.notice("the scoring server answers again: scoring goes on")
            backoff = min(backoff * 2, 60.0)
            continue
        cycles += 1
        batches += len(report.published)
        if on_cycle is not None:
            on_cycle(report, follower.status)
        if once:
            return FollowResult(cycles, batches, follower.status, "once")
        if report.busy or report.changed:
            idle_since = clock()
        elif until_idle is not None and clock() - idle_since >= until_idle:
            # idle: exit even while inputs or batches wait (a collector that crashed sends
            # nothing more); they are named, and the CLI exits 3 for them
            return FollowResult(cycles, batches, follower.status, "idle", follower.still_waiting())
        assert waiter is not None
        waiter.wait()
    return FollowResult(cycles, batches, follower.status, "signal")
