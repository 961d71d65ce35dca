"""What a follower is asked to do and what it reports: its configuration, the live status line
and one cycle's report. Apart from ``follow.py`` so that ``batching.py``, which ``follow.py``
drives, can name them without importing the follower back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hcapo_store.credits.equations import CreditParams
from hcapo_store.credits.log_ratio import BATCH_STUDENTS, LogRatioParams
from hcapo_store.errors import UsageError
from hcapo_store.ingestion.pipeline import IngestReport
from hcapo_store.ingestion.sources import ConvertOptions
from hcapo_store.online.batches import BatchInfo
from hcapo_store.scoring.scheduler import ScoreReport

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
    # ``--variant log-ratio``: each batch's run is a log-ratio run of the follower's scorer (the
    # teacher) against ``against`` (credits/log_ratio.py BATCH_STUDENTS), instead of HCAPO's ``params``
    log_ratio: LogRatioParams | None = None
    against: str | None = None
    allow_mixed: bool = False

    def __post_init__(self) -> None:
        if self.log_ratio is not None and self.against not in BATCH_STUDENTS:
            raise UsageError(
                f"--against {self.against!r}: follow computes the student of each batch itself: use "
                f"--against {' or --against '.join(BATCH_STUDENTS)} (the scorer without the hindsight block, or "
                "the rollouts' own logprobs)"
            )
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
