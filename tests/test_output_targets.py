"""Outputs go only to regular files or new paths (issue 21): never onto a SQLite side file of
any database, a device, a FIFO or a socket; a full disk or an impossible name is one line and
leaves nothing behind; temp files of a killed export are cleaned by the next one."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_credits import add_scorer, add_scores
from test_identity import jsonl_episode, write_jsonl
from test_outputs_safety import credited  # noqa: F401 - the fixture

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.ingestion.pipeline import ingest


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(r) -> str:
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [line for line in r.output.splitlines() if line.strip() and not line.startswith("export: ")]  # progress
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


@pytest.fixture
def live_wal(tmp_path: Path) -> Iterator[Path]:
    """Another database in WAL mode with a committed transaction still in its -wal (its writer holds it open)."""
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES ('committed')")
    assert (tmp_path / "other.db-wal").stat().st_size > 0
    yield other
    conn.close()


@pytest.mark.usefixtures("credited")
@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_outputs_never_go_onto_another_databases_side_files(db_path, live_wal, suffix):
    target = live_wal.with_name(live_wal.name + suffix)
    before = _digest(target) if target.exists() else None
    for args in (
        ["datasette-metadata", str(target)],
        ["export", "dataset", str(target)],
        ["report", str(target)],
        ["export", "scores", str(target)],
    ):
        line = _one_line(CliRunner().invoke(cli, ["--db", str(db_path), *args]))
        assert "refusing" in line and ("side file" in line or "being read" in line), line
        assert (_digest(target) if target.exists() else None) == before
    check = sqlite3.connect(live_wal)  # the committed row is still there
    assert check.execute("SELECT x FROM t").fetchall() == [("committed",)]
    check.close()


@pytest.mark.usefixtures("credited")
def test_datasette_metadata_never_goes_onto_the_stores_own_wal(db_path):
    target = Path(str(db_path) + "-wal")
    line = _one_line(CliRunner().invoke(cli, ["--db", str(db_path), "datasette-metadata", str(target)]))
    assert "refusing" in line


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def _device(path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a copy of /dev/null
    return path


@pytest.mark.usefixtures("credited")
@pytest.mark.parametrize("make", [_fifo, _socket, _device], ids=["fifo", "socket", "device"])
def test_outputs_never_replace_a_fifo_socket_or_device(db_path, tmp_path, make):
    target = make(tmp_path / "target")
    kind = stat.S_IFMT(os.lstat(target).st_mode)
    for args in (["export", "dataset", str(target)], ["datasette-metadata", str(target)], ["report", str(target)]):
        line = _one_line(CliRunner().invoke(cli, ["--db", str(db_path), *args]))
        assert "not a regular file" in line, line
        assert stat.S_IFMT(os.lstat(target).st_mode) == kind  # still what it was
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)  # through a link too
    assert "not a regular file" in _one_line(
        CliRunner().invoke(cli, ["--db", str(db_path), "export", "dataset", str(link)])
    )
    assert stat.S_IFMT(os.lstat(target).st_mode) == kind


@pytest.fixture
def full_disk(mount_tmpfs) -> Path:
    """64 KiB of room: less than an export needs."""
    return mount_tmpfs("64k")


@pytest.mark.usefixtures("credited")
def test_a_full_disk_while_exporting_is_one_line_and_leaves_nothing(db_path, full_disk):
    (full_disk / "old.jsonl").write_bytes(b"the previous export\n")
    room = os.statvfs(full_disk)
    (full_disk / "filler").write_bytes(b"x" * max(room.f_bavail * room.f_frsize - 1024, 0))  # ~1 KiB left
    for target in ("new.jsonl", "old.jsonl"):
        r = CliRunner().invoke(
            cli, ["--db", str(db_path), "export", "dataset", str(full_disk / target), "--format", "jsonl"]
        )
        line = _one_line(r)
        assert "No space left on device" in line and "free some space" in line, line
    assert (full_disk / "old.jsonl").read_bytes() == b"the previous export\n"  # never half-replaced
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "old.jsonl"]  # no temp file left


@pytest.mark.usefixtures("credited")
def test_temp_files_of_a_killed_export_are_cleaned_by_the_next(db_path, tmp_path):
    out = tmp_path / "data.jsonl"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".data.jsonl.{dead.pid}.abc123.tmp"  # as a kill -9 mid-write leaves it
    stale.write_bytes(b"half")
    alive = tmp_path / f".data.jsonl.{os.getpid()}.xyz789.tmp"  # a writer still running: kept
    alive.write_bytes(b"busy")
    assert CliRunner().invoke(cli, ["--db", str(db_path), "export", "dataset", str(out)]).exit_code == 0
    assert not stale.exists() and alive.exists() and out.exists()


def test_long_and_clashing_episode_names_each_get_their_own_file(store, db_path, tmp_path):
    long_id = "é" * 300  # 600 bytes: longer than any file name may be
    ids = ["x", "x/hindsight_scores.json", long_id, long_id + "2"]
    source = write_jsonl(tmp_path / "eps.jsonl", [jsonl_episode(0.5, str(n), episode_id=i) for n, i in enumerate(ids)])
    report = ingest(store, [source])
    assert report.new == 4, report
    add_scorer(store, "sc", spec={"max_logprob_tokens": 2048})
    add_scores(store, "sc", seed=1)
    compute_credits(store, CreditParams(), name="r")
    out = tmp_path / "json"
    r = CliRunner().invoke(cli, ["--db", str(db_path), "export", "hindsight-json", str(out)])
    assert r.exit_code == 0, r.output
    files = sorted(out.rglob("hindsight_scores.json"))
    assert len(files) == 4 and all(f.is_file() for f in files), files
    assert all(len(p.name.encode()) <= 255 for f in files for p in f.relative_to(out).parents if p.name)
    docs = {json.loads(f.read_text())["episode_id"] for f in files}
    assert docs == set(ids), docs
