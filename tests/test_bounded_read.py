"""A bound costs what is read (issue 41): under a container's 2 GB address-space limit,
``ingest`` and ``follow`` read Pi sessions whose bound is 2 GiB. ``read(limit + 1)`` allocated
the bound before reading a byte (a ``MemoryError``, nothing stored)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.files import read_regular
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent
LIMIT_AS = 2 * 1000**3  # "2 GB", a container's limit


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hcapo_store", *args],
        env=env,
        preexec_fn=_limited,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def test_read_regular_reads_in_pieces_up_to_the_bound(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"a" * 2_500_001)  # more than two pieces
    assert read_regular(f, 2 << 30) == b"a" * 2_500_001
    assert read_regular(f, 2_500_001) == b"a" * 2_500_001
    with pytest.raises(Exception, match="more than"):
        read_regular(f, 2_500_000)
    assert read_regular(tmp_path / "absent", 10) is None


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")
def test_ingest_under_a_2_gb_address_space(tmp_path: Path) -> None:
    root = tmp_path / "rollouts" / "step_0000"
    write_standard_episodes(root, 3, seed=3, steps_per_subtask=1, output_words=5)
    db = tmp_path / "i.db"
    r = _run("--db", str(db), "ingest", str(root))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MemoryError" not in r.stderr
    with Store.open(str(db), create=False) as store:
        assert store.query("SELECT COUNT(*) FROM episodes", read_only=True)[1] == [(3,)]


@pytest.mark.slow  # a follow process that scores (its ingest is the test above)
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")
def test_follow_under_a_2_gb_address_space(tmp_path: Path, ref: ReferenceServer, tiny_model_dir) -> None:
    write_standard_episodes(tmp_path / "rollouts" / "step_0000", 3, seed=3, steps_per_subtask=1, output_words=5)
    db2 = tmp_path / "f.db"
    r = _run(
        "--db", str(db2), "follow", str(tmp_path / "rollouts"), "--group-size", "3", "--once",
        "--server", ref.url, "--tokenizer", str(tiny_model_dir), "--max-context", "2048",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    with Store.open(str(db2), create=False) as store:
        assert store.query("SELECT COUNT(*) FROM batches WHERE status = 'ready'", read_only=True)[1] == [(1,)]
