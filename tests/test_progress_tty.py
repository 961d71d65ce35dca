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

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _run_in_pty(argv: list[str], cwd: Path) -> tuple[int, str]:
    primary, secondary = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "160", "TERM": "xterm"}
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
