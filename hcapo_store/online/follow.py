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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from hcapo_store.clock import utcnow
from hcapo_store.errors import InferenceError, IngestError, StoreError, StoreGone
from hcapo_store.ingestion.pipeline import IngestReport, SourceOutcome, ingest
from hcapo_store.ingestion.sources import RESULT_FILE, SESSION_FILE, JsonlCursor
from hcapo_store.online.batching import Batcher, Member
from hcapo_store.online.scanning import Signature, result_state, rewritten, scan
from hcapo_store.online.state import CycleReport, FollowConfig, FollowStatus
from hcapo_store.online.waiting import ServerDown, Waiter, wait_for_server
from hcapo_store.scoring.job import Prepared, run_scoring
from hcapo_store.scoring.scheduler import RunOptions, ScoreReport
from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage.store import Store

__all__ = ["CycleReport", "FollowConfig", "FollowResult", "FollowStatus", "Follower", "ServerDown", "follow"]

# Episodes per scoring run of a cycle (``Follower._score_rounds``), at least 8 per request in
# flight. A claim's cost grows with the run's episode filter: measured per claim (SQLite, a
# loaded 2-core machine) 0.4 ms unfiltered, 4.8 ms at 64 ids, 38 ms at 256, 146 ms at 2,000,
# 1,110 ms at 10,000 (×7.6 from 2,000: the issue's ×7 per step).
SCORE_ROUND = 64
ROUND_PER_REQUEST = 8


# ---- the follower ----------------------------------------------------------------------------


