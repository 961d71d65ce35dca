"""The run side of a trainer's read, in one read of the store: everything ``Handoff`` and the
dataset exports know about a credit run before they place a single step, as plain data.

``read_run_side`` takes the run as they are given it (a name, None for the only run, or a
``follow`` batch's id) and returns a ``RunSide``: the run with its staleness, why a newer batch
replaced the batch it was published as (if one did), its per-step weights (``weights.py``), its
scorer's tokenizer record (the fingerprint and the directories it was loaded from, which
``scoring/tokenizer_lookup.py`` checks a tokenizer against) and, when asked, its credited
episodes and whether its scorer has a top-k. ``with_tokenizer`` adds the scorer's tokenizer,
loaded and checked against that record (the one field that is not plain data): the export
asks for it with the read, ``Handoff`` once it has not refused the run. The callers then work
on that data; the per-step rows they stream afterwards are theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text

from hcapo_store.credits.lookup import RunInfo, named_run
from hcapo_store.credits.weights import RunWeights, run_weights
from hcapo_store.errors import HandoffError
from hcapo_store.scoring.scorer import tokenizer_record
from hcapo_store.scoring.tokenizer_lookup import recorded_tokenizer
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

CREDITED_SQL = """
SELECT DISTINCT e.id, e.name, e.external_id FROM credits c JOIN steps s ON s.id = c.step_id JOIN episodes e ON e.id = s.episode_id
WHERE c.run_id = :run ORDER BY e.name
"""


@dataclass(frozen=True)
class CreditedEpisode:
    id: int
    name: str
    external_id: str | None  # the collector's own id (JSONL episode_id, Pi session id)


@dataclass(frozen=True)
class RunSide:
    """What a trainer's read knows about one credit run (``read_run_side``)."""

    run: RunInfo
    replaced: str | None  # a follow batch's run that a newer batch of the same key replaced: why
    weights: RunWeights  # the per-step weights with the options asked (None = the run's own)
    weight_warnings: tuple[str, ...]  # what reading them said (a group_by tag the episodes lack)
    tokenizer_record: tuple[dict[str, Any], list[Path]]  # the scorer's tokenizer fingerprint, where it was loaded
    credited: tuple[CreditedEpisode, ...] = ()  # every credited episode, by name (``credited=True``)
    has_topk: bool | None = None  # the run's scorer stored a top-k (``top_k=True``), else None
    # the scorer's tokenizer, loaded and checked against its fingerprint (``with_tokenizer``), and
    # the fingerprint of the copy loaded: the one field that is not plain data
    tokenizer: Any = None
    fingerprint: dict[str, Any] | None = None


def read_run_side(
    store: Store,
    run: str | int | None = None,
    *,
    omega: float | None = None,
    min_reward: float | None = None,
    group_by: str | None = None,
    use_smoothed: bool | None = None,
    credited: bool = False,
    top_k: bool = False,
    tokenizer: bool = False,
    tokenizer_dir: str | Path | None = None,
    note: Callable[[str], None] | None = None,
) -> RunSide:
    """The run side of ``run`` in one read: a credit run's name (None: the only run) or a batch
    id (``int``: the ``batches`` row ``hcapo-store batches`` lists; refused by name when it has
    no credit run). The weight options are ``run_weights``'s; ``tokenizer``: ``with_tokenizer``."""
    with db.read(store.engine) as conn:
        side = _read(conn, run, omega, min_reward, group_by, use_smoothed, credited, top_k)
    return with_tokenizer(side, tokenizer_dir, note=note) if tokenizer else side


def with_tokenizer(
    side: RunSide,
    tokenizer_dir: str | Path | None = None,
    *,
    note: Callable[[str], None] | None = None,
    like: RunSide | None = None,
    loaded: Any = None,
) -> RunSide:
    """``side`` with its scorer's tokenizer loaded (``scoring/tokenizer_lookup.py``: the one in
    ``tokenizer_dir`` checked against the scorer's fingerprint, or without one where the store
    records it was loaded; ``note`` is told which); the one of ``like`` when that run side has
    one for the same scorer (a trainer takes one run per GRPO group each step). ``loaded``: the
    tokenizer already loaded from ``tokenizer_dir`` (a trainer keeps one), checked the same way
    instead of being loaded again."""
    scorer_id = side.run.scorer_id
    if like is not None and like.tokenizer is not None and like.run.scorer_id == scorer_id:
        return replace(side, tokenizer=like.tokenizer, fingerprint=like.fingerprint)
    tokenizer, fingerprint = recorded_tokenizer(
        scorer_id, side.tokenizer_record, tokenizer_dir, note=note, loaded=loaded
    )
    return replace(side, tokenizer=tokenizer, fingerprint=fingerprint)


def _read(
    conn: Connection,
    run: str | int | None,
    omega: float | None,
    min_reward: float | None,
    group_by: str | None,
    use_smoothed: bool | None,
    credited: bool,
    top_k: bool,
) -> RunSide:
    info = named_run(conn, batch_credit_run(conn, run) if isinstance(run, int) else run)
    warnings: list[str] = []
    weights = run_weights(
        conn, info, warnings, omega=omega, min_reward=min_reward, group_by=group_by, use_smoothed=use_smoothed
    )
    episodes = conn.execute(text(CREDITED_SQL), {"run": info.id}).all() if credited else ()
    return RunSide(
        run=info,
        replaced=superseded_batch(conn, info.id),
        weights=weights,
        weight_warnings=tuple(warnings),
        tokenizer_record=tokenizer_record(conn, info.scorer_id),
        credited=tuple(CreditedEpisode(int(i), str(n), None if x is None else str(x)) for i, n, x in episodes),
        has_topk=_has_topk(conn, info.scorer_id) if top_k else None,
    )


def no_credit_run(batch_id: int, key: str, status: str) -> HandoffError:
    """A batch without a credit run (every member failed), refused by name."""
    return HandoffError(f"batch {batch_id} ({key}) has no credit run ({status}): no member could be credited")


def batch_credit_run(conn: Connection, batch_id: int) -> str:
    """The name of batch ``batch_id``'s credit run."""
    row = conn.execute(
        text("SELECT id, key, status, credit_run FROM batches WHERE id = :b"), {"b": int(batch_id)}
    ).first()
    if row is None:
        raise HandoffError(f"no batch {int(batch_id)} in this store (`hcapo-store batches` lists them)")
    if not row.credit_run:
        raise no_credit_run(row.id, row.key, row.status)
    return str(row.credit_run)


def superseded_batch(conn: Connection, run_id: int) -> str | None:
    """Why a ``follow`` batch's run must not be trained on any more: a newer batch of the same
    key replaced its batch (named, with its run), or None."""
    row = conn.execute(
        text("SELECT id, key, superseded_by FROM batches WHERE credit_run_id = :r AND status = 'superseded'"),
        {"r": run_id},
    ).first()
    if row is None:
        return None
    new = conn.execute(
        text("SELECT id, credit_run, status FROM batches WHERE id = :b"), {"b": row.superseded_by}
    ).first()
    by = f"batch {new.id} (credit run {new.credit_run!r}, {new.status})" if new is not None else "a newer batch"
    return f"credit run of batch {row.id} ({row.key}) was superseded by {by}: an episode of it changed"


def _has_topk(conn: Connection, scorer_id: str) -> bool:
    found = conn.execute(text("SELECT 1 FROM topk_scores WHERE scorer_id = :s LIMIT 1"), {"s": scorer_id}).first()
    return found is not None
