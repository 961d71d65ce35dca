"""The change feed ``follow`` writes: published batches, their episodes, and a wait for one.

A trainer reads it with ``list_batches`` (everything since an id) or blocks on
``wait_for_batch`` (the batch of one training step or key). A batch row is written once,
with its members, in one transaction: a reader never sees a batch without its episodes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import text

from hcapo_store.errors import BatchNotReady, UsageError
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


@dataclass(frozen=True)
class BatchMember:
    """One stored episode version of a batch."""

    name: str  # the store's name (``rollouts/step_0007/episode_003``)
    external_id: str | None  # the collector's own id: the JSONL ``episode_id`` / Pi session id
    episode_id: int  # the row id of this version in ``episodes``
    version: int


@dataclass(frozen=True)
class FailedEpisode:
    """A member that counts towards its group but has no credits: it could not be stored
    (``stage="ingest"``, no row; ``name`` is where it was read) or had steps fail for good
    (``stage="score"``)."""

    name: str
    reason: str
    stage: str  # ingest | score
    external_id: str | None = None


@dataclass
class BatchInfo:
    id: int
    key: str
    episodes: int  # members, failed ones included (the group's size)
    steps: int
    scored: int
    failed: int
    failed_episodes: list[FailedEpisode]
    status: str  # ready | failed (no member could be credited) | superseded
    credit_run: str | None
    weight_version: str | None
    complete_at: str
    ready_at: str
    lag_s: float | None
    superseded_by: int | None = None
    members: list[BatchMember] = field(default_factory=list)  # the stored versions, by name

    @property
    def external_ids(self) -> list[str | None]:
        return [m.external_id for m in self.members]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def failed_json(failed: list[FailedEpisode]) -> str | None:
    """The ``batches.failed_episodes`` column: a JSON list of objects (rows written before
    reasons were kept hold a list of names; ``_failed_from_json`` reads both)."""
    if not failed:
        return None
    return json.dumps([asdict(f) for f in failed], sort_keys=True, ensure_ascii=False)


def _failed_from_json(value: str | None) -> list[FailedEpisode]:
    if not value:
        return []
    out = []
    for item in json.loads(value):
        if isinstance(item, str):  # an older row: the name alone
            out.append(FailedEpisode(item, "steps failed for good", "score"))
        else:
            out.append(FailedEpisode(**item))
    return out


_COLUMNS = (
    "id, key, episodes, steps, scored, failed, failed_episodes, status, credit_run, "
    "weight_version, complete_at, ready_at, lag_s, superseded_by"
)


def _infos(conn: Any, rows: list[Any]) -> list[BatchInfo]:
    ids = [r["id"] for r in rows]
    members: dict[int, list[BatchMember]] = {i: [] for i in ids}
    for start in range(0, len(ids), 500):  # bound the IN list
        chunk = ids[start : start + 500]
        bind = {f"b{i}": b for i, b in enumerate(chunk)}
        sql = (
            "SELECT be.batch_id, e.id, e.name, e.external_id, e.version FROM batch_episodes be "
            f"JOIN episodes e ON e.id = be.episode_id WHERE be.batch_id IN ({', '.join(':' + k for k in bind)}) "
            "ORDER BY be.batch_id, e.name"
        )
        for b, eid, name, ext, version in conn.execute(text(sql), bind):
            members[b].append(BatchMember(name, ext, int(eid), int(version)))
    return [
        BatchInfo(
            id=r["id"],
            key=r["key"],
            episodes=r["episodes"],
            steps=r["steps"],
            scored=r["scored"],
            failed=r["failed"],
            failed_episodes=_failed_from_json(r["failed_episodes"]),
            status=r["status"],
            credit_run=r["credit_run"],
            weight_version=r["weight_version"],
            complete_at=r["complete_at"],
            ready_at=r["ready_at"],
            lag_s=r["lag_s"],
            superseded_by=r["superseded_by"],
            members=members[r["id"]],
        )
        for r in rows
    ]


def list_batches(store: Store, since: int | None = None) -> list[BatchInfo]:
    """Published batches in id order, each with its members (``since``: only ids above it)."""
    with db.read(store.engine) as conn:
        rows = list(
            conn.execute(
                text(f"SELECT {_COLUMNS} FROM batches WHERE id > :since ORDER BY id"),
                {"since": since if since is not None else -1},
            ).mappings()
        )
        return _infos(conn, rows)


def step_of_key(key: str) -> int | None:
    """The training step a batch key names: the number that ends its last path component
    (``rollouts/step_0007`` -> 7, ``step-12`` -> 12, ``3`` -> 3), or None."""
    last = key.rstrip("/").rsplit("/", 1)[-1]
    m = re.fullmatch(r"(?:.*\D)?(\d+)", last)
    return int(m.group(1)) if m else None


def find_batch(store: Store, key: str | None = None, *, step: int | None = None) -> BatchInfo | None:
    """The current (not superseded) published batch for ``key`` or ``step``, or None yet.
    Several keys naming one step (two roots with a ``step_0007``) are refused by name."""
    if (key is None) == (step is None):
        raise UsageError("give a batch key or a training step (step=N), exactly one of them")
    with db.read(store.engine) as conn:
        if key is not None:
            rows = list(
                conn.execute(
                    text(f"SELECT {_COLUMNS} FROM batches WHERE key = :k AND status <> 'superseded' ORDER BY id"),
                    {"k": key},
                ).mappings()
            )
        else:
            # keys ending in the step's digits, checked exactly in Python (a LIKE prefilter only)
            rows = [
                r
                for r in conn.execute(
                    text(f"SELECT {_COLUMNS} FROM batches WHERE status <> 'superseded' AND key LIKE :tail ORDER BY id"),
                    {"tail": f"%{step}"},
                ).mappings()
                if step_of_key(r["key"]) == step
            ]
        if not rows:
            return None
        keys = sorted({r["key"] for r in rows})
        if len(keys) > 1:
            raise UsageError(f"step {step} names several batch keys ({', '.join(keys)}): wait for one by its key")
        return _infos(conn, [rows[-1]])[0]


def wait_for_batch(
    store: Store,
    key: str | None = None,
    *,
    step: int | None = None,
    timeout: float | None = None,
    poll: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> BatchInfo:
    """Block until ``follow`` has published the batch for ``key`` (``rollouts/step_0007``) or
    training ``step`` (7: the key whose last component ends in that number), and return it.

    The store is read every ``poll`` seconds; nothing is assumed about how long scoring takes.
    The batch returned is the current one for its key: ``status`` is ``ready`` (its credit run
    holds the advantages: ``Handoff``) or ``failed`` (no member could be credited; see
    ``failed_episodes``). With ``timeout`` (seconds), ``BatchNotReady`` is raised once it has
    passed without the batch; ``None`` waits for as long as it takes.
    """
    if poll <= 0:
        raise UsageError(f"poll must be a positive number of seconds, not {poll}")
    if timeout is not None and timeout < 0:
        raise UsageError(f"timeout must be zero or more seconds, not {timeout}")
    deadline = None if timeout is None else clock() + timeout
    while True:
        info = find_batch(store, key, step=step)
        if info is not None:
            return info
        now = clock()
        if deadline is not None and now >= deadline:
            what = f"key {key!r}" if key is not None else f"training step {step}"
            raise BatchNotReady(
                f"no batch for {what} was published within {timeout:g} s: is `hcapo-store follow` running "
                "on the collector's folder, and has the whole group arrived? (`hcapo-store batches` lists the published ones)"
            )
        sleep(poll if deadline is None else max(0.0, min(poll, deadline - now)))
