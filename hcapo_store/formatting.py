"""Rendering rows for people (tables) and scripts (CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, (bytes, memoryview)):
        return f"<{len(bytes(value))} bytes>"
    return str(value)


CUT_MARK = "…"


def _cut(text: str, max_width: int | None) -> str:
    if max_width is None or len(text) <= max_width:
        return text
    return text[: max_width - 1] + CUT_MARK


def table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], *, max_width: int | None = 60, full: str = "--json"
) -> str:
    """A padded text table. Cells longer than ``max_width`` are cut, marked with …, and a
    last line says so and how to see whole values (``full``); None never cuts."""
    whole = [[cell(v) for v in row] for row in rows]
    cells = [[_cut(v, max_width) for v in row] for row in whole]
    widths = [len(c) for c in columns]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = max(widths[i], len(v))
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    if cells != whole:
        body.append(
            f"(cells longer than {max_width} characters are cut and end in {CUT_MARK}; {full} shows whole values)"
        )
    return "\n".join([line, sep, *body])


def records_table(records: Sequence[dict[str, Any]], *, full: str = "--json") -> str:
    """A table of dicts that share their keys (columns in the first record's order)."""
    cols = list(records[0])
    return table(cols, [[r[c] for c in cols] for r in records], full=full)


def to_csv(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow(
            [
                "" if v is None else (f"<{len(bytes(v))} bytes>" if isinstance(v, (bytes, memoryview)) else v)
                for v in row
            ]
        )
    return buf.getvalue()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, memoryview)):
        return f"<{len(bytes(value))} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_json(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    return json.dumps([{c: _jsonable(v) for c, v in zip(columns, row)} for row in rows], indent=2, default=str)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def params_text(params: dict[str, Any]) -> str:
    """Hyperparameters on one line: ``gamma=0.95 t_temp=5 …``."""
    return " ".join(f"{k}={cell(v)}" for k, v in params.items())
