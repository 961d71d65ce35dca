"""The time remaining that progress shows (issue 39 §7: the export ETA was 60x off)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import TimeElapsedColumn, TimeRemainingColumn

from hcapo_store.progress import Progress, terminal_columns


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_leaves_out_the_setup_before_the_first_item() -> None:
    """An export sorts every message (or loads a tokenizer) before its first episode: five
    minutes of setup, then one episode a second. Over the whole time the rate was 11/310 per
    second and the time left 3 hours; over the items, 1 per second and 389 seconds."""
    clock = Clock()
    progress = Progress("export", total=400, unit="episodes", clock=clock)
    clock.now = 300.0
    progress.reach(1, 400)
    assert progress.rate() is None and "left" not in progress.info()  # one report: no time per item yet
    clock.now = 310.0
    progress.reach(11, 400)
    assert progress.rate() == 1.0
    assert progress.info() == "1.0 episodes/s, about 6m29s left"


def test_the_terminal_eta_has_the_elapsed_columns_format() -> None:
    """Beside the elapsed time (H:MM:SS) the time remaining was MM:SS: 12 minutes read as
    ``12:30`` next to ``0:00:40``, i.e. 12 hours in the elapsed column's format."""
    clock = Clock()
    bar = RichProgress(*terminal_columns(), get_time=clock, console=Console(width=160, force_terminal=False))
    task = bar.add_task("export", total=1000, info="")
    for second in range(1, 41):  # 40 s at one item a second: 960 left, 16 minutes
        clock.now = float(second)
        bar.update(task, completed=second)
    remaining = next(c for c in terminal_columns() if isinstance(c, TimeRemainingColumn))
    elapsed = next(c for c in terminal_columns() if isinstance(c, TimeElapsedColumn))
    assert str(remaining.render(bar.tasks[0])) == "0:16:00"
    assert str(elapsed.render(bar.tasks[0])) == "0:00:40"
