"""``follow``'s batches: each arrival filed under its batch key (``parent``, ``tag:KEY``,
``field:NAME``), the keys with work left, and the publication of a complete batch (a credit
run over exactly its episode versions plus its row in ``batches``, unique by hash)."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from hcapo_store.canonical import canonical_json
from hcapo_store.credits.compute import compute_credits, scoped_run_hash
from hcapo_store.errors import CreditError
from hcapo_store.ingestion.fields import source_field
from hcapo_store.online.batches import BatchInfo, BatchMember, FailedEpisode, failed_json
from hcapo_store.online.scanning import file_field, split_location
from hcapo_store.scoring.job import Prepared
from hcapo_store.scoring.scorer import register
from hcapo_store.storage import db
from hcapo_store.storage.once import insert_once
from hcapo_store.storage.store import Store

if TYPE_CHECKING:
    from hcapo_store.online.state import CycleReport, FollowConfig, FollowStatus


@dataclass
class Member:
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
          (SELECT 1 FROM scores sc WHERE sc.step_id = s.id AND sc.scorer_id = :scorer){student_scored}) AS scored,
       (SELECT COUNT(*) FROM steps s WHERE s.episode_id = e.id AND EXISTS
          (SELECT 1 FROM attempts a WHERE a.step_id = s.id AND a.scorer_id IN ({scorers})
           AND a.status = 'failed')) AS failed
FROM episodes e
WHERE e.id IN ({ids}) AND e.include_thinking = :thinking AND e.max_tool_result_chars = :tool_chars
"""
# A log-ratio follower's no-hindsight student: a step is scored once both scored it, failed once either failed it.
STUDENT_SCORED = " AND EXISTS (SELECT 1 FROM scores su WHERE su.step_id = s.id AND su.scorer_id = :student)"
SQL_CHUNK = 500  # ids per IN list


