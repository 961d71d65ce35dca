"""Small things a new user trips on (issue 22): an empty credit run is refused and never listed,
`sql --json`, and --help text that reads as sentences and names its reference page."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from test_credits import add_scorer

from hcapo_store.cli import cli
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


def test_an_empty_credit_run_exits_1_and_is_not_listed(tmp_path):
    db = tmp_path / "x.db"
    with Store.open(str(db)) as store:
        ingest(store, [REPO / "examples" / "trajectories"])
        add_scorer(store, "s" * 64)  # a scorer with no score at all: every episode incomplete
    r = CliRunner().invoke(cli, ["--db", str(db), "credits", "compute"])
    assert r.exit_code == 1, r.output
    line = r.output.strip()
    assert line.startswith("Error: no episode is completely scored under scorer ssssssssssss (4 incomplete)")
    assert "score the missing steps first" in line
    listed = CliRunner().invoke(cli, ["--db", str(db), "credits", "list", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.output) == []


def test_sql_json_is_format_json(tmp_path):
    db = tmp_path / "x.db"
    with Store.open(str(db)) as store:
        ingest(store, [REPO / "examples" / "trajectories"])
    q = "SELECT name, reward FROM episodes ORDER BY name"
    a = CliRunner().invoke(cli, ["--db", str(db), "sql", q, "--json"])
    b = CliRunner().invoke(cli, ["--db", str(db), "sql", q, "--format", "json"])
    assert a.exit_code == b.exit_code == 0 and a.output == b.output
    assert len(json.loads(a.output)) == 4
    c = CliRunner().invoke(cli, ["--db", str(db), "sql", q, "--json", "--format", "csv"])
    assert c.exit_code == 2 and "pick one" in c.output


def test_every_command_names_its_reference_page_and_export_dataset_reads_as_a_sentence():
    r = CliRunner().invoke(cli, ["export", "--help"])
    assert "Write training rows weighted by HCAPO (Eq. 8), as JSONL or Parquet." in " ".join(r.output.split())
    assert "Write Eq.\n" not in r.output
    for command in (["ingest"], ["score"], ["credits"], ["export"], ["report"], ["show"], ["sql"], ["status"], ["db"]):
        help_text = CliRunner().invoke(cli, [*command, "--help"]).output
        page = next(p for p in ("INGEST", "SCORING", "CREDITS", "OUTPUTS", "DATABASE") if f"docs/{p}.md" in help_text)
        assert (REPO / "docs" / f"{page}.md").is_file()


def test_option_defaults_are_the_librarys_own():
    """One home for defaults: what `score`, `follow` and `credits compute` do unasked is what
    ScoreConfig, RunOptions and CreditParams do."""
    from hcapo_store.credits.params import CreditParams
    from hcapo_store.scoring.job import ScoreConfig
    from hcapo_store.scoring.scheduler import RunOptions

    config, run, credit = ScoreConfig(), RunOptions(), CreditParams()
    expected = {
        "concurrency": run.concurrency,
        "max_attempts": run.max_attempts,
        "lease_seconds": run.lease_seconds,
        "grouping": run.grouping,
        "max_logprob_tokens": config.max_logprob_tokens,
        "max_new_tokens": config.max_new_tokens,
        "request_timeout": config.request_timeout,
        "truncation": config.truncation,
        "action_span": config.action_span,
        "prompt_layout": config.prompt_layout,
    }
    credit_expected = {
        k: getattr(credit, k)
        for k in ("t_temp", "gamma", "c_min", "c_max", "alpha", "variant", "omega", "min_reward", "success_threshold")
    }
    commands = {"score": cli.commands["score"], "follow": cli.commands["follow"]}
    compute = cli.commands["credits"].commands["compute"]  # type: ignore[attr-defined]
    for name, command in commands.items():
        defaults = {p.name: p.default for p in command.params}
        for key, value in expected.items():
            assert defaults[key] == value, (name, key, defaults[key], value)
    for command in (compute, cli.commands["follow"]):
        defaults = {p.name: p.default for p in command.params}
        for key, value in credit_expected.items():
            assert defaults[key] == value, (command.name, key, defaults[key], value)
