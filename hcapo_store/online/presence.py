"""A running ``follow`` process, as the store sees it: one row of the ``workers`` table
(state ``following``, id ``follow:HOST:PID``) written when it starts, its heartbeat and
counts renewed after a cycle that changed them (at least every ``BEAT_SECONDS``), ``stopped``
when it ends. ``batches`` reads it, so an empty
change feed with a follower at work says what the follower is doing instead of telling the
user to start one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

from sqlalchemy import text

from hcapo_store.errors import StoreError
from hcapo_store.processes import pid_alive
from hcapo_store.status_report import STALE_WITHOUT_LEASES_SECONDS
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

FOLLOWING = "following"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Follower:
    """A follower that is alive as of now."""

    host: str
    pid: int
    running_s: float  # since it started
    since_cycle_s: float  # since its last heartbeat (its last cycle)
    scored: int  # steps its cycles scored so far
    failed: int

    def describe(self) -> str:
        return (
            f"a follower is running (pid {self.pid} on {self.host}, for {self.running_s:.0f} s, last cycle "
            f"{self.since_cycle_s:.0f} s ago; {self.scored} step(s) scored, {self.failed} failed so far)"
        )


def announce(store: Store, scorer_id: str | None) -> str:
    """Record this process as a follower; returns its id (for ``beat`` and ``leave``)."""
    host, pid = socket.gethostname(), os.getpid()
    me = f"follow:{host}:{pid}"
    with db.write(store.engine) as conn:
        now = db.sql_now(conn)
        conn.execute(text("DELETE FROM workers WHERE id = :id"), {"id": me})
        conn.execute(
            text(
                "INSERT INTO workers (id, scorer_id, host, pid, started_at, heartbeat_at, state, scored, failed) "
                "VALUES (:id, :scorer, :host, :pid, :now, :now, :state, 0, 0)"
            ),
            {"id": me, "scorer": scorer_id, "host": host, "pid": pid, "now": now, "state": FOLLOWING},
        )
    return me


# An idle follower cycles every --poll seconds: its heartbeat is written when its counts change
# or this long after the last one (well within STALE_WITHOUT_LEASES_SECONDS), not every cycle.
BEAT_SECONDS = 30.0


class Presence:
    """This process as a follower, from ``announce`` to ``leave``; ``beat`` after each cycle."""

    def __init__(self, store: Store, scorer_id: str | None) -> None:
        self.store = store
        self.id = announce(store, scorer_id)
        self._last: tuple[float, int, int] = (time.monotonic(), 0, 0)

    def beat(self, *, scored: int, failed: int) -> None:
        at, *counts = self._last
        if counts == [scored, failed] and time.monotonic() - at < BEAT_SECONDS:
            return
        beat(self.store, self.id, scored=scored, failed=failed)
        self._last = (time.monotonic(), scored, failed)

    def leave(self) -> None:
        """Marked ``stopped``; where the database cannot take it (dropped, not answering: the
        reason ``follow`` stops), the row is left to age out by its heartbeat, and the stop's
        own reason is what the user reads."""
        try:
            leave(self.store, self.id)
        except StoreError as exc:
            log.info("follow: could not mark %s stopped: %s", self.id, exc)


def beat(store: Store, me: str, *, scored: int, failed: int) -> None:
    """After a cycle: alive, with its counts so far."""
    with db.write(store.engine) as conn:
        conn.execute(
            text("UPDATE workers SET heartbeat_at = :now, scored = :s, failed = :f WHERE id = :me"),
            {"now": db.sql_now(conn), "s": scored, "f": failed, "me": me},
        )


def leave(store: Store, me: str) -> None:
    with db.write(store.engine) as conn:
        conn.execute(
            text("UPDATE workers SET state = 'stopped', heartbeat_at = :now WHERE id = :me"),
            {"now": db.sql_now(conn), "me": me},
        )


def live_followers(store: Store) -> list[Follower]:
    """Followers alive now: on this host, their process is there; elsewhere, a heartbeat within
    the time a scoring worker without leases counts as alive (``status``'s rule)."""
    here = socket.gethostname()
    with db.read(store.engine) as conn:
        now = db.sql_now(conn)
        rows = conn.execute(
            text(
                "SELECT host, pid, started_at, heartbeat_at, scored, failed FROM workers WHERE state = :state "
                "ORDER BY heartbeat_at DESC"
            ),
            {"state": FOLLOWING},
        ).all()
    out = []
    for host, pid, started, heartbeat, scored, failed in rows:
        alive = pid_alive(int(pid)) if host == here else now - heartbeat <= STALE_WITHOUT_LEASES_SECONDS
        if alive:
            out.append(Follower(host, int(pid), now - started, now - heartbeat, int(scored), int(failed)))
    return out
