"""Notebook use: scoring inside a running event loop, DataFrames, the documented notebook example, Parquet scores, datasette."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO
from test_credits import add_scorer, add_scores, read_credits

import hcapo_store as hs
from hcapo_store.analysis.datasette import DOCUMENTED, QUERIES
from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store, count


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _new_store(tmp_path: Path) -> Store:
    episodes = tmp_path / "episodes"
    write_standard_episodes(episodes, 2, steps_per_subtask=1, output_words=10)
    store = Store.open(str(tmp_path / "s.db"))
    ingest(store, [episodes])
    return store


def _cfg(ref: ReferenceServer, tiny_model_dir: Path) -> hs.ScoreConfig:
    return hs.ScoreConfig(backend="sglang", server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048)


def test_sync_scoring_works_inside_a_running_event_loop(
    tmp_path: Path, ref: ReferenceServer, tiny_model_dir: Path
) -> None:
    store = _new_store(tmp_path)

    async def notebook_cell() -> hs.ScoreReport:
        asyncio.get_running_loop()  # as in Jupyter: a loop is running
        prep = hs.prepare(store, _cfg(ref, tiny_model_dir))
        return hs.run_scoring(store, prep, hs.RunOptions(concurrency=2))

    report = asyncio.run(notebook_cell())
    assert report.failed == 0 and report.scored == count(store, "SELECT COUNT(*) FROM steps") > 0
    store.close()


def test_async_entry_points_run_on_the_callers_loop(tmp_path: Path, ref: ReferenceServer, tiny_model_dir: Path) -> None:
    store = _new_store(tmp_path)

    async def notebook_cell() -> hs.ScoreReport:
        prep = await hs.prepare_async(store, _cfg(ref, tiny_model_dir))
        return await hs.run_scoring_async(store, prep, hs.RunOptions(concurrency=2))

    report = asyncio.run(notebook_cell())
    assert report.failed == 0 and report.scored == count(store, "SELECT COUNT(*) FROM steps") > 0
    store.close()


@pytest.fixture
def credited(store: Store, samples: Path) -> Store:
    ingest(store, [samples])
    add_scorer(store, "sc", "test-scorer")
    add_scores(store, "sc", seed=3)
    compute_credits(store)  # the run named "default"
    return store


def test_frames(credited: Store) -> None:
    frame = hs.credits_frame(credited, "default")
    want = read_credits(credited, "default")
    assert len(frame) == sum(len(v) for v in want.values())
    for name, steps in want.items():
        got = frame[frame["episode"] == name].sort_values("step_index")
        assert got["q_h_smoothed"].tolist() == [s["q_h_smoothed"] for s in steps]
    steps = hs.steps_frame(credited, token_logprobs=True)
    _, blobs = credited.query(
        "SELECT s.step_id, sc.token_logprobs FROM step_scores s JOIN scores sc "
        "ON sc.step_id = s.step_id AND sc.scorer_id = s.scorer_id"
    )
    by_step = {sid: np.frombuffer(b, dtype="<f4") for sid, b in blobs}
    assert len(steps) == len(by_step)
    for sid, lps, mean in zip(steps["step_id"], steps["token_logprobs"], steps["mean_logprob"]):
        assert lps.dtype == np.float32 and np.array_equal(lps, by_step[sid])
        assert float(lps.astype(np.float64).mean()) == pytest.approx(mean)
    assert "token_logprobs" not in hs.steps_frame(credited).columns


def _readme_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "OUTPUTS.md").read_text(), flags=re.DOTALL)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"one docs/OUTPUTS.md python block with {marker!r}"
    return found[0]


def test_readme_notebook_example_runs(credited: Store, db_path: Path, tmp_path: Path, monkeypatch) -> None:
    code = _readme_block("credits_frame")
    assert len(code.strip().splitlines()) <= 12
    credited.close()
    monkeypatch.chdir(tmp_path)
    db_path.rename(tmp_path / "hcapo.db")
    namespace: dict = {}
    exec(compile(code, "docs/OUTPUTS.md", "exec"), namespace)
    assert (tmp_path / "scores.parquet").exists() and (tmp_path / "report.html").exists()
    assert len(namespace["credits"]) > 0


def test_export_scores_parquet(credited: Store, db_path: Path, tmp_path: Path, runner) -> None:
    import pyarrow.parquet as pq

    r = runner.invoke(cli, ["--db", str(db_path), "export", "scores", str(tmp_path / "s.parquet")])
    assert r.exit_code == 0, r.output
    table = pq.read_table(tmp_path / "s.parquet")
    import pyarrow as pa

    kind = table.schema.field("token_logprobs").type
    assert pa.types.is_list(kind) and kind.value_type == pa.float32()
    rows = table.to_pylist()
    _, blobs = credited.query("SELECT step_id, token_logprobs FROM scores WHERE scorer_id = 'sc'")
    by_step = {sid: np.frombuffer(b, dtype="<f4").tolist() for sid, b in blobs}
    assert len(rows) == len(by_step)
    for row in rows:
        assert row["token_logprobs"] == by_step[row["step_id"]]
        assert row["scorer_id"] == "sc" and row["episode"] and row["step_index"] >= 0


def test_export_scores_without_scorer_is_a_clean_error(store: Store, db_path: Path, tmp_path: Path, runner) -> None:
    r = runner.invoke(cli, ["--db", str(db_path), "export", "scores", str(tmp_path / "s.parquet")])
    assert r.exit_code == 1 and "no scorer" in r.output and "Traceback" not in r.output


def test_datasette_metadata_describes_real_columns(credited: Store, db_path: Path, tmp_path: Path, runner) -> None:
    r = runner.invoke(cli, ["--db", str(db_path), "datasette-metadata", str(tmp_path / "m.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "m.json").read_text())
    ((name, database),) = doc["databases"].items()
    assert name == db_path.stem
    con = sqlite3.connect(db_path)
    for table, meta in database["tables"].items():
        columns = {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
        assert columns, f"{table} is not in the schema"
        assert set(meta["columns"]) <= columns, (table, set(meta["columns"]) - columns)
        assert meta["description"]
    page = (REPO / "docs" / "DATABASE.md").read_text()
    for key, query in database["queries"].items():
        documented = DOCUMENTED[key]["sql"]
        assert documented in page  # the documented example queries, verbatim
        # in datasette the run and the subtask are parameters; with the documented values the
        # canned query gives the documented query's rows
        assert query["sql"] == documented.replace("'default'", ":run").replace("'S2'", ":subtask")
        assert set(query.get("params", [])) == {p for p in ("run", "subtask") if f":{p}" in query["sql"]}
        want = con.execute(documented).fetchall()
        assert con.execute(query["sql"], {"run": "default", "subtask": "S2"}).fetchall() == want
    assert database["queries"]["top_steps_by_rho"]["params"] == ["run", "subtask"]
    assert "identity" in database["tables"]["episodes"]["columns"]["source_key"]
    assert len(database["queries"]) == len(QUERIES) == 3


def test_datasette_serves_the_metadata(credited: Store, db_path: Path) -> None:
    datasette_app = pytest.importorskip("datasette.app")
    name = db_path.stem
    ds = datasette_app.Datasette([str(db_path)], metadata=hs.datasette_metadata(name).as_dict())

    async def get(path: str) -> Any:
        response = await ds.client.get(path)
        assert response.status_code == 200, (path, response.text[:300])
        return response

    async def main() -> None:
        con = sqlite3.connect(db_path)
        for query in QUERIES:
            rows = (await get(f"/{name}/{query}.json?_shape=array&run=default&subtask=S2")).json()
            assert [tuple(r.values()) for r in rows] == con.execute(DOCUMENTED[query]["sql"]).fetchall()
        other = (await get(f"/{name}/mean_q_h_per_subtask.json?_shape=array&run=nothing")).json()
        assert other == []  # the run is a real parameter
        page = (await get(f"/{name}/step_credits")).text
        assert "rho * discount * r_t (Eq. 7)" in page  # a column description is shown

    asyncio.run(main())
