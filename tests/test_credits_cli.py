"""Issue acceptance through the CLI: score once, then credits/exports/report make zero model calls."""

from __future__ import annotations

import json

import pytest

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import make_server


@pytest.fixture(scope="module")
def scored_db(tmp_path_factory, tiny_model_dir):
    from click.testing import CliRunner
    from conftest import EXAMPLES, SAMPLES

    samples = SAMPLES if SAMPLES.exists() else EXAMPLES
    db = tmp_path_factory.mktemp("credits") / "c.db"
    server = make_server(tiny_model_dir).start()
    runner = CliRunner()
    assert runner.invoke(cli, ["--db", str(db), "ingest", str(samples), "--tag", "task=pg"]).exit_code == 0
    r = runner.invoke(
        cli,
        [
            "--db",
            str(db),
            "score",
            "--server",
            server.url,
            "--tokenizer",
            str(tiny_model_dir),
            "--max-context",
            "2048",  # what is asserted needs scores, not long prompts: 8192 cost ~25 more CPU-seconds
            "--json",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["failed"] == 0
    yield db, server
    server.shutdown()


def test_five_credit_runs_make_no_model_calls(runner, scored_db, tmp_path):
    db, server = scored_db
    before = server.requests
    sets = [[], ["--gamma", "0.5"], ["--no-smooth"], ["--no-dense-rewards"], ["--t-temp", "1.0", "--c-max", "2.0"]]
    for args in sets:
        r = runner.invoke(cli, ["--db", str(db), "credits", "compute", *args], catch_exceptions=False)
        assert r.exit_code == 0 and "computed credit run" in r.output, r.output
    r = runner.invoke(cli, ["--db", str(db), "credits", "list", "--json"])
    assert len(json.loads(r.output)) == 5
    # same parameters again: the existing run, not a sixth one
    r = runner.invoke(cli, ["--db", str(db), "credits", "compute", "--gamma", "0.5", "--name", "other"])
    assert "already has this scorer and these parameters" in r.output
    names = {x["name"] for x in json.loads(runner.invoke(cli, ["--db", str(db), "credits", "list", "--json"]).output)}
    g05 = next(
        n
        for n in names
        if n != "default"
        and json.loads(runner.invoke(cli, ["--db", str(db), "credits", "show", n, "--json"]).output)["params"]["gamma"]
        == 0.5
    )
    r = runner.invoke(cli, ["--db", str(db), "credits", "diff", "default", g05, "--json"])
    diff = json.loads(r.output)
    assert diff["common_steps"] > 0 and diff["delta_q_h_smoothed"]["max"] <= 1e-12 < -diff["delta_q_h_smoothed"]["min"]
    # gamma 0.95 → 0.5 lowers q_h of steps far from their group's end
    r = runner.invoke(
        cli,
        [
            "--db",
            str(db),
            "sql",
            "--format",
            "json",
            "SELECT a.q_h AS qa, b.q_h AS qb FROM step_credits a JOIN step_credits b "
            f"ON a.step_id = b.step_id WHERE a.run = 'default' AND b.run = '{g05}' AND a.q_h > 0 "
            "AND a.discount < 1",
        ],
    )
    pairs = json.loads(r.output)
    assert pairs and all(p["qb"] < p["qa"] for p in pairs)
    r = runner.invoke(
        cli,
        [
            "--db",
            str(db),
            "sql",
            "SELECT subtask_id, avg(q_h_smoothed) FROM step_credits WHERE run = 'default' GROUP BY 1",
        ],
    )
    assert r.exit_code == 0 and "subtask_id" in r.output and "rows)" in r.output
    out = tmp_path / "exports"
    r = runner.invoke(cli, ["--db", str(db), "export", "hindsight-json", str(out / "hs"), "--credits", "default"])
    assert r.exit_code == 0, r.output
    files = list((out / "hs").rglob("hindsight_scores.json"))
    assert files and json.loads(files[0].read_text())["hyperparams"]["gamma"] == 0.95
    r = runner.invoke(
        cli,
        [
            "--db",
            str(db),
            "export",
            "dataset",
            str(out / "hcapo_train.jsonl"),
            "--credits",
            "default",
            "--min-reward",
            "0",
            "--group-by",
            "task",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "hcapo_train.jsonl").read_text().splitlines()]
    assert rows and all(len(x["step_advantages"]) == len(x["step_message_indices"]) for x in rows)
    assert all(x["messages"][i]["role"] == "assistant" for x in rows for i in x["step_message_indices"])
    r = runner.invoke(cli, ["--db", str(db), "report", str(out / "r.html"), "--credits", "default"])
    assert r.exit_code == 0 and (out / "r.html").read_text().count("<svg") >= 4
    assert server.requests == before
