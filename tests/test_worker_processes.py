"""The package's worker processes and the forkserver's preload list (hcapo_store/worker_processes.py).

Each case runs in a fresh interpreter: Python keeps one forkserver per process and reads its
preload list once, when that server starts. A worker of a bare pool reports which modules it
found loaded: those its forkserver imported (and the probe's own few)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# imported by the worker when it unpickles the task; it imports nothing else
PROBE = """
import sys
from concurrent.futures import ProcessPoolExecutor

from hcapo_store import worker_processes


def loaded(names):
    return {name: name in sys.modules for name in names}


def in_a_worker(names):
    # a bare pool: its worker imports nothing but this module to run the task
    with ProcessPoolExecutor(1, mp_context=worker_processes.context()) as pool:
        return pool.submit(loaded, names).result()
"""


def _in_fresh_interpreter(tmp_path: Path, body: str) -> dict[str, bool]:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "users_own_preload.py").write_text("VALUE = 1\n")
    script = tmp_path / "main.py"
    script.write_text(
        "import json\nimport probe\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )
    # on PYTHONPATH, not only sys.path: Python 3.11's forkserver ignores the parent's sys.path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_library_leaves_its_applications_preload_list_alone(tmp_path) -> None:
    # a trainer that preloads its own module, then ingests with workers and prepares in a pool
    found = _in_fresh_interpreter(
        tmp_path,
        """
        import multiprocessing
        multiprocessing.set_forkserver_preload(["users_own_preload"])
        from hcapo_store.ingestion import parallel
        from hcapo_store.scoring.preparing import BuilderRecipe, PreparePool

        pool = parallel._start(1)  # starts the forkserver
        pool.submit(int).result()
        pool.shutdown()
        first = probe.in_a_worker(["users_own_preload"])
        # a prepare pool starts too (its workers fail to open this store; what matters is that
        # starting it changed nothing of the list): a worker started after it still finds the module
        PreparePool("sqlite:////nonexistent/x.db", BuilderRecipe("nowhere", (), "fast"), 1).close()
        second = probe.in_a_worker(["users_own_preload"])
        print(json.dumps({"first": first["users_own_preload"], "second": second["users_own_preload"]}))
        """,
    )
    assert found == {"first": True, "second": True}


def test_without_a_list_a_worker_imports_only_what_it_needs(tmp_path) -> None:
    found = _in_fresh_interpreter(
        tmp_path,
        """
        print(json.dumps(probe.in_a_worker(["hcapo_store.ingestion.discovery", "transformers"])))
        """,
    )
    # the forkserver imported nothing of ours: the discovery module is not there before a task needs it
    assert found == {"hcapo_store.ingestion.discovery": False, "transformers": False}


@pytest.mark.slow  # the forkserver imports transformers and torch: several seconds on a loaded machine
def test_one_list_serves_both_kinds_when_ingest_starts_the_server(tmp_path) -> None:
    pytest.importorskip("transformers")
    # an application that ingests with workers (starting the forkserver) and then scores
    found = _in_fresh_interpreter(
        tmp_path,
        """
        from hcapo_store import worker_processes
        worker_processes.preload(worker_processes.INGEST, worker_processes.PREPARE)
        from hcapo_store.ingestion import parallel

        pool = parallel._start(1)  # ingest starts the forkserver
        pool.submit(int).result()
        pool.shutdown()
        names = ["hcapo_store.ingestion.discovery", "hcapo_store.scoring.preparing", "transformers"]
        print(json.dumps(probe.in_a_worker(names)))
        """,
    )
    assert found == {
        "hcapo_store.ingestion.discovery": True,
        "hcapo_store.scoring.preparing": True,
        "transformers": True,
    }


INGEST_ONLY = {"hcapo_store.ingestion.discovery": True, "hcapo_store.scoring.worker_imports": False}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["ingest", "{empty}"], INGEST_ONLY, id="ingest"),
        pytest.param(
            ["score", "--server", "http://127.0.0.1:9", "--tokenizer", "{empty}"],
            {"hcapo_store.ingestion.discovery": False, "hcapo_store.scoring.worker_imports": True},
            id="score",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["follow", "{empty}", "--group-size", "1", "--server", "http://127.0.0.1:9", "--tokenizer", "{empty}"],
            INGEST_ONLY,
            id="follow",
        ),
    ],
)
def test_each_command_names_its_workers_imports(tmp_path, argv: list[str], expected: dict[str, bool]) -> None:
    """A command sets the list for its whole process: a pool started after it (here, once the
    command has ended, whether or not it started workers itself) forks from a forkserver that
    imported what the command's workers need, and nothing else."""
    if "score" in argv or "follow" in argv:
        pytest.importorskip("transformers")
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [str(empty) if a == "{empty}" else a for a in argv]
    found = _in_fresh_interpreter(
        tmp_path,
        f"""
        from click.testing import CliRunner
        from hcapo_store.cli.main import cli
        CliRunner().invoke(cli, ["--db", {str(tmp_path / "s.db")!r}, *{args!r}])  # its outcome is not the point
        print(json.dumps(probe.in_a_worker({sorted(expected)!r})))
        """,
    )
    assert found == expected
