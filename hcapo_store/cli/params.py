"""Click parameter types that refuse what the library cannot use, in one line with the range.

Click's FloatRange lets NaN through (every comparison with NaN is false) and takes infinity;
IntRange without a maximum takes 10**30. Each refused value names its option and the range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import click

from hcapo_store.ingestion.sources import ConvertOptions

INT32_MAX = 2**31 - 1


class FiniteFloat(click.FloatRange):
    """A finite float, optionally within [min, max]."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            where = f" in {self._describe_range()}" if self.min is not None or self.max is not None else ""
            self.fail(f"{value!r} is not a finite number: give a number{where}", param, ctx)
        return super().convert(number, param, ctx)


def int_range(lo: int | None = None, hi: int = INT32_MAX) -> click.IntRange:
    """An int in [lo, hi]: every int option has a maximum (no 10**30 reaching SQL or asyncio)."""
    return click.IntRange(lo, hi)


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


F = TypeVar("F", bound=Callable[..., Any])


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
