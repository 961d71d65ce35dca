"""`hcapo-store sql` streams its result to the output (issue 41): a result of any size costs a
few rows' memory. A query with no end (a recursive CTE) still writes its first rows at once;
before, the whole result was collected first (20M rows: a MemoryError traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent
ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c"


def _first_lines(db: str, fmt: str, n: int = 4) -> list[str]:
    """The first ``n`` lines `hcapo-store sql ENDLESS` writes (a process, killed after them)."""
    argv = [sys.executable, "-m", "hcapo_store", "--db", db, "sql", ENDLESS, "--format", fmt, "--timeout", "120"]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        return [proc.stdout.readline() for _ in range(n)]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_an_endless_result_is_written_as_it_is_read(tmp_path: Path, fmt: str) -> None:
    db = tmp_path / "s.db"
    Store.open(str(db)).close()
    head = _first_lines(str(db), fmt)
    if fmt == "csv":
        assert head == ["x\n", "1\n", "2\n", "3\n"]
    else:
        assert head == ["[\n", "  {\n", '    "x": 1\n', "  },\n"]


def test_an_endless_result_is_written_as_it_is_read_on_postgresql() -> None:
    """PostgreSQL streams too (psycopg's single-row mode): the first rows of an endless result
    arrive while the server still computes it."""
    from pg import fresh_database

    with fresh_database("sqlstream") as url:
        Store.open(url).close()
        head = _first_lines(url, "csv")
    assert head == ["x\n", "1\n", "2\n", "3\n"]


def test_streamed_output_is_the_whole_result(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    Store.open(str(db)).close()
    q = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2500) SELECT x, 'r' || x AS r FROM c"
    runner = CliRunner()
    r = runner.invoke(cli, ["--db", str(db), "sql", q, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == [{"x": i, "r": f"r{i}"} for i in range(1, 2501)]
    r = runner.invoke(cli, ["--db", str(db), "sql", q, "--format", "csv"])
    assert r.output.splitlines() == ["x,r"] + [f"{i},r{i}" for i in range(1, 2501)]
    r = runner.invoke(cli, ["--db", str(db), "sql", "SELECT 1 AS x WHERE 0", "--json"])
    assert r.output == "[]\n"
    r = runner.invoke(cli, ["--db", str(db), "sql", ENDLESS + " LIMIT 10005"])
    assert r.exit_code == 0 and r.output.rstrip().endswith(
        "(10005 rows; the first 10000 shown: --format csv or json writes them all)"
    ), r.output[-300:]
