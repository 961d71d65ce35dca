"""The offline DuckDB routes of docs/OUTPUTS.md: the Parquet exports, and the sqlite extension from its PyPI wheel."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_credits import add_scorer, add_scores

from hcapo_store.credits.compute import compute_credits
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.scores import export_scores
from hcapo_store.storage.store import Store

duckdb = pytest.importorskip("duckdb")


def _sqlite_extension() -> Path | None:
    try:
        import duckdb_ext  # namespace package of the duckdb-ext-* wheels
    except ImportError:
        return None
    path = (
        Path(duckdb_ext.__path__[0])
        / "extensions"
        / f"v{duckdb.__version__}"
        / "linux_amd64"
        / "sqlite_scanner.duckdb_extension"
    )
    return path if path.is_file() else None


@pytest.fixture
def credited(store: Store, samples: Path) -> Store:
    ingest(store, [samples])
    add_scorer(store, "sc")
    add_scores(store, "sc", seed=2)
    compute_credits(store)
    return store


def test_duckdb_reads_the_scores_parquet(credited: Store, tmp_path: Path) -> None:
    export_scores(credited, tmp_path / "scores.parquet")
    con = duckdb.connect()
    got = con.execute(
        f"SELECT step_id, list_avg(token_logprobs), len(token_logprobs) "
        f"FROM '{tmp_path / 'scores.parquet'}' ORDER BY step_id"
    ).fetchall()
    want = credited.query("SELECT step_id, mean_logprob, token_count FROM scores ORDER BY step_id")[1]
    assert len(got) == len(want) > 0
    for (sid, mean, n), (wsid, wmean, wn) in zip(got, want):
        assert sid == wsid and n == wn and mean == pytest.approx(wmean, abs=1e-5)


def test_duckdb_attaches_the_database_with_the_wheel_extension(credited: Store, db_path: Path) -> None:
    ext = _sqlite_extension()
    if ext is None:
        pytest.skip("duckdb-ext-sqlite for this duckdb version is not installed")
    con = duckdb.connect()
    con.execute(f"LOAD '{ext}'")
    con.execute(f"ATTACH '{db_path}' AS h (TYPE sqlite)")
    n = con.execute("SELECT count(*) FROM h.step_credits WHERE run = 'default'").fetchone()[0]
    assert n == credited.query("SELECT count(*) FROM step_credits WHERE run = 'default'")[1][0][0] > 0
