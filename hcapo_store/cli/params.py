"""Click parameter types that refuse what the library cannot use, in one line with the range.

Click's FloatRange lets NaN through (every comparison with NaN is false) and takes infinity;
IntRange without a maximum takes 10**30. Each refused value names its option and the range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import click

from hcapo_store.ingestion.sources import COMPACTION_MODES, ConvertOptions

INT32_MAX = 2**31 - 1


def _bounds_text(lo: float | None, hi: float | None) -> str:
    """The help's range: only the bounds the option really has (Click prints ``x<=None``)."""
    if lo is not None and hi is not None:
        return f"{lo}<=x<={hi}"
    if lo is not None:
        return f"x>={lo}"
    if hi is not None:
        return f"x<={hi}"
    return ""


class FiniteFloat(click.FloatRange):
    """A finite float, optionally within [min, max]."""

    name = "finite float"

    def _describe_range(self) -> str:
        return _bounds_text(self.min, self.max)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            where = f" in {self._describe_range()}" if self.min is not None or self.max is not None else ""
            self.fail(f"{value!r} is not a finite number: give a number{where}", param, ctx)
        return super().convert(number, param, ctx)


class GuardedInt(click.IntRange):
    """An int within the option's own bounds and always within int32, so no 10**30 reaches SQL
    or asyncio. The help shows only the option's own bounds; a refusal names the whole range."""

    def __init__(self, lo: int | None, hi: int | None) -> None:
        super().__init__(-INT32_MAX if lo is None else lo, INT32_MAX if hi is None else hi)
        self.own_min, self.own_max = lo, hi
        if lo is None and hi is None:
            self.name = "integer"  # not "integer range": it has none of its own

    def _describe_range(self) -> str:
        return _bounds_text(self.own_min, self.own_max)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.INT.convert(value, param, ctx)
        if not self.min <= number <= self.max:  # type: ignore[operator]
            self.fail(f"{number} is not in the range {self.min}<=x<={self.max}.", param, ctx)
        return number


def int_range(lo: int | None = None, hi: int | None = None) -> click.IntRange:
    """An int in [lo, hi] (None: no bound of its own, int32's limit still holds)."""
    return GuardedInt(lo, hi)


class ServerURL(click.ParamType):
    """An inference server's URL an HTTP client can connect to (``scoring/server_url.py``)."""

    name = "URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from hcapo_store.errors import UsageError
        from hcapo_store.scoring.server_url import check_server_url

        try:
            return check_server_url(str(value))
        except UsageError as exc:
            self.fail(str(exc).removeprefix("--server "), param, ctx)


class Device(click.ParamType):
    """Where an in-process model runs: cpu, cuda or cuda:N (whether that GPU is there is checked
    when the model loads)."""

    name = "cuda|cuda:N|cpu"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        kind, colon, index = str(value).partition(":")
        if (kind == "cpu" and not colon) or (kind == "cuda" and (not colon or (index.isascii() and index.isdigit()))):
            return str(value)
        self.fail(f"{value!r} is not cuda, cuda:N or cpu", param, ctx)


F = TypeVar("F", bound=Callable[..., Any])


def apply_options(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    """One decorator of a list of ``click.option``s, in the list's order in ``--help`` (an option
    list declared once and shared: the credit, scorer and log-ratio options)."""

    def decorate(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def conversion_options(thinking_help: str, cut_help: str) -> Callable[[F], F]:
    """``--include-thinking/--no-thinking`` and ``--max-tool-result-chars``, declared once for
    ``ingest`` and ``score`` (and anything that selects episodes by how they were converted),
    with the library's defaults (``ConvertOptions``)."""
    defaults = ConvertOptions()

    def decorate(command: F) -> F:
        command = click.option(
            "--max-tool-result-chars",
            type=int_range(0),
            default=defaults.max_tool_result_chars,
            show_default=True,
            help=cut_help,
        )(command)
        return click.option(
            "--include-thinking/--no-thinking",
            default=defaults.include_thinking,
            show_default=True,
            help=thinking_help,
        )(command)

    return decorate


def compaction_option(command: F) -> F:
    """``--compaction full|context``, declared once for ``ingest`` and ``follow`` (the two
    commands that convert sources), with the library's default (``ConvertOptions``)."""
    return click.option(
        "--compaction",
        type=click.Choice(COMPACTION_MODES),
        default=ConvertOptions().compaction,
        show_default=True,
        help="Pi sessions with compaction entries: full = every message in file order (the original "
        "loader's transcript); context = what the agent saw after the last compaction (its summary as a "
        "user message, then the kept and later entries). Either way such an episode gets a warning.",
    )(command)
