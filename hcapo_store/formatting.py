"""Rendering rows for people (tables) and scripts (CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

# Control characters (ESC starts terminal escape sequences; C1 controls; bidi overrides and
# isolates reorder what a terminal shows) and line breaks, which would split a table row.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def for_terminal(text: str) -> str:
    """``text`` with every control, line-break or bidi character written as its escape
    (``\\x1b``, ``\\n``, ``\\u202e``): what trajectory text holds is shown, never acted on."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, (bytes, memoryview)):
        return f"<{len(bytes(value))} bytes>"
    return for_terminal(str(value))


CUT_MARK = "…"
MIN_COLUMN = 8  # a column squeezed to fit the terminal keeps at least this many characters


def _cut(text: str, max_width: int | None) -> str:
    if max_width is None or len(text) <= max_width:
        return text
    return text[: max_width - 1] + CUT_MARK


def _elide_shared(values: list[str]) -> list[str]:
    """Each value with the words (space-separated) that every value shares as one "…"."""
    split = [v.split(" ") for v in values]
    shared = set(split[0]).intersection(*split[1:]) if len(split) > 1 else set()
    out = []
    for v, parts in zip(values, split):
        kept: list[str] = []
        for part in parts:
            if part not in shared:
                kept.append(part)
            elif not kept or kept[-1] != CUT_MARK:
                kept.append(CUT_MARK)
        out.append(" ".join(kept) if any(p != CUT_MARK for p in kept) else v)
    return out


def _cut_distinct(values: list[str], max_width: int | None) -> list[str]:
    """Cut label-like values so that what tells them apart stays: the words every value
    shares become "…" first (only in values that are too long); only then is the end cut."""
    if max_width is None or all(len(v) <= max_width for v in values):
        return values
    return [_cut(e if len(v) > max_width else v, max_width) for v, e in zip(values, _elide_shared(values))]


def terminal_width() -> int | None:
    """The terminal's width when stdout is one, else None (a pipe or file gets whole lines)."""
    import shutil
    import sys

    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    max_width: int | None = 60,
    full: str = "--json",
    width: int | None | str = "auto",
    distinct: Sequence[str] = ("scorer", "label"),
) -> str:
    """A padded text table. Cells longer than ``max_width`` are cut, marked with …, and a
    last line says so and how to see whole values (``full``); None never cuts.

    ``width`` (``auto``: the terminal's, none when piped) squeezes the widest columns until a
    line fits. Columns named in ``distinct`` hold labels: their cells lose the words all of
    them share before anything else, so two scorers never look alike after a cut.
    """
    limit = terminal_width() if width == "auto" else width
    whole = [[cell(v) for v in row] for row in rows]
    natural = [max([len(c)] + [len(r[i]) for r in whole]) for i, c in enumerate(columns)]
    caps = [natural[i] if max_width is None else min(natural[i], max(max_width, len(c))) for i, c in enumerate(columns)]
    by_column = [[r[i] for r in whole] for i in range(len(columns))]
    if isinstance(limit, int):
        # Squeeze the column with the most room above its floor, one character at a time: first
        # down to the floors (a label column's floor: its values with the shared words elided),
        # then, if the terminal is narrower still, down to MIN_COLUMN.
        base = [min(natural[i], max(len(c), MIN_COLUMN)) for i, c in enumerate(columns)]
        floors = [
            max(base[i], min(caps[i], max(len(v) for v in _elide_shared(by_column[i]))))
            if columns[i] in distinct and by_column[i]
            else base[i]
            for i in range(len(columns))
        ]
        gaps = 2 * (len(columns) - 1)
        for bound in (floors, base):
            while sum(caps) + gaps > limit:
                i = max(range(len(caps)), key=lambda k: caps[k] - bound[k])
                if caps[i] <= bound[i]:
                    break
                caps[i] -= 1
    cut_columns = [
        _cut_distinct(col, caps[i]) if columns[i] in distinct else [_cut(v, caps[i]) for v in col]
        for i, col in enumerate(by_column)
    ]
    cells = [[cut_columns[i][j] for i in range(len(columns))] for j in range(len(whole))]
    widths = [len(c) for c in columns]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = max(widths[i], len(v))
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    if cells != whole:
        body.append(f"(long cells are cut and end or skip words with {CUT_MARK}; {full} shows whole values)")
    return "\n".join([line.rstrip(), sep, *body])


def records_table(records: Sequence[dict[str, Any]], *, full: str = "--json") -> str:
    """A table of dicts that share their keys (columns in the first record's order)."""
    cols = list(records[0])
    return table(cols, [[r[c] for c in cols] for r in records], full=full)


def to_csv(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, terminal: bool = False) -> str:
    """CSV as written; on a ``terminal``, control characters escaped (:func:`for_terminal`)."""
    return "".join(csv_lines(columns, rows, terminal=terminal))


def csv_lines(
    columns: Sequence[str], rows: Iterable[Sequence[Any]], *, terminal: bool = False, per_piece: int = 1000
) -> Iterator[str]:
    """``to_csv`` in pieces of ``per_piece`` rows, each made as it is reached (a streamed result)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for n, row in enumerate(rows, 1):
        if terminal:
            row = [for_terminal(v) if isinstance(v, str) else v for v in row]
        w.writerow(
            [
                "" if v is None else (f"<{len(bytes(v))} bytes>" if isinstance(v, (bytes, memoryview)) else v)
                for v in row
            ]
        )
        if n % per_piece == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, memoryview)):
        return f"<{len(bytes(value))} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_json(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    return "".join(json_lines(columns, rows)).removesuffix("\n")


def json_lines(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, per_piece: int = 1000) -> Iterator[str]:
    """The JSON list of row objects ``to_json`` writes (the same text, ``indent=2``, then a
    newline), in pieces of ``per_piece`` rows made as they are reached."""
    parts: list[str] = []
    n = 0
    for n, row in enumerate(rows, 1):
        item = json.dumps({c: _jsonable(v) for c, v in zip(columns, row)}, indent=2, default=str)
        parts.append(("[\n  " if n == 1 else ",\n  ") + item.replace("\n", "\n  "))
        if n % per_piece == 0:
            yield "".join(parts)
            parts.clear()
    parts.append("\n]\n" if n else "[]\n")
    yield "".join(parts)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def params_text(params: dict[str, Any]) -> str:
    """Hyperparameters on one line: ``gamma=0.95 t_temp=5 …``."""
    return " ".join(f"{k}={cell(v)}" for k, v in params.items())
