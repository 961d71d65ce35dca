"""A password in a server URL never reaches the database or the output."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from faultserver import FaultServer

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.masking import mask_credentials

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    "text, masked",
    [
        (
            f"GET http://bob:{SECRET}@127.0.0.1:30000/generate: ConnectError",
            "GET http://bob:***@127.0.0.1:30000/generate",
        ),
        (f"https://u:{SECRET}@h/v1 and postgresql://x:{SECRET}@db/h", "https://u:***@h/v1 and postgresql://x:***@db/h"),
        (f"http://h/generate?api_key={SECRET}&x=1", "http://h/generate?api_key=***&x=1"),
        ("http://bob@h:1/ (no password)", "http://bob@h:1/ (no password)"),
    ],
)
def test_mask_credentials(text: str, masked: str) -> None:
    assert mask_credentials(text).startswith(masked)
    assert SECRET not in mask_credentials(text)


def _all_text(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


def test_server_password_is_masked_in_the_database_and_output(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_standard_episodes(tmp_path / "eps", 1, seed=3, steps_per_subtask=1, output_words=5)
    db = tmp_path / "x.db"
    runner = CliRunner()
    assert runner.invoke(cli, ["--db", str(db), "ingest", str(tmp_path / "eps")]).exit_code == 0
    with make_server(tiny_model_dir) as ref, FaultServer(ref, lambda key, n: "drop") as server:
        url = server.url.replace("http://", f"http://bob:{SECRET}@")
        r = runner.invoke(
            cli,
            [
                "--db",
                str(db),
                "score",
                "--server",
                url,
                "--tokenizer",
                str(tiny_model_dir),
                "--max-context",
                "2048",
                "--max-attempts",
                "1",
                "--concurrency",
                "1",
            ],
        )
        assert server.requests > 0  # the requests were sent, and failed
    dump = _all_text(db)
    assert "connect" in dump and "bob:***@" in dump  # the failures are stored, with the URL masked
    assert SECRET not in dump and SECRET not in r.output
    for args in (
        ["status", "--json"],
        ["scorers", "list", "--json"],
        ["sql", "SELECT * FROM attempt_errors", "--format", "json"],
    ):
        out = runner.invoke(cli, ["--db", str(db), *args]).output
        assert SECRET not in out, args
    # an unreachable server: the one-line error masks the password too
    dead = FaultServer(ref)
    dead_url = dead.url.replace("http://", f"http://bob:{SECRET}@")
    dead.httpd.server_close()
    r = runner.invoke(cli, ["--db", str(db), "score", "--server", dead_url, "--tokenizer", str(tiny_model_dir)])
    assert r.exit_code == 1 and "cannot reach" in r.output and "bob:***@" in r.output, r.output
    assert SECRET not in r.output
