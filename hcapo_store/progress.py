"""Progress display: a rich bar with ETA on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

LOG_EVERY_SECONDS = 10.0


class Progress:
    """Counts work items; shows a rich bar (TTY) or a log line every few seconds (pipes, CI).

    ``fields`` are extra counters shown next to the bar (e.g. failures, tokens/s).
    """

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        enabled: bool = True,
        unit: str = "items",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self._total, self.unit = label, total, unit
        self.enabled = enabled
        self.done = 0
        self.fields: dict[str, Any] = {}
        self._tty = enabled and sys.stderr.isatty()
        self._bar: Any = None
        self._task: Any = None
        self._clock = clock
        self._started = clock()
        self._last_log = self._started
        self._first: tuple[float, int] | None = None  # (time, count) of the first item reported

    def __enter__(self) -> Progress:
        if self._tty:
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(*terminal_columns(), transient=False)
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
        return self._clock() - self._started

    def rate(self) -> float | None:
        """Items per second since the first item was reported (the setup before it, e.g. a
        sort of every row or a tokenizer's load, is no time per item); None before a second
        report."""
        now = self._clock()
        if self._first is not None and self.done > self._first[1] and now > self._first[0]:
            return (self.done - self._first[1]) / (now - self._first[0])
        return None

    def info(self) -> str:
        rate = self.rate()
        if rate is None:
            parts = [f"{self.done / max(self.elapsed, 1e-9):.1f} {self.unit}/s"]
        else:
            parts = [f"{rate:.1f} {self.unit}/s"]
            if self._bar is None and self.total is not None and self.total > self.done and rate > 0:
                parts.append(f"about {_duration((self.total - self.done) / rate)} left")
        parts += [f"{k} {v}" for k, v in self.fields.items()]
        return ", ".join(parts)

    def advance(self, *_: Any, n: int = 1) -> None:
        if self._first is None and n > 0:
            self._first = (self._clock(), self.done + n)
        self.done += n
        if self.total is not None and self.done > self.total:  # a total that was an estimate
            self.total = self.done
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=n, info=self.info())
        elif self._clock() - self._last_log >= LOG_EVERY_SECONDS:
            self._log()

    def reach(self, done: int, total: int | None = None) -> None:
        """Move to ``done`` (of ``total``, when given): for callers told counts, not steps."""
        if total is not None:
            self.total = total
        self.advance(n=done - self.done)

    def set(self, **fields: Any) -> None:
        self.fields.update(fields)

    def _log(self) -> None:
        self._last_log = self._clock()
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.label}: {self.done}{of} {self.unit} ({self.info()})", file=sys.stderr, flush=True)


def terminal_columns() -> list[Any]:
    """The bar's columns on a terminal: label, bar, n/total, elapsed, time remaining, info."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return [
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        # H:MM:SS, as the elapsed time beside it: the compact MM:SS read in that format made
        # 12 minutes look like 12 hours (60x)
        TimeRemainingColumn(compact=False),
        TextColumn("{task.fields[info]}"),
    ]


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def EpisodeProgress(label: str, *, enabled: bool = True) -> Progress:
    return Progress(label, enabled=enabled, unit="episodes")
