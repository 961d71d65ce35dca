"""Option values the library cannot use are refused by the option itself: one line with the
range, no traceback (issue 21: NaN, infinity and huge numbers reached asyncio, SQL and sqlite)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli

CASES = [
    (["score", "--server", "http://127.0.0.1:9", "--concurrency", "100000000000000000000"], "--concurrency"),
    (["score", "--server", "http://127.0.0.1:9", "--max-context", "1e400"], "--max-context"),
    (["score", "--server", "http://127.0.0.1:9", "--lease-seconds", "nan"], "--lease-seconds"),
    (["score", "--server", "http://127.0.0.1:9", "--lease-seconds", "inf"], "--lease-seconds"),
    (["score", "--server", "http://127.0.0.1:9", "--request-timeout", "nan"], "--request-timeout"),
    (["score", "--server", "http://127.0.0.1:9", "--min-reward", "nan"], "--min-reward"),
    (
        ["score", "--server", "http://127.0.0.1:9", "--max-tool-result-chars", "99999999999999999999"],
        "--max-tool-result-chars",
    ),
    (["ingest", "x", "--max-tool-result-chars", "-5"], "--max-tool-result-chars"),
    (["credits", "compute", "--gamma", "nan"], "--gamma"),
    (["credits", "compute", "--t-temp", "inf"], "--t-temp"),
    (["export", "dataset", "out.jsonl", "--omega", "nan"], "--omega"),
    (["export", "dataset", "out.jsonl", "--min-reward", "-inf"], "--min-reward"),
    (["sql", "SELECT 1", "--timeout", "nan"], "--timeout"),
]


@pytest.mark.parametrize("argv,option", CASES, ids=[" ".join(c[0][:2] + c[0][-2:]) for c in CASES])
def test_unusable_option_values_are_one_line_naming_the_option(tmp_path, argv, option):
    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "x.db"), *argv])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "Traceback" not in r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: Invalid value for") and option in last, r.output
    assert not (tmp_path / "x.db").exists()  # refused before anything was touched


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-1", "soon"])
def test_a_busy_timeout_that_is_not_a_number_of_seconds_is_one_line(tmp_path, monkeypatch, value):
    monkeypatch.setenv("HCAPO_STORE_BUSY_TIMEOUT", value)
    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "x.db"), "init"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip() == (f"Error: HCAPO_STORE_BUSY_TIMEOUT={value!r} is not a number of seconds in [0, 86400]")


def test_a_hindsight_template_that_is_not_utf8_is_one_line(tmp_path):
    template = tmp_path / "t.txt"
    template.write_bytes("Outcome: {reward} \u2014 r\u00e9sum\u00e9".encode("latin-1", "replace") + b"\xe9\xff")
    argv = [
        "--db",
        str(tmp_path / "x.db"),
        "score",
        "--server",
        "http://127.0.0.1:9",
        "--hindsight-template",
        str(template),
    ]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: Invalid value for --hindsight-template:") and "is not UTF-8 text" in last, r.output
