"""Issue 34 item 7's input leftovers, each one line and never a traceback: an entry with mode
000, lone surrogates in an id or a tool name, a --tag that is no UTF-8, an empty folder, and
episodes already stored from another place. Real processes on real files and SQLite (the
arguments and permissions a process is given); `follow`, and the ingests beside it, in process
(CliRunner: the console script's own `cli`), where an escaped exception fails the test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import EpisodeBuilder

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _run(*args: str | bytes, as_unprivileged: bool = False) -> subprocess.CompletedProcess[str]:
    argv: list[str | bytes] = [sys.executable, "-m", "hcapo_store", *args]
    if as_unprivileged and os.geteuid() == 0:
        # root reads a mode-000 folder anyway: drop the capabilities that let it, as a user has none
        drop = "-dac_override,-dac_read_search"
        argv = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *argv]
    return subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=600)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(list(args), r.exit_code, r.stdout, r.stderr)


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def _good(directory: Path, n: int) -> Path:
    return EpisodeBuilder(seed=900 + n, episode_id=n).standard(steps_per_subtask=1, output_words=5).write(directory)


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root without setpriv")
def test_an_entry_with_mode_000_is_one_failure(tmp_path: Path) -> None:
    """Path.is_symlink() raises PermissionError under a folder that cannot be searched (Python
    3.11): that was a traceback and nothing stored."""
    root = tmp_path / "runs"
    _good(root / "episode_ok", 1)
    locked = _good(root / "episode_locked", 2)
    locked.chmod(0)
    try:
        r = _run("--db", str(tmp_path / "s.db"), "ingest", str(root), as_unprivileged=True)
    finally:
        locked.chmod(0o755)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, r.stderr
    failed = [line for line in r.stderr.splitlines() if line.startswith("failed: ")]
    assert len(failed) == 1 and "episode_locked" in failed[0] and "permission denied" in failed[0].lower()
    assert "1 new" in r.stdout and "1 failed" in r.stdout


def test_lone_surrogates_in_an_id_or_a_tool_name_are_one_line_each(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    bad_id = json.dumps({"episode_id": "ab\ud800c", "reward": 1, "messages": msgs})
    call = {"id": "c", "type": "function", "function": {"name": "t\udc80", "arguments": "{}"}}
    tool = json.dumps({"episode_id": "e2", "reward": 1, "messages": [msgs[0], {**msgs[1], "tool_calls": [call]}]})
    (root / "ids.jsonl").write_text(bad_id + "\n")
    (root / "tools.jsonl").write_text(tool + "\n")
    session = EpisodeBuilder(seed=1, episode_id=3).standard(steps_per_subtask=1, output_words=5)
    pi = session.write(root / "episode_pi")
    text = (pi / "pi_session.jsonl").read_text()
    header = json.loads(text.splitlines()[0])
    lines = text.splitlines()
    lines[0] = lines[0].replace(json.dumps(header["id"]), '"\\ud83d-cut"')
    (pi / "pi_session.jsonl").write_text("\n".join(lines) + "\n")
    r = _run("--db", str(tmp_path / "s.db"), "ingest", str(root))
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1
    failed = [line for line in r.stderr.splitlines() if line.startswith("failed: ")]
    assert len(failed) == 2, failed
    assert any("ids.jsonl:1" in f and "episode_id holds a lone UTF-16 surrogate" in f for f in failed)
    assert any("episode_pi" in f and "session header's id holds a lone UTF-16 surrogate" in f for f in failed)
    assert "warning: runs/tools.jsonl#e2: 1 lone UTF-16 surrogate(s)" in r.stderr
    assert "1 new" in r.stdout


def test_a_tag_that_is_no_utf8_is_one_line(tmp_path: Path) -> None:
    _good(tmp_path / "runs" / "episode_ok", 1)
    r = _run("--db", str(tmp_path / "s.db"), "ingest", str(tmp_path / "runs"), "--tag", os.fsdecode(b"k=\xff\xfe"))
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode != 0
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert "not valid UTF-8 text" in line


def test_an_empty_folder_counts_no_episode_and_follow_gives_a_hint(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _cli("--db", str(tmp_path / "s.db"), "ingest", str(empty))
    assert r.returncode == 1
    assert "1/1 episodes" not in r.stderr and "no episodes here" in r.stderr, r.stderr
    f = _cli(
        "--db",
        str(tmp_path / "s.db"),
        "follow",
        str(empty),
        "--server",
        ref.url,
        "--tokenizer",
        str(tiny_model_dir),
        "--group-size",
        "2",
        "--once",
    )
    assert f.returncode == 0, f.stderr
    assert "nothing to follow yet under" in f.stderr and "result.json + pi_session.jsonl" in f.stderr


def test_follow_says_episodes_are_already_stored_from_another_place(tmp_path: Path, ref, tiny_model_dir: Path) -> None:
    """A copied tree: before, `4 seen · 0 ingested` and nothing else."""
    first = tmp_path / "a" / "step_0000"
    for i in range(4):
        _good(first / f"episode_{i:03d}", 10 + i)
    db = str(tmp_path / "s.db")
    assert _cli("--db", db, "ingest", str(first)).returncode == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    argv = ["--db", db, "follow", str(tmp_path / "b"), "--server", ref.url, "--tokenizer", str(tiny_model_dir)]
    f = _cli(*argv, "--max-context", "2048", "--group-size", "4", "--once")
    assert f.returncode == 0, f.stderr
    assert "4 seen" in f.stderr and "0 ingested · 4 already stored from another place" in f.stderr
