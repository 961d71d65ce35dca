"""Inputs that are not regular files are per-input failures, counted and named, never skipped in
silence nor read without a bound (issue 21): dangling links, link loops, a FIFO, /dev/zero."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from builders import EpisodeBuilder
from click.testing import CliRunner

from hcapo_store.cli import cli


def _good(root: Path, name: str) -> None:
    EpisodeBuilder(seed=hash(name) % 1000, episode_id=abs(hash(name)) % 10**6).standard().write(root / name)


def test_broken_links_fifos_and_devices_fail_alone_and_are_named(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    _good(root, "episode_ok")
    (root / "episode_dangling").symlink_to(tmp_path / "nowhere")
    (root / "loop.jsonl").symlink_to(root / "loop.jsonl")
    fifo_dir = root / "episode_fifo"
    _good(root, "episode_fifo")
    (fifo_dir / "result.json").unlink()
    os.mkfifo(fifo_dir / "result.json")  # opening it would block the batch forever
    zero_dir = root / "episode_zero"
    _good(root, "episode_zero")
    (zero_dir / "pi_session.jsonl").unlink()
    (zero_dir / "pi_session.jsonl").symlink_to("/dev/zero")  # reading it would never end
    os.mkfifo(root / "pipe.jsonl")

    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "x.db"), "ingest", str(root)])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    failed = [line for line in r.stderr.splitlines() if line.startswith("failed: ")]
    expect = {
        "episode_dangling": "a dangling symbolic link",
        "loop.jsonl": "a symbolic link loop",
        "episode_fifo/result.json": "a FIFO, not a regular file",
        "episode_zero/pi_session.jsonl": "a device, not a regular file",
        "pipe.jsonl": "a FIFO, not a regular file",
    }
    for where, why in expect.items():
        assert sum(where in line and why in line for line in failed) == 1, (where, failed)
    assert len(failed) == len(expect)
    assert "1 new" in r.stdout and f"{len(expect)} failed" in r.stdout


def test_a_given_path_that_is_a_broken_link_says_so(tmp_path):
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "x.db"), "ingest", str(tmp_path / "gone")])
    assert r.exit_code == 1 and "a dangling symbolic link" in r.output, r.output


def test_a_result_json_over_its_bound_is_refused_without_reading_it(tmp_path, monkeypatch):
    from hcapo_store.ingestion import discovery

    monkeypatch.setattr(discovery, "MAX_RESULT_BYTES", 1 << 20)  # a real file over a smaller bound
    _good(tmp_path / "runs", "episode_big")
    big = tmp_path / "runs" / "episode_big" / "result.json"
    big.write_bytes(b'{"episode_reward": 1.0, "pad": "' + b"x" * (2 << 20) + b'"}')
    r = CliRunner().invoke(cli, ["--db", str(tmp_path / "x.db"), "ingest", str(tmp_path / "runs")])
    assert r.exit_code == 1, r.output
    assert "more than the 1 MiB this input may have" in r.output


pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
