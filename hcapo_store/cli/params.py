"""Click parameter types that refuse what the library cannot use, in one line with the range.

Click's FloatRange lets NaN through (every comparison with NaN is false) and takes infinity;
IntRange without a maximum takes 10**30. Each refused value names its option and the range.
"""

from __future__ import annotations

import math
from typing import Any

import click

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
