"""`score` on a terminal shows the total and a time remaining (issue 22: it showed `198/?` and
an empty ETA). A real `python -m hcapo_store score` in a pseudo-terminal, against a real server."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _run_in_pty(argv: list[str], cwd: Path, columns: int = 160) -> tuple[int, str]:
    primary, secondary = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary, cwd=cwd, env=env)
    os.close(secondary)
    chunks = []
    while True:  # read until the child closes the terminal: a state, not a time
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: the child is gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    return proc.wait(timeout=600), b"".join(chunks).decode(errors="replace")


def test_score_on_a_terminal_shows_the_total_and_a_time_remaining(tmp_path, ref, tiny_model_dir):
    db = tmp_path / "x.db"
    with Store.open(str(db)) as store:
        ingest(store, [REPO / "examples" / "trajectories"])
        steps = store.query("SELECT count(*) FROM steps", read_only=True)[1][0][0]
    argv = [sys.executable, "-m", "hcapo_store", "--db", str(db), "score", "--server", ref.url]
    argv += ["--tokenizer", str(tiny_model_dir), "--max-context", "2048", "--grouping", "per-step"]
    code, out = _run_in_pty(argv, tmp_path)
    assert code == 0, out
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # the bar's cursor movements
    assert f"{steps}/{steps}" in text, text
    # once steps are being counted the total is known (`0/?` only while the queue is planned)
    assert not re.search(r"\b[1-9]\d*/\?", text), text
    # the time remaining is a value (rich's compact form, e.g. 0:01 or 0:00), not a blank
    assert re.search(rf"{steps}/{steps} .*ETA\s+\d+:\d\d", text), text


def test_ingest_shows_the_total_on_a_terminal_and_in_a_pipe(tmp_path):
    db = tmp_path / "x.db"
    argv = [sys.executable, "-m", "hcapo_store", "--db", str(db), "ingest", str(REPO / "examples" / "trajectories")]
    code, out = _run_in_pty(argv, tmp_path)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    assert code == 0 and "4/4" in text, text
    piped = subprocess.run(
        [*argv[:4], str(tmp_path / "y.db"), *argv[5:]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert piped.returncode == 0 and "ingest: 4/4 episodes" in piped.stderr, piped.stderr


@pytest.mark.slow
def test_tables_fit_the_terminal(tmp_path, ref, tiny_model_dir, runner):
    """Two scorers whose labels differ only in the context size: on an 80-column terminal each
    line fits and the two labels still differ; piped, the labels are whole. The two scorers are
    made in process (CliRunner): only the listing is about a terminal."""
    db = tmp_path / "x.db"
    with Store.open(str(db)) as store:
        ingest(store, [REPO / "examples" / "trajectories"])
    base = [sys.executable, "-m", "hcapo_store", "--db", str(db)]
    for ctx in ("2048", "4096"):
        argv = ["--db", str(db), "score", "--server", ref.url, "--tokenizer", str(tiny_model_dir), "--max-context", ctx]
        done = runner.invoke(cli, argv)
        assert done.exit_code == 0, done.output
    code, out = _run_in_pty([*base, "scorers", "list"], tmp_path, columns=80)
    lines = [line for line in out.replace("\r", "").splitlines() if line]
    assert code == 0 and all(len(line) <= 80 for line in lines), out
    labels = [line.split("  ")[1].strip() for line in lines[2:4]]
    assert labels[0] != labels[1] and "ctx=2048" in labels[0] + labels[1] and "ctx=4096" in labels[0] + labels[1], out
    piped = subprocess.run(
        [*base, "scorers", "list"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert "…" not in piped.stdout.splitlines()[2], piped.stdout
