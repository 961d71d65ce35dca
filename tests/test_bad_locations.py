"""A `--db` or `--server` value nothing could connect to gets one line naming it and the fix,
before anything is opened or sent (issue 34 item 7): no traceback, no file created."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli.main import cli
from hcapo_store.errors import UsageError
from hcapo_store.scoring.server_url import check_server_url


def _error_line(result) -> str:
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "--db is empty"),
        ("   ", "--db is empty"),
        ("mysql://me:secret@db.example/x", "scheme 'mysql' is not supported"),
        ("ftp://host/file.db", "scheme 'ftp' is not supported"),
        ("sqlite:///", "names no file"),
        ("DIR", "is not a regular file"),
        ("DIR/", "is not a regular file"),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["init"], ["ingest", "EPISODES"]])
def test_an_unusable_db_is_one_line(tmp_path, monkeypatch, value, says, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    (tmp_path / "EPISODES").mkdir()
    line = _error_line(CliRunner().invoke(cli, ["--db", value, *command]))
    assert says in line, line
    assert "secret" not in line, line
    assert not (tmp_path / "hcapo.db").exists()  # an empty --db is not the default file


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://127.0.0.1:0", "port 0"),
        ("localhost:30000", "e.g. http://localhost:30000"),
        ("ftp://127.0.0.1:30000", "not HTTP"),
        ("http://:30000", "names no host"),
        ("", "is empty"),
    ],
)
@pytest.mark.parametrize("command", ["score", "follow"])
def test_an_unusable_server_url_is_one_line(tmp_path, url, says, command):
    args = ["--db", str(tmp_path / "s.db"), command, "--server", url, "--tokenizer", str(tmp_path)]
    if command == "follow":
        args.append(str(tmp_path))
    line = _error_line(CliRunner().invoke(cli, args))
    assert "--server" in line and says in line, line
    assert not (tmp_path / "s.db").exists()  # refused while parsing options: nothing opened


def test_good_server_urls_pass_unchanged():
    for url in ("http://127.0.0.1:30000", "https://infer.example/v1", "http://[::1]:8000", "http://u:p@h:1"):
        assert check_server_url(url) == url


def test_the_library_check_masks_credentials():
    with pytest.raises(UsageError) as caught:
        check_server_url("http://user:hunter2@host:123456")
    assert "hunter2" not in str(caught.value) and "Port out of range" in str(caught.value)


def test_a_db_path_is_still_a_path(tmp_path: Path):
    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "x.db"), "init"])
    assert r.exit_code == 0, r.output