class Follower:
    """Follows ``cfg.paths`` for one scorer (``prep``); ``cycle()`` does one round of work.

    It keeps, in memory, every arrival by its batch key and the keys with work left (*open*):
    a cycle reads from the database only the members of open keys, so an idle cycle costs no
    query whatever the store holds (on PostgreSQL one: the store's identity, ``check_store``).
    A restart rebuilds this from one full look (everything is read again, as unchanged) and
    the database (what is scored and published)."""

    def __init__(
        self,
        store: Store,
        prep: Prepared,
        cfg: FollowConfig,
        options: RunOptions,
        *,
        now: Callable[[], dt.datetime] = utcnow,
        student: Prepared | None = None,
    ) -> None:
        """``student``: with ``cfg.log_ratio`` and ``--against no-hindsight``, the follower's scorer
        without the hindsight block (``prepare`` of the same config with ``hindsight=False``):
        every round scores it right after the teacher, and each batch's run is their log-ratio."""
        from hcapo_store.credits.log_ratio import NO_HINDSIGHT, ROLLOUT

        if cfg.log_ratio is not None and cfg.against == NO_HINDSIGHT and student is None:
            raise ValueError("a log-ratio follower --against no-hindsight needs student= (the no-hindsight scorer)")
        if cfg.log_ratio is not None and cfg.against == ROLLOUT and prep.tokenizer_dir is None:
            raise ValueError("a log-ratio follower --against rollout needs a scorer with a tokenizer directory")
        self.store, self.prep, self.cfg, self.options = store, prep, cfg, options
        self.student = student
        self.now = now
        self.roots: list[Path] | None = None if cfg.follow_links else list(cfg.paths)
        self.seen: dict[Path, Signature] = {}
        self.refused: dict[Path, str] = {}
        self.waiting: dict[str, str] = {}  # location -> why it waits (no reward yet, a line being written)
        self.cursors: dict[Path, JsonlCursor] = {}
        self.result_ids: dict[Path, str | None] = {}  # episode directory -> its result.json's parsed identity
        self.status = FollowStatus()
        self.batches = Batcher(store, prep, cfg, self.status, now, self.roots, student)  # arrivals by batch key
        self._looked_once = False
        self.identity = store.identity()  # the database it started on (``check_store``)

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
            old = self.seen.get(path)
            if rewritten(old, look.found[path]):
                self.cursors.pop(path, None)  # read again from its start: every line is looked at
            self.seen[path] = look.found[path]
            self.waiting.pop(str(path), None)
            if path.is_dir():
                try:
                    state, identity = result_state(path, self.roots)
                except IngestError as exc:
                    self._arrival_failed(path, f"{RESULT_FILE}: " + str(exc).removeprefix(f"{path / RESULT_FILE}: "))
                    continue
                if state is not None:
                    self.waiting[str(path)] = state  # read again when it changes
                    self.batches.forget(str(path))
                    self.result_ids.pop(path, None)
                    continue
                same_session = old is not None and old[1:] == look.found[path][1:]
                if same_session and identity is not None and self.result_ids.get(path) == identity:
                    continue  # result.json saved again with the same content (other whitespace): no new version
                self.result_ids[path] = identity
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
            # another follower storing the same version at once is no failure: ingest inserts once
            part = ingest(self.store, mine, on_outcome=lambda o: outcomes.__setitem__(o.location, o), **kw)
            _merge(result, part)
        report.ingest = result
        for file, cursor in self.cursors.items():
            if cursor.waiting_line is not None:
                self.waiting[f"{file}:{cursor.waiting_line}"] = "a line still being written"
        for outcome in outcomes.values():
            if outcome.outcome in ("new", "changed", "unchanged"):
                assert outcome.episode_id is not None
                self.batches.arrived(outcome.location, Member(outcome.location, episode_id=outcome.episode_id))
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
        member = Member(where, failure=why, name=self.batches.label(where), arrived=self.now())
        self.status.ingest_failed += 1
        self.status.fail(f"{where}: {why}")
        self.batches.arrived(where, member)

    # -- 3: score -------------------------------------------------------------------------------
    def _score_rounds(self, rows: dict[int, dict[str, Any]]) -> list[list[str]]:
        """The open keys with steps to score, in key order, cut into rounds of about
        ``SCORE_ROUND`` episodes: a scoring run's episode filter is bound into every claim's
        query, so one run over 10,000 episodes cost each claim 10,000 parameters (quadratic in
        the episodes dropped at once), and nothing was published before all were scored."""
        rounds: list[list[str]] = []
        current: list[str] = []
        size = 0
        for key in sorted(self.batches.open):
            n = sum(1 for i in self.batches.episode_ids(key) if (r := rows.get(i)) is not None and _unscored(r))
            if not n:
                continue
            current.append(key)
            size += n
            if size >= max(SCORE_ROUND, ROUND_PER_REQUEST * self.options.concurrency):
                rounds.append(current)
                current, size = [], 0
        if current:
            rounds.append(current)
        return rounds

    def _score(self, rows: dict[int, dict[str, Any]], report: CycleReport) -> None:
        todo = [c for c in rows.values() if _unscored(c)]
        if not todo:
            return
        names = tuple(str(c["id"]) for c in todo)
        options = dataclasses.replace(self.options, filters=Filters(episodes=names))
        try:
            result = run_scoring(self.store, self.prep, options)
            if self.student is not None and not (result.interrupted or result.server_down):
                # the log-ratio's student, on the same episodes, before any of their batches is published
                student = run_scoring(self.store, self.student, options)
                self.status.failed += student.failed
                if student.failed:
                    self.status.fail(
                        f"the no-hindsight scorer failed {student.failed} step(s): their episodes are incomplete "
                        f"in the batch's log-ratio run ({student.first_errors[:1]})"
                    )
                result.interrupted, result.server_down = student.interrupted, student.server_down
        except InferenceError as exc:  # the server is gone before the first request (its info)
            raise ServerDown(str(exc)) from exc
        report.score = result if report.score is None else _added(report.score, result)
        self.status.scored += result.scored
        self.status.failed += result.failed
        report.busy |= bool(result.scored or result.failed)
        if result.interrupted:
            raise KeyboardInterrupt
        if result.server_down:
            raise ServerDown(result.server_down)

    def still_waiting(self) -> list[str]:
        """What is not done, by name: inputs waiting for their end (no reward yet, a line being
        written) and batches waiting for members (``key: n of group size``)."""
        return [f"{loc}: {why}" for loc, why in sorted(self.waiting.items())] + self.batches.still_waiting()

    # -- one round ------------------------------------------------------------------------------
    def cycle(self) -> CycleReport:
        report = CycleReport()
        self.check_store()  # deleted, dropped or replaced under us: stop, never report work that exists nowhere
        self._ingest_changes(report)
        if not self.batches.open:
            return report  # nothing left to do: no query at all
        rows = self.batches.rows(self.batches.open)
        try:
            for keys in self._score_rounds(rows):  # each round's batches published as soon as it is scored
                ids = {i for key in keys for i in self.batches.episode_ids(key)}
                self._score({i: rows[i] for i in ids if i in rows}, report)
                rows.update(self.batches.rows(set(keys)))
                self.batches.publish(rows, report, keys)
        except ServerDown as exc:
            exc.report = report  # the rounds published before it are shown
            raise
        self.batches.publish(rows, report)  # batches with nothing to score: failures, timeouts
        self.check_store()
        return report

    def check_store(self) -> None:
        """``StoreError`` in one line when the database this follower started on is not the one
        its connections reach now: a SQLite file deleted or replaced (its connections would go
        on writing to the old, unlinked file), a PostgreSQL database dropped (or its server
        gone), dropped and created again, or its tables made again (``Store.identity``). Asked
        before and after each round, and after a database error in one."""
        try:
            now = self.store.identity()
        except StoreGone as exc:
            raise StoreError(
                f"{exc} while this process used it: stopping (start again on the database to use)"
            ) from exc
        if now != self.identity:
            what = (
                "file"
                if self.store.dialect == "sqlite"
                else "database (dropped and created again, or its tables made again)"
            )
            raise StoreError(
                f"the database {self.store.display} was replaced by another {what} while this process used it: "
                "stopping (what was written since went elsewhere; start again on the database to use)"
            )


