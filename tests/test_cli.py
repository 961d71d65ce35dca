"""The CLI through Click's CliRunner and once as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from hcapo_store.cli import cli


def _commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))


@pytest.mark.parametrize("path", list(_commands(cli)), ids=" ".join)
def test_every_command_has_help(runner, path):
    result = runner.invoke(cli, [*path, "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "Usage:" in result.output
    cmd = cli
    for p in path:
        cmd = cmd.commands[p]
    assert (cmd.help or "").strip(), f"{' '.join(path)} has no help text"


def test_ingest_status_sql(runner, db_path, samples):
    r = runner.invoke(cli, ["--db", str(db_path), "ingest", str(samples), "--tag", "task=pg"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "new" in r.output and "0 failed" in r.output
    r = runner.invoke(cli, ["--db", str(db_path), "status", "--json"], catch_exceptions=False)
    data = json.loads(r.output)
    assert data["episodes"] == len(list(samples.glob("episode_*"))) and data["steps"] > 0
    r = runner.invoke(
        cli, ["--db", str(db_path), "sql", "SELECT subtask_id, count(*) AS n FROM steps GROUP BY 1", "--format", "json"]
    )
    got = json.loads(r.output)
    assert sum(x["n"] for x in got) == data["steps"]
    r = runner.invoke(cli, ["--db", str(db_path), "sql", "SELECT key, value FROM tags LIMIT 1", "--format", "csv"])
    assert r.output.splitlines() == ["key,value", "task,pg"]


def test_sql_is_read_only_by_default(runner, db_path, samples):
    runner.invoke(cli, ["--db", str(db_path), "ingest", str(samples)])
    count = ["--db", str(db_path), "sql", "SELECT COUNT(*) AS n FROM steps", "--format", "json"]
    before = json.loads(runner.invoke(cli, count).output)[0]["n"]
    assert before > 0
    r = runner.invoke(cli, ["--db", str(db_path), "sql", "DELETE FROM steps"])
    assert r.exit_code == 1 and "read-only" in r.output
    assert json.loads(runner.invoke(cli, count).output)[0]["n"] == before  # nothing was deleted


def test_ingest_json_and_failure_exit_status(runner, db_path, tmp_path):
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    r = runner.invoke(cli, ["--db", str(db_path), "ingest", str(tmp_path / "bad.jsonl"), "--json"])
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert data["failed"] == 1 and "bad.jsonl:1" in data["failures"][0]["error"]


def test_env_var_selects_database(runner, db_path, samples, monkeypatch):
    monkeypatch.setenv("HCAPO_STORE_DB", str(db_path))
    assert runner.invoke(cli, ["init"]).exit_code == 0
    assert db_path.exists()


@pytest.mark.slow  # a CLI process (the rule); the same commands in process stay fast
def test_subprocess_console_script(tmp_path, samples):
    db = tmp_path / "sub.db"
    exe = Path(sys.executable).with_name("hcapo-store")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "cli"]
    out = subprocess.run([*cmd, "--db", str(db), "ingest", str(samples)], capture_output=True, text=True, check=True)
    assert "0 failed" in out.stdout
    out = subprocess.run([*cmd, "--db", str(db), "status"], capture_output=True, text=True, check=True)
    assert "episodes" in out.stdout


HEAVY = ("sqlalchemy", "alembic", "numpy", "transformers", "torch", "httpx", "rich")


def test_help_imports_no_heavy_module():
    """`hcapo-store --help` starts fast: the CLI module and --help load no database or ML stack."""
    code = (
        "import sys\n"
        "sys.argv = ['hcapo-store', '--help']\n"
        "from hcapo_store.cli import cli\n"
        "try:\n"
        "    cli()\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert "Usage:" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_python_m_runs_the_packages_cli_whatever_cli_py_is_here(tmp_path):
    """A research repository often has its own cli.py: `python -m hcapo_store` must not run it."""
    (tmp_path / "cli.py").write_text("raise SystemExit('the wrong cli.py ran')\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "hcapo_store", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}"},
    )
    assert out.returncode == 0, out.stderr
    assert "Usage: hcapo-store" in out.stdout
    assert "wrong cli.py" not in out.stdout + out.stderr


def test_shared_option_sets_agree():
    """follow takes the credit options and the scorer options of credits compute and score, and
    the log-ratio options (``follow --variant log-ratio``); the keyword list that splits them
    must name exactly the credit options."""
    from hcapo_store.cli.credits import CREDIT_KEYWORDS, credits_compute
    from hcapo_store.cli.log_ratio import KEYWORDS as LOG_RATIO_KEYWORDS
    from hcapo_store.cli.online import follow
    from hcapo_store.cli.score import score

    compute = {p.name for p in credits_compute.params} - {
        "name",
        "scorer",
        "max_logprob_tokens",
        "recompute",
        "as_json",
        *LOG_RATIO_KEYWORDS,  # credits compute --variant log-ratio only, not follow's
    }
    assert compute == set(CREDIT_KEYWORDS)
    scorer = {p.name for p in score.params} - {
        "episodes",
        "min_reward",
        "limit",
        "retry_failed",
        "dry_run",
        "as_json",
        "top_k",
    }
    own = {
        "paths",
        "batch_by",
        "group_size",
        "batch_timeout",
        "until_idle",
        "once",
        "poll_seconds",
        "poll_only",
        "follow_links",
        "compaction",  # ingest's (cli/params.compaction_option)
        "as_json",
    }
    assert {p.name for p in follow.params} == scorer | set(CREDIT_KEYWORDS) | set(LOG_RATIO_KEYWORDS) | own


def test_export_dataset_help_names_the_tokenized_columns(runner):
    """Issue 39 §7: the tokenized rows' ids are ``token_ids`` (not ``input_ids``), and the help says so."""
    from hcapo_store.rendering.token_format import COLUMNS

    result = runner.invoke(cli, ["export", "dataset", "--help"], catch_exceptions=False, terminal_width=400)
    assert all(column in result.output for column in COLUMNS), result.output
    assert "token_ids (not input_ids" in result.output
