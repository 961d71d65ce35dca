"""Shared fixtures: real SQLite files made by the real migrations, CLI runners, sample data."""

from __future__ import annotations

import atexit
import compileall
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _forked_runs import Forks
from _shared import EXAMPLES, REPO, SAMPLES, SHARED, TOKENIZERS  # noqa: F401 - re-exported to tests
from click.testing import CliRunner
from tiers import read_list

from hcapo_store.storage.store import Store

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# This run's own tokenizer class records (rendering/tokenizer_memo.py), shared by its workers and
# the processes they start, none left in the user's cache; made by the first process (xdist's
# controller), whose environment the others inherit
if "HCAPO_CACHE_DIR" not in os.environ:
    os.environ["HCAPO_CACHE_DIR"] = tempfile.mkdtemp(prefix="hcapo-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HCAPO_CACHE_DIR"], ignore_errors=True)
# Where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE, as this project's
# image sets), every process the suite starts compiled the package's ~160 modules, the
# migrations and the bench modules again (~0.3 CPU-s a process, hundreds of processes).
# Compiled once here, by the first process, into the usual __pycache__ folders (ignored by
# git); Python reads them whatever that setting says, and checks each against its source.
if sys.dont_write_bytecode and "PYTEST_XDIST_WORKER" not in os.environ:
    for _tree in ("hcapo_store", "migrations", "bench"):
        compileall.compile_dir(str(REPO / _tree), quiet=2, workers=1)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture(scope="session")
def migrated_db_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A blank store made once by the real migrations (Store.open); tests copy the file
    instead of migrating again (0.2-0.5 s each)."""
    path = tmp_path_factory.mktemp("template") / "blank.db"
    Store.open(str(path)).close()
    return path


@pytest.fixture
def store(db_path: Path, migrated_db_template: Path):
    shutil.copyfile(migrated_db_template, db_path)
    s = Store.open(str(db_path))
    yield s
    s.close()


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def forks() -> Iterator[Forks]:
    """``python SCRIPT ARGS`` as forked children of one process that imported torch and
    transformers once (tests/_forked_runs.py), not a fresh interpreter per bench run."""
    runner = Forks()
    yield runner
    runner.close()


@pytest.fixture
def samples() -> Path:
    """The shared sample episodes when present, else the project's own examples."""
    return SAMPLES if SAMPLES.exists() else EXAMPLES


from conftest_models import chat_ids, demo_tokenizer_dir, tiny_model_dir  # noqa: E402,F401 - session fixtures


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount_tmpfs("64k")``: a real, small file system (tmpfs) for full-disk cases; needs
    root, so the test skips with the reason where mounting is not allowed."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs-{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


# --- side by side (pytest-xdist, --dist loadfile) ------------------------------------------
# xdist hands out test files largest-count first; a file of a few long tests handed out last
# then runs alone at the end. The files with the most tests marked slow go first instead, so
# the workers finish together.


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep the order set below


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the measured marks count there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    measured = read_list()  # tests/slow_measured.txt: the slow tier by measurement (tests/tiers.py)
    for item in items:
        if item.nodeid in measured:
            item.add_marker(pytest.mark.slow)

    def file(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow: dict[str, int] = {}
    for item in items:
        slow[file(item)] = slow.get(file(item), 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[file(item)])  # stable: the files' tests keep their order
