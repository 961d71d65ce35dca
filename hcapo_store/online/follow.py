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
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from hcapo_store.canonical import canonical_json
from hcapo_store.clock import utcnow
from hcapo_store.credits.equations import CreditParams
from hcapo_store.credits.runs import compute_credits, scoped_run_hash
from hcapo_store.errors import CreditError, InferenceError, StoreError, UsageError
from hcapo_store.ingestion.pipeline import IngestReport, ingest
from hcapo_store.ingestion.sources import RESULT_FILE, SESSION_FILE, ConvertOptions
from hcapo_store.online.batches import BatchInfo, BatchMember, FailedEpisode, failed_json
from hcapo_store.scoring.job import Prepared, run_scoring
from hcapo_store.scoring.scheduler import RunOptions, ScoreReport
from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

Signature = tuple[tuple[int, int], ...]


@dataclass
class FollowConfig:
    paths: Sequence[Path]
    group_size: int
    batch_by: str = "parent"  # parent | tag:KEY | field:NAME (of result.json, or of the JSONL line)
    batch_timeout: float | None = None  # seconds after a batch's last arrival: publish what is there
    params: CreditParams = field(default_factory=CreditParams)
    conversion: ConvertOptions = field(default_factory=ConvertOptions)

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
    failures: list[str] = field(default_factory=list)  # named, never dropped in silence
    notices: list[str] = field(default_factory=list)  # e.g. waiting for the server

    def line(self) -> str:
        lag = "—" if self.last_lag is None else f"{self.last_lag:.1f} s"
        return (
            f"follow: {self.seen} seen · {self.waiting} waiting · {self.ingested} ingested · "
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


def scan(paths: Sequence[Path]) -> dict[Path, Signature]:
    """Episode directories and JSONL files under ``paths``, with their signatures."""
    out: dict[Path, Signature] = {}

    def visit(path: Path) -> None:
        if path.is_file():
            if path.suffix == ".jsonl" and path.name != SESSION_FILE:
                out[path] = (_stat(path),)
            return
        if (path / RESULT_FILE).exists() or (path / SESSION_FILE).exists():
            out[path] = (_stat(path / RESULT_FILE), _stat(path / SESSION_FILE))
            return
        try:
            children = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return
        for child in children:
            if child.is_dir(follow_symlinks=False) or child.name.endswith(".jsonl"):
                visit(Path(child.path))

    for p in paths:
        visit(Path(p))
    return out


def _has_reward(directory: Path) -> bool:
    try:
        result = json.loads((directory / RESULT_FILE).read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and result.get("episode_reward") is not None


def _unterminated_last_line(path: Path) -> int | None:
    """The number of a JSONL file's last line when it has no newline yet (still being written)."""
    try:
        with path.open("rb") as f:
            data = f.read()
    except OSError:
        return None
    if not data or data.endswith(b"\n"):
        return None
    return data.count(b"\n") + 1


# ---- the follower ----------------------------------------------------------------------------


EPISODES_SQL = """
SELECT e.id, e.name, e.external_id, e.version, e.source_path, e.ingested_at, e.num_steps,
       (SELECT COUNT(*) FROM steps s JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = :scorer
        WHERE s.episode_id = e.id) AS scored,
       (SELECT COUNT(*) FROM steps s JOIN attempts a ON a.step_id = s.id AND a.scorer_id = :scorer
        WHERE s.episode_id = e.id AND a.status = 'failed') AS failed{tag}
FROM episodes e
WHERE e.is_current IS TRUE AND e.include_thinking = :thinking AND e.max_tool_result_chars = :tool_chars
"""


class Follower:
    """Follows ``cfg.paths`` for one scorer (``prep``); ``cycle()`` does one round of work."""

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
        self.seen: dict[Path, Signature] = {}
        self.waiting: set[Path] = set()
        self.status = FollowStatus()
        self._fields: dict[int, str | None] = {}  # episode version id -> its --batch-by field value

    # -- 1, 2: scan and ingest ----------------------------------------------------------------
    def _ingest_changes(self, report: CycleReport) -> None:
        found = scan(self.cfg.paths)
        changed = [p for p, sig in found.items() if self.seen.get(p) != sig]
        self.status.seen = len(found)
        ready, waiting = [], set()
        for path in changed:
            if path.is_dir() and not _has_reward(path):
                waiting.add(path)  # read again when it changes
            else:
                ready.append(path)
        self.waiting = (self.waiting - set(changed)) | waiting
        for path in changed:
            self.seen[path] = found[path]
        self.status.waiting = len(self.waiting)
        report.changed = len(ready)
        if not ready:
            return
        result = IngestReport()
        for root in self.cfg.paths:  # named as if each root was ingested whole
            mine = [p for p in ready if p == root or root in p.parents]
            if not mine:
                continue
            part = ingest(self.store, mine, options=self.cfg.conversion, name_root=root)
            raced = {Path(src) for src, error in part.failures if _lost_a_race(error)}
            if raced:  # another follower stored the same version first: read again, now unchanged
                part.failures = [(src, error) for src, error in part.failures if Path(src) not in raced]
                part.failed -= len(raced)
                _merge(part, ingest(self.store, sorted(raced), options=self.cfg.conversion, name_root=root))
            _merge(result, part)
        report.ingest = result
        failed = []
        for source, error in result.failures:
            file = Path(source.split(":")[0])
            line = _unterminated_last_line(file) if ":" in source and file.is_file() else None
            if line is not None and source.endswith(f":{line}"):
                self.seen.pop(file, None)  # the line being written: read again until it is whole
                continue
            failed.append(f"{source}: {error}" if source not in error else error)
        self.status.ingest_failed += len(failed)
        self.status.failures += failed
        self.status.ingested += result.new + result.changed
        report.busy |= bool(result.new or result.changed)

    # -- 3: score -------------------------------------------------------------------------------
    def _candidates(self) -> list[dict[str, Any]]:
        conv = self.prep.spec["conversion"]
        tag = self.cfg.batch_by[4:] if self.cfg.batch_by.startswith("tag:") else None
        sql = EPISODES_SQL.format(
            tag=", (SELECT value FROM tags t WHERE t.episode_id = e.id AND t.key = :tag) AS tag" if tag else ""
        )
        bind: dict[str, Any] = {
            "scorer": self.prep.scorer_id,
            "thinking": conv["include_thinking"],
            "tool_chars": conv["max_tool_result_chars"],
        }
        if tag:
            bind["tag"] = tag
        roots = [str(p) for p in self.cfg.paths]
        with db.read(self.store.engine) as conn:
            rows = [dict(r) for r in conn.execute(text(sql), bind).mappings()]
        inside = []
        for r in rows:
            source = r["source_path"] or ""
            if any(source == root or source.startswith(root.rstrip("/") + "/") for root in roots):
                inside.append(r)
        return inside

    def _score(self, candidates: list[dict[str, Any]], report: CycleReport) -> None:
        todo = [c for c in candidates if c["scored"] + c["failed"] < c["num_steps"]]
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
                self.status.notices.append(f"episode {episode_id} has no field {name!r}: it is in no batch")
        return self._fields[episode_id]

    def _key(self, c: dict[str, Any]) -> str | None:
        if self.cfg.batch_by.startswith("tag:"):
            return c.get("tag")
        if self.cfg.batch_by.startswith("field:"):
            return self._field(int(c["id"]), self.cfg.batch_by[6:])
        source = Path(c["source_path"] or "")
        parent = source.parent
        for root in self.cfg.paths:
            if parent == root or root in parent.parents:
                return str(Path(root.name) / parent.relative_to(root))
        return str(parent)

    def _publish(self, candidates: list[dict[str, Any]], report: CycleReport) -> None:
        groups: dict[str, list[dict[str, Any]]] = {}
        for c in candidates:
            key = self._key(c)
            if key is not None:
                groups.setdefault(key, []).append(c)
        now = self.now()
        for key, members in sorted(groups.items()):
            done = all(m["scored"] + m["failed"] >= m["num_steps"] for m in members)
            arrived = max(_parse_time(m["ingested_at"]) for m in members)
            timed_out = self.cfg.batch_timeout is not None and (now - arrived).total_seconds() >= self.cfg.batch_timeout
            if not done or (len(members) < self.cfg.group_size and not timed_out):
                continue
            info = self._publish_one(key, members, arrived, now)
            if info is not None:
                report.published.append(info)
                report.busy = True
                self.status.batches += 1
                self.status.last_lag = info.lag_s
                if info.failed_episodes:
                    self.status.failures.append(
                        f"batch {info.id} ({key}): failed episode(s) {', '.join(f.name for f in info.failed_episodes)}"
                    )

    def _publish_one(
        self, key: str, members: list[dict[str, Any]], arrived: dt.datetime, complete: dt.datetime
    ) -> BatchInfo | None:
        ids = sorted(int(m["id"]) for m in members)
        batch_hash = scoped_run_hash(self.prep.scorer_id, self.cfg.params, ids)
        if _already_there(self.store, batch_hash):
            return None  # published already (by us before a restart, or by another follower)
        failed = [
            FailedEpisode(
                m["name"], f"{m['failed']} of {m['num_steps']} step(s) failed for good", "score", m["external_id"]
            )
            for m in sorted(members, key=lambda m: m["name"])
            if m["failed"]
        ]
        run_name: str | None = None
        run_id: int | None = None
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
            "episodes": len(members),
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
            members=[
                BatchMember(m["name"], m["external_id"], int(m["id"]), int(m["version"]))
                for m in sorted(members, key=lambda m: m["name"])
            ],
        )

    # -- one round ------------------------------------------------------------------------------
    def cycle(self) -> CycleReport:
        report = CycleReport()
        self._ingest_changes(report)
        candidates = self._candidates()
        self._score(candidates, report)
        if report.score is not None and (report.score.scored or report.score.failed):
            candidates = self._candidates()
        self._publish(candidates, report)
        return report


def _source_field(raw: bytes, name: str) -> str | None:
    """A top-level field of an episode's result.json (episode directories) or JSONL line."""
    import zlib

    try:
        doc = json.loads(zlib.decompress(raw))
        if isinstance(doc, dict) and RESULT_FILE in doc and isinstance(doc[RESULT_FILE], str):
            doc = json.loads(doc[RESULT_FILE])
    except (zlib.error, ValueError):
        return None
    value = doc.get(name) if isinstance(doc, dict) else None
    if value is None or isinstance(value, (dict, list)):
        return None if value is None else canonical_json(value)
    return str(value)


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
    (seconds with nothing new and nothing left to do), or ``stop`` (a ``threading.Event``, set
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
            follower.status.notices.append(
                f"the scoring server stopped answering ({exc}); trying again in {backoff:.0f} s, nothing is lost"
            )
            report = CycleReport(busy=True)
            if on_cycle is not None:
                on_cycle(report, follower.status)
            stop.wait(backoff)
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
        elif until_idle is not None and not follower.waiting and clock() - idle_since >= until_idle:
            return FollowResult(cycles, batches, follower.status, "idle")
        assert waiter is not None
        waiter.wait()
    return FollowResult(cycles, batches, follower.status, "signal")
