"""Durable writes: a locked or full database never drops results silently or leaves a
half-written store, and every command reports it in one line.

The write lock is really held by another SQLite connection (``BEGIN IMMEDIATE``); the
scorer's busy timeout is made short through ``HCAPO_STORE_BUSY_TIMEOUT``. Tests wait for
states (a request reached the server, a warning was printed), never for time.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _waiting import wait_until
from click.testing import CliRunner
from faultserver import FaultServer
from sqlalchemy import event, text

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import DatabaseFull, DatabaseLocked, StoreError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring import work_queue
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.scoring.scorer import register
from hcapo_store.storage.db import ENV_BUSY_TIMEOUT
from hcapo_store.storage.store import Store, count

MAX_CONTEXT = 2048
HCAPO = shutil.which("hcapo-store") or str(Path(sys.executable).with_name("hcapo-store"))
SHORT_BUSY = {ENV_BUSY_TIMEOUT: "0.2"}
WAIT = 120.0  # upper bound for a process to end on a loaded machine


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[FaultServer]:
    ref = make_server(tiny_model_dir)  # not started: the proxy calls ref.generate in-process
    with FaultServer(ref) as proxy:
        yield proxy
    ref.httpd.server_close()


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 2, seed=5, steps_per_subtask=1, output_words=20)
    return root


@pytest.fixture
def ingested(tmp_path: Path, episodes_dir: Path) -> Path:
    path = tmp_path / "store.db"
    with Store.open(str(path)) as store:
        ingest(store, [episodes_dir])
    return path


class WriteLock:
    """Another connection holding SQLite's write lock (``BEGIN IMMEDIATE``) until released."""

    def __init__(self, path: Path) -> None:
        self.conn: sqlite3.Connection | None = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.conn is not None:
            self.conn.execute("ROLLBACK")
            self.conn.close()
            self.conn = None


def _score_cmd(db: Path, server: FaultServer, tiny_model_dir: Path, *extra: str) -> list[str]:
    return [
        HCAPO,
        "--db",
        str(db),
        "score",
        "--server",
        server.url,
        "--tokenizer",
        str(tiny_model_dir),
        "--max-context",
        str(MAX_CONTEXT),
        "--concurrency",
        "1",
        "--json",
        *extra,
    ]


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), env={**os.environ, "NO_COLOR": "1", **(env or {})}
    )


def _one_line_error(log: Path) -> str:
    err = log.read_text()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, err
    return lines[0]


def _statuses(path: Path) -> dict[str, int]:
    with sqlite3.connect(str(path)) as conn:
        return dict(conn.execute("SELECT status, COUNT(*) FROM attempts GROUP BY status").fetchall())


def _scores(path: Path) -> int:
    with sqlite3.connect(str(path)) as conn:
        return conn.execute("SELECT COUNT(*) FROM scores").fetchone()[0]


def _steps(path: Path) -> int:
    with sqlite3.connect(str(path)) as conn:
        return conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]


def _score_locked_mid_run(db: Path, server: FaultServer, tiny_model_dir: Path, log: Path, release_when=None) -> int:
    """Run `score` in a process; take the write lock once its first request is at the server
    (its claim is committed); release it when ``release_when()`` holds, else after the
    process ended. Returns the exit status."""
    server.reset()
    server.hold_answers = threading.Event()
    proc = _spawn(_score_cmd(db, server, tiny_model_dir), log, SHORT_BUSY)
    lock = None
    try:
        wait_until(lambda: server.requests >= 1, "the first request (the claim is committed)", timeout=120.0)
        lock = WriteLock(db)
        server.hold_answers.set()
        if release_when is not None:
            wait_until(release_when, "the state that releases the lock", timeout=120.0)
            lock.release()
        return proc.wait(timeout=WAIT)
    finally:
        server.hold_answers.set()
        server.hold_answers = None
        if lock is not None:
            lock.release()
        if proc.poll() is None:
            proc.kill()


def test_flush_retried_until_the_lock_is_released(ingested, server, tiny_model_dir, tmp_path):
    """A writer blocked by another process's lock keeps its batch, retries, and stores everything."""
    log = tmp_path / "score.err"
    rc = _score_locked_mid_run(
        ingested, server, tiny_model_dir, log, release_when=lambda: "failed (1 time(s) in a row" in log.read_text()
    )
    assert rc == 0, log.read_text()
    steps = _steps(ingested)
    assert _scores(ingested) == steps
    assert _statuses(ingested) == {"done": steps}


@pytest.mark.slow
def test_flush_gives_up_with_one_line_and_nonzero_exit(ingested, server, tiny_model_dir, tmp_path):
    """The lock is held until the process ends: it stops with one line and exit 1; the results
    it could not store are not counted anywhere, and the next run scores them."""
    log = tmp_path / "score.err"
    rc = _score_locked_mid_run(ingested, server, tiny_model_dir, log)
    assert rc == 1
    line = _one_line_error(log)
    assert "scoring stopped" in line and "could not be stored" in line and "is locked" in line, line
    assert "leases could not be released" in line, line  # the database stayed locked to the end
    assert _scores(ingested) == 0
    assert "done" not in _statuses(ingested)
    # The dead worker's leases are released by the next run on this host, which scores everything
    # (run in process: another pid on this host, as a new process would be).
    rerun = CliRunner().invoke(cli, _score_cmd(ingested, server, tiny_model_dir)[1:])
    assert rerun.exit_code == 0, rerun.output
    assert _statuses(ingested) == {"done": _steps(ingested)}


def _limit_pages(store: Store, extra: int = 0) -> None:
    """Cap the database at its current size (+ ``extra`` pages): SQLite's own SQLITE_FULL."""
    with store.engine.connect() as conn:
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar_one() + extra

    @event.listens_for(store.engine, "connect")
    def _cap(dbapi_conn, _record) -> None:
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages}")

    store.engine.dispose()  # pooled connections reconnect with the cap