class Batcher:
    """The arrivals of one follower by batch key, in memory, and the keys with work left
    (*open*): a cycle reads from the database only the members of open keys."""

    def __init__(
        self,
        store: Store,
        prep: Prepared,
        cfg: FollowConfig,
        status: FollowStatus,
        now: Callable[[], dt.datetime],
        roots: Sequence[Path] | None,
        student: Prepared | None = None,
    ) -> None:
        self.store, self.prep, self.cfg, self.status, self.now, self.roots = store, prep, cfg, status, now, roots
        self.student = student  # a log-ratio follower's --against no-hindsight scorer
        self.weight_version = prep.spec.get("weight_version")  # the scorer's
        self.members: dict[str, Member] = {}  # location -> its latest arrival
        self.key_of: dict[str, str] = {}  # location -> batch key
        self.groups: dict[str, set[str]] = {}  # batch key -> locations
        self.open: set[str] = set()  # keys with something left to do
        self._fields: dict[int, str | None] = {}  # episode version id -> its --batch-by field value

    def forget(self, location: str) -> None:
        """An arrival that is waiting again (its result.json lost its reward) is no member."""
        self.members.pop(location, None)
        key = self.key_of.pop(location, None)
        if key is not None:
            self.groups.get(key, set()).discard(location)
            self.open.add(key)

    def label(self, location: str) -> str:
        """A failed input's name as the store would name it: relative to its root."""
        path, line = split_location(location)
        tail = "" if line is None else f":{line}"
        for root in self.cfg.paths:
            if path == root or root in path.parents:
                return str(Path(root.name) / path.relative_to(root)) + tail
        return location

    def arrived(self, location: str, member: Member) -> None:
        """File an arrival under its batch key (found later for stored versions batched by tag
        or field: their key is in the database)."""
        self.members[location] = member
        first = location not in self.key_of
        old = self.key_of.pop(location, None)
        if old is not None:
            self.groups.get(old, set()).discard(location)
            self.open.add(old)
        key = self._key_of_location(location, member)
        if key is None:
            return
        self.key_of[location] = key
        group = self.groups.setdefault(key, set())
        if member.episode_id is not None and first:
            same = sorted(o for o in group if o != location and self.members[o].episode_id == member.episode_id)
            if same:  # ingest keeps identical repeats as one episode: one member, counted once
                self.status.notice(f"{location} repeats {same[0]} (the same episode): one member of its batch")
        group.add(location)
        self.open.add(key)

    def _key_of_location(self, location: str, member: Member) -> str | None:
        if self.cfg.batch_by.startswith("tag:"):
            if member.episode_id is None:
                return None  # a failed input has no tags
            return self._tag(member.episode_id, self.cfg.batch_by[4:])
        if self.cfg.batch_by.startswith("field:"):
            name = self.cfg.batch_by[6:]
            if member.episode_id is not None:
                return self._field(member.episode_id, name)
            return file_field(location, name, self.roots)
        parent = split_location(location)[0].parent  # of the episode directory or the JSONL file
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

    def rows(self, keys: set[str]) -> dict[int, dict[str, Any]]:
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
                both = self.student is not None
                sql = MEMBERS_SQL.format(
                    ids=", ".join(f":{k}" for k in bind),
                    student_scored=STUDENT_SCORED if both else "",
                    scorers=":scorer, :student" if both else ":scorer",
                )
                if self.student is not None:
                    bind["student"] = self.student.scorer_id
                bind |= {
                    "scorer": self.prep.scorer_id,
                    "thinking": conv["include_thinking"],
                    "tool_chars": conv["max_tool_result_chars"],
                }
                for r in conn.execute(text(sql), bind).mappings():
                    out[int(r["id"])] = dict(r)
        return out

    def _field(self, episode_id: int, name: str) -> str | None:
        """The value of ``name`` in the episode's result.json (or JSONL line), read once per version
        from the stored source (lossless: what the file said)."""
        if episode_id not in self._fields:
            with db.read(self.store.engine) as conn:
                raw = conn.execute(text("SELECT raw_source FROM episodes WHERE id = :i"), {"i": episode_id}).scalar()
            value = source_field(bytes(raw) if raw is not None else b"", name)
            self._fields[episode_id] = value
            if value is None:
                self.status.notice(f"episode {episode_id} has no field {name!r}: it is in no batch")
        return self._fields[episode_id]

    def episode_ids(self, key: str) -> list[int]:
        """The stored episode versions filed under ``key``, each once (repeated lines are one)."""
        ids = (self.members[loc].episode_id for loc in sorted(self.groups.get(key, ())))
        return list(dict.fromkeys(i for i in ids if i is not None))

    def publish(self, rows: dict[int, dict[str, Any]], report: CycleReport, keys: Sequence[str] | None = None) -> None:
        """Publish every complete batch of the open keys (``keys``: of those only)."""
        now = self.now()
        for key in sorted(self.open if keys is None else self.open.intersection(keys)):
            stored, failed, seen = [], [], set()
            for loc in sorted(self.groups.get(key, ())):
                m = self.members[loc]
                if m.failure is not None:
                    failed.append(m)
                elif m.episode_id in rows and rows[m.episode_id]["is_current"] and m.episode_id not in seen:
                    # a line repeating another (a collector's retry, or two rollouts equal byte for
                    # byte) is the same stored episode: one member, counted toward the group once
                    seen.add(m.episode_id)
                    stored.append(rows[m.episode_id])
            if not stored and not failed:
                self.open.discard(key)
                continue
            done = all(m["scored"] + m["failed"] >= m["num_steps"] for m in stored)
            times = [parse_time(m["ingested_at"]) for m in stored] + [m.arrived for m in failed if m.arrived]
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

    def _run_hash(self, conn: Any, ids: list[int]) -> str:
        """The batch run's identity: scorer, parameters and the episodes by content."""
        if self.cfg.log_ratio is None:
            return scoped_run_hash(conn, self.prep.scorer_id, self.cfg.params, ids)
        from hcapo_store.canonical import content_hash
        from hcapo_store.credits.compute import scope_identities
        from hcapo_store.credits.log_ratio import VARIANT

        assert self.cfg.against is not None
        identity = {
            "scorer_id": self.prep.scorer_id,
            "variant": VARIANT,
            "params": self.cfg.log_ratio.as_dict(self.cfg.against),
            "allow_mixed": self.cfg.allow_mixed,
            "episodes": scope_identities(conn, ids),
        }
        return content_hash(identity, ascii_only=True)

    def _log_ratio_run(self, ids: list[int], name: str) -> Any:
        """The batch's log-ratio run: the follower's scorer (the teacher) against the batch's
        student (``--against``): the same scorer without the hindsight block, scored with the
        teacher in each round, or the rollouts' own logprobs, stored here from the records."""
        from hcapo_store.credits.log_ratio import ROLLOUT, compute_log_ratio

        assert self.cfg.log_ratio is not None
        if self.cfg.against == ROLLOUT:
            from hcapo_store.outputs.rollout_scores import store_rollout_scores

            assert self.prep.tokenizer_dir is not None  # checked when the follower starts
            report = store_rollout_scores(self.store, self.prep.tokenizer_dir, episodes=ids)
            for failure in report.failures:
                self.status.fail(f"--against rollout: {failure}")
            if len(report.scorers) != 1:
                raise CreditError(
                    f"--against rollout: the batch's episodes carry the rollout logprobs of {len(report.scorers)} "
                    "policies (engine, model, weight version), not one: no log-ratio run for it"
                )
            student = next(iter(report.scorers))
        else:
            assert self.student is not None
            student = self.student.scorer_id
        result = compute_log_ratio(
            self.store,
            self.cfg.log_ratio,
            scorer=self.prep.scorer_id,
            against=student,
            name=name,
            allow_mixed=self.cfg.allow_mixed,
            episodes=ids,
        )
        if "; warning: " in result.message:
            for warning in result.message.split("; warning: ")[1:]:
                self.status.notice(f"batch run {result.run.name}: {warning}")
        return result

    def still_waiting(self) -> list[str]:
        """The batches waiting for members, by name (``batch key: n of group size``)."""
        out = []
        for key in sorted(self.open):
            members = self.groups.get(key, ())
            n = len({loc if (i := self.members[loc].episode_id) is None else i for loc in members})
            if n:
                out.append(f"batch {key}: {n} of {self.cfg.group_size} episode(s)")
        return out

    def _publish_one(
        self,
        key: str,
        members: list[dict[str, Any]],
        failed_inputs: list[Member],
        arrived: dt.datetime,
        complete: dt.datetime,
    ) -> BatchInfo | None:
        ids = sorted(int(m["id"]) for m in members)
        with db.read(self.store.engine) as conn:  # the hash names episodes by content, not by id
            batch_hash = self._run_hash(conn, ids)
        if failed_inputs:  # the same stored episodes with other failed arrivals: another batch
            extra = canonical_json(sorted(m.name for m in failed_inputs))
            batch_hash = hashlib.sha256(f"{batch_hash}\n{extra}".encode()).hexdigest()
        if already_there(self.store, batch_hash):
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
                # two followers publishing the same batch at once get the same run (insert once)
                if self.cfg.log_ratio is None:
                    result = compute_credits(
                        self.store,
                        self.cfg.params,
                        name=f"batch-{batch_hash[:12]}",
                        scorer=self.prep.scorer_id,
                        episodes=ids,
                    )
                else:
                    result = self._log_ratio_run(ids, f"batch-{batch_hash[:12]}")
                run_id, run_name = result.run.id, result.run.name
            except CreditError as exc:  # every episode of the batch failed: the row says so, no run
                if self.cfg.log_ratio is not None:  # or the two scorers were refused: said, never silent
                    self.status.fail(f"batch {key}: {exc}")
        ready = self.now()
        row: dict[str, Any] = {
            "key": key,
            "batch_hash": batch_hash,
            "status": "ready" if run_id is not None else "failed",
            "episodes": len(members) + len(failed_inputs),
            "steps": sum(int(m["num_steps"]) for m in members),
            "scored": sum(int(m["scored"]) for m in members),
            "failed": sum(int(m["failed"]) for m in members),
            "failed_episodes": failed_json(failed),
            "scorer_id": self.prep.scorer_id,
            "credit_run_id": run_id,
            "credit_run": run_name,
            "weight_version": self.weight_version,
            "complete_at": complete.isoformat(timespec="milliseconds"),
            "ready_at": ready.isoformat(timespec="milliseconds"),
            "lag_s": round((ready - arrived).total_seconds(), 3),
        }
        # the row names the scorer: registered here whatever ran before (a batch nothing of which
        # was scored, e.g. its only input refused, had no scoring run to register it); idempotent
        register(self.store, self.prep.spec)
        with db.write(self.store.engine) as conn:
            new_id = insert_once(conn, "batches", row, unique=["batch_hash"])
            if new_id is None:
                return None  # another follower published it between our check and our insert
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
            row["lag_s"],
            members=[BatchMember(m["name"], m["external_id"], int(m["id"]), int(m["version"])) for m in members],
        )


def already_there(store: Store, batch_hash: str) -> bool:
    with db.read(store.engine) as conn:
        return conn.execute(text("SELECT 1 FROM batches WHERE batch_hash = :h"), {"h": batch_hash}).first() is not None


def parse_time(value: str) -> dt.datetime:
    t = dt.datetime.fromisoformat(value)
    return t if t.tzinfo is not None else t.replace(tzinfo=dt.timezone.utc)
