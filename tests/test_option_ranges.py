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


def _all_commands(group, path=()):
    """Every command's argv path, the root group first."""
    yield path
    for name, sub in getattr(group, "commands", {}).items():
        yield from _all_commands(sub, (*path, name))


def _ranges_shown(help_text: str) -> list[str]:
    """The range parts of the help's bracketed extras, e.g. ``1<=x<=1024`` or ``x>=0``."""
    import re

    flat = " ".join(help_text.split())  # Click wraps the bracket over lines
    return [part.strip() for extra in re.findall(r"\[([^\]]*)\]", flat) for part in extra.split(";") if "x" in part]


def test_help_shows_only_the_bounds_an_option_really_has():
    """Click printed `x<=None` for a float with no bound and int32's guard as a range."""
    runner = CliRunner()
    ranges: list[str] = []
    paths = list(_all_commands(cli))
    assert len(paths) > 20  # the walk reached the subcommands
    for path in paths:
        r = runner.invoke(cli, [*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        shown = _ranges_shown(r.output)
        ranges += shown
        for text in shown:
            assert "None" not in text and "2147483647" not in text, (path, text)
    assert "x>=1" in ranges and "1<=x<=1024" in ranges  # real bounds are still shown


def test_no_range_options_print_no_range_but_refuse_what_int32_cannot_hold(tmp_path):
    r = CliRunner().invoke(cli, ["score", "--help"])
    flat = " ".join(r.output.split())
    start = flat.index("--max-logprob-tokens")
    entry = flat[start : flat.index(" --", start + 5)]
    assert "INTEGER" in entry and "RANGE" not in entry and "x" not in entry.split("[")[-1], entry
    g = CliRunner().invoke(cli, ["credits", "compute", "--help"])
    flat = " ".join(g.output.split())
    gamma = flat[flat.index("--gamma") : flat.index(" --", flat.index("--gamma") + 5)]
    assert gamma.endswith("[default: 0.95]"), gamma
    argv = ["--db", str(tmp_path / "x.db"), "score", "--server", "http://127.0.0.1:9", "--max-logprob-tokens"]
    huge = CliRunner().invoke(cli, [*argv, str(2**31)])
    assert huge.exit_code == 2 and "--max-logprob-tokens" in huge.output and "2147483647" in huge.output
    assert not (tmp_path / "x.db").exists()