def _unscored(row: dict[str, Any]) -> bool:
    return bool(row["is_current"]) and row["scored"] + row["failed"] < row["num_steps"]


def _added(total: ScoreReport, part: ScoreReport) -> ScoreReport:
    """One cycle's scoring report over its rounds."""
    for name in ("planned", "scored", "failed", "retried", "discarded", "released", "prompt_tokens", "cancelled"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    total.elapsed_s += part.elapsed_s
    total.failure_kinds.update(part.failure_kinds)
    for kind, message in part.first_errors:
        total.note_error(kind, message)
    total.interrupted, total.server_down = part.interrupted, part.server_down
    return total


def _merge(total: IngestReport, part: IngestReport) -> None:
    total.new += part.new
    total.changed += part.changed
    total.unchanged += part.unchanged
    total.failed += part.failed
    total.failures += part.failures
    total.skipped.update(part.skipped)
    total.steps += part.steps


# ---- the loop -------------------------------------------------------------------------------------


@dataclass
class FollowResult:
    cycles: int
    batches: int
    status: FollowStatus
    stopped: str  # "once" | "idle" | "signal"
    waiting: list[str] = field(default_factory=list)  # at "idle": what was still waiting, by name


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
    waiter = None if once else Waiter(follower.cfg.paths, poll_seconds, stop, poll_only, follower.status.notice)
    cycles = batches = 0
    idle_since = clock()
    backoff = 1.0
    while not stop.is_set():
        try:
            report = follower.cycle()
            backoff = 1.0
        except (StoreError, SQLAlchemyError):
            follower.check_store()  # a database gone or replaced in the middle of a round: said so
            raise
        except ServerDown as exc:
            follower.status.notice(
                f"the scoring server stopped answering ({exc}); trying again as soon as it answers "
                f"(at most {backoff:.0f} s), nothing is lost"
            )
            report = exc.report or CycleReport()
            report.busy = True
            batches += len(report.published)
            if on_cycle is not None:
                on_cycle(report, follower.status)
            if wait_for_server(follower.prep.backend, backoff, stop):
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
