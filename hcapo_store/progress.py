"""Progress display: a rich bar with ETA on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any

LOG_EVERY_SECONDS = 10.0


class Progress:
    """Counts work items; shows a rich bar (TTY) or a log line every few seconds (pipes, CI).

    ``fields`` are extra counters shown next to the bar (e.g. failures, tokens/s).
    """

    def __init__(self, label: str, *, total: int | None = None, enabled: bool = True, unit: str = "items") -> None:
        self.label, self._total, self.unit = label, total, unit
        self.enabled = enabled
        self.done = 0
        self.fields: dict[str, Any] = {}
        self._tty = enabled and sys.stderr.isatty()
        self._bar: Any = None
        self._task: Any = None
        self._started = time.monotonic()
        self._last_log = self._started

    def __enter__(self) -> Progress:
        if self._tty:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(compact=True),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.enabled and self.done:
            self._log()

    @property
    def total(self) -> int | None:
        return self._total

    @total.setter
    def total(self, value: int | None) -> None:
        """A total learnt after the start (``score`` knows it once its queue is planned) reaches
        the bar too: without it the bar shows ``n/?`` and no time remaining."""
        self._total = value
        if self._bar is not None:
            self._bar.update(self._task, total=value)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def info(self) -> str:
        elapsed = max(self.elapsed, 1e-9)
        rate = self.done / elapsed
        parts = [f"{rate:.1f} {self.unit}/s"]
        if self._bar is None and self.total is not None and self.done and self.total > self.done:
            parts.append(f"about {_duration((self.total - self.done) / rate)} left")
        parts += [f"{k} {v}" for k, v in self.fields.items()]
        return ", ".join(parts)

    def advance(self, *_: Any, n: int = 1) -> None:
        self.done += n
        if self.total is not None and self.done > self.total:  # a total that was an estimate
            self.total = self.done
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=n, info=self.info())
        elif time.monotonic() - self._last_log >= LOG_EVERY_SECONDS:
            self._log()

    def reach(self, done: int, total: int | None = None) -> None:
        """Move to ``done`` (of ``total``, when given): for callers told counts, not steps."""
        if total is not None:
            self.total = total
        self.advance(n=done - self.done)

    def set(self, **fields: Any) -> None:
        self.fields.update(fields)

    def _log(self) -> None:
        self._last_log = time.monotonic()
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.label}: {self.done}{of} {self.unit} ({self.info()})", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def EpisodeProgress(label: str, *, enabled: bool = True) -> Progress:
    return Progress(label, enabled=enabled, unit="episodes")