def test_full_database_stops_scoring_and_releases_leases(ingested, server, tiny_model_dir):
    store = Store.open(str(ingested))
    try:
        prep = prepare(
            store,
            ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT),
        )
        conv = prep.spec["conversion"]
        register(store, prep.spec)  # run_scoring registers; enqueueing by hand needs the scorer row first
        work_queue.enqueue(
            store,
            prep.scorer_id,
            include_thinking=conv["include_thinking"],
            max_tool_result_chars=conv["max_tool_result_chars"],
        )
        _limit_pages(store)
        server.reset()
        with pytest.raises(DatabaseFull) as info:
            run_scoring(store, prep, RunOptions(concurrency=1))
        message = str(info.value)
        assert "could not be stored" in message and "is full" in message and "returned to the queue" in message
        # What was written before the database filled up is kept and counted; nothing else.
        stored = count(store, "SELECT COUNT(*) FROM scores")
        assert f"; {stored} result(s) stored" in message
        expected = {"done": stored, "pending": _steps(ingested) - stored}
        # GROUP BY lists only statuses that occur: the page limit can hit before the first result.
        assert _statuses(ingested) == {status: n for status, n in expected.items() if n}
        with store.engine.connect() as conn:
            state = conn.execute(text("SELECT state FROM workers")).scalar_one()
        assert state == "failed"
    finally:
        store.close()


def _snapshot(path: Path) -> dict[str, int]:
    with sqlite3.connect(str(path)) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: conn.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}


def test_ingest_into_a_full_database_rolls_back(tmp_path, episodes_dir):
    path = tmp_path / "full.db"
    store = Store.open(str(path))
    try:
        _limit_pages(store)
        before = _snapshot(path)
        with pytest.raises(DatabaseFull, match="is full"):
            ingest(store, [episodes_dir])
        assert _snapshot(path) == before
    finally:
        store.close()


def test_credits_compute_into_a_full_database_rolls_back(tmp_path, episodes_dir, server, tiny_model_dir):
    # Small pages, so that the credit rows need new ones (a few rows fit in a table's root page).
    ingested = tmp_path / "credits.db"
    with sqlite3.connect(str(ingested)) as conn:
        conn.execute("PRAGMA page_size = 512")
        conn.execute("VACUUM")
    store = Store.open(str(ingested))
    try:
        ingest(store, [episodes_dir])
        prep = prepare(
            store,
            ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT),
        )
        server.reset()
        run_scoring(store, prep, RunOptions(concurrency=1))
        _limit_pages(store)
        before = _snapshot(ingested)
        with pytest.raises(DatabaseFull):
            compute_credits(store)
        assert _snapshot(ingested) == before
    finally:
        store.close()


@pytest.mark.parametrize("command", ["ingest", "score", "credits"])
def test_locked_database_is_one_line_and_unchanged(command, ingested, episodes_dir, server, tiny_model_dir, tmp_path):
    if command == "credits":
        store = Store.open(str(ingested))
        prep = prepare(
            store,
            ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT),
        )
        run_scoring(store, prep, RunOptions(concurrency=1))
        store.close()
        cmd = [HCAPO, "--db", str(ingested), "credits", "compute"]
    elif command == "ingest":
        extra = tmp_path / "more"
        write_standard_episodes(extra, 1, seed=11, steps_per_subtask=1, output_words=10)
        cmd = [HCAPO, "--db", str(ingested), "ingest", str(extra)]
    else:
        cmd = _score_cmd(ingested, server, tiny_model_dir)
    before = _snapshot(ingested)
    lock = WriteLock(ingested)
    try:
        # In process (the console script is this same `cli`): an exception that escaped the
        # command (a traceback, in a process) fails the test here.
        result = CliRunner().invoke(cli, cmd[1:], env={"NO_COLOR": "1", **SHORT_BUSY}, catch_exceptions=False)
    finally:
        lock.release()
    assert result.exit_code == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "is locked" in errors[0], result.stderr
    assert _snapshot(ingested) == before


def test_locked_error_maps_at_the_boundary(ingested):
    """Library callers get DatabaseLocked (a StoreError), not a SQLAlchemy exception."""
    os.environ[ENV_BUSY_TIMEOUT] = "0.1"
    try:
        store = Store.open(str(ingested))
    finally:
        del os.environ[ENV_BUSY_TIMEOUT]
    lock = WriteLock(ingested)
    try:
        with pytest.raises(DatabaseLocked) as info:
            work_queue.requeue_failed(store, "x" * 64, work_queue.Filters())
        assert isinstance(info.value, StoreError)
    finally:
        lock.release()
        store.close()


@pytest.fixture
def small_disk(mount_tmpfs) -> Path:
    """A 2 MB tmpfs: a real full disk."""
    return mount_tmpfs("2m")


def test_ingest_on_a_full_disk_is_one_line_and_unchanged(small_disk, tmp_path):
    path = small_disk / "store.db"
    Store.open(str(path)).close()
    episodes = tmp_path / "big"
    write_standard_episodes(episodes, 8, seed=2, steps_per_subtask=2, output_words=400)
    before = _snapshot(path)
    filler = small_disk / "filler"
    stat = os.statvfs(small_disk)
    filler.write_bytes(b"\0" * max(stat.f_bavail * stat.f_frsize - 48 * 1024, 0))  # leave 48 KiB
    result = subprocess.run(
        [HCAPO, "--db", str(path), "ingest", str(episodes)],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "is full" in errors[0], result.stderr
    filler.unlink()
    assert _snapshot(path) == before
    with sqlite3.connect(str(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
