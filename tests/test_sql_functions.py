"""Read-only SQL on SQLite calls only functions from a list of known-safe ones (issue 34 item 6).

``fts3_tokenizer()`` registers a tokenizer at a pointer the query chooses (and leaks a heap
address); ``load_extension()`` loads code; a function an extension registers is unknown. Each
is refused by name; the queries the README and docs/ show keep working, on a real store.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import event

from hcapo_store.cli.main import cli
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import StoreError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.readonly import SAFE_SQLITE_FUNCTIONS
from hcapo_store.storage.store import Store

ROOT = Path(__file__).resolve().parents[1]
POSTGRES_ONLY = ("current_user",)


def _documented_queries() -> list[str]:
    """Every `hcapo-store sql "…"` of the README and docs/, and every statement of a ```sql block."""
    queries: list[str] = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        queries += re.findall(r'hcapo-store(?: --db \S+)? sql (?:--\S+ )*"([^"]+)"', text)
        for block in re.findall(r"```sql\n(.*?)```", text, re.S):
            body = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("--"))
            queries += [q.strip() for q in body.split(";") if q.strip()]
    return [q for q in dict.fromkeys(queries) if not any(word in q for word in POSTGRES_ONLY)]


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sqlfn")
    write_standard_episodes(root / "episodes", 2, seed=11, steps_per_subtask=1, output_words=8)
    path = root / "store.db"
    with Store.open(str(path)) as store:
        ingest(store, [root / "episodes"])
    return path


def _sql(path: Path, query: str):
    return CliRunner().invoke(cli, ["--db", str(path), "sql", query])


@pytest.mark.parametrize(
    "query",
    [
        "SELECT fts3_tokenizer('simple')",
        "SELECT hex(FTS3_TOKENIZER('simple'))",
        "SELECT fts3_tokenizer('mine', x'0000000000000000')",
        "SELECT load_extension('/tmp/nothing')",
        "SELECT sqlite_log(1, 'x')",
        "SELECT rtreenode(2, x'00')",
    ],
)
def test_unsafe_functions_are_refused_by_name(store_path, query):
    r = _sql(store_path, query)
    assert r.exit_code == 1, r.output
    name = re.match(r"SELECT (?:hex\()?(\w+)", query).group(1).lower()  # type: ignore[union-attr]
    assert f"{name}()" in r.output.lower() and "not on the list" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_documented_queries_still_run(store_path):
    queries = _documented_queries()
    assert len(queries) >= 4, queries  # the README's and docs/DATABASE.md's at least
    for query in queries:
        r = _sql(store_path, query)
        assert r.exit_code == 0, (query, r.output)


def test_ordinary_functions_still_run(store_path):
    query = (
        "SELECT count(*), max(step_index), json_extract('{\"a\": 2}', '$.a'), '{\"b\": 3}' ->> 'b', "
        "date('now') IS NOT NULL, round(sqrt(16.0)), group_concat(DISTINCT typeof(id)), "
        "(SELECT count(*) FROM json_each('[1, 2, 3]')), (SELECT count(*) FROM pragma_table_info('steps')) > 0 "
        "FROM steps"
    )
    r = _sql(store_path, query)
    assert r.exit_code == 0, r.output
    assert "json_extract" in r.output


def test_a_function_outside_the_list_is_refused_even_when_registered(store_path):
    """A function this SQLite (or an extension) has that the list does not name is not called."""
    calls: list[int] = []
    with Store.open(str(store_path), create=False) as store:

        @event.listens_for(store.engine, "connect")
        def _register(dbapi_conn, _record) -> None:
            dbapi_conn.create_function("side_effect", 0, lambda: calls.append(1) or 1)

        store.engine.dispose()
        with pytest.raises(StoreError, match=r"side_effect\(\)"):
            store.query("SELECT side_effect()")
        assert store.query("SELECT side_effect()", read_only=False)[1] == [(1,)]  # --write: the user's call
    assert calls == [1]


def test_the_list_names_no_function_known_to_be_unsafe():
    assert not SAFE_SQLITE_FUNCTIONS & {"fts3_tokenizer", "load_extension", "sqlite_log", "rtreenode", "optimize"}
