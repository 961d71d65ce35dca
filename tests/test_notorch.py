"""`pip install .` without extras, as an SGLang/vLLM user installs it: a fresh venv (no torch,
no pyarrow) built from the checkout's tracked files, scoring against a reference server
that runs here (this environment has torch).

The venv's dependencies are cached under the temp dir, keyed by pyproject.toml; the
package itself is reinstalled from the current files on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hcapo_store.devkit.refserver import ReferenceServer, make_server

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.notorch]
PIP_TIMEOUT_S = 1800  # a hang guard: the first build downloads the dependencies


def _copy_tracked_files(dest: Path) -> Path:
    """The files a clean clone has (with their current contents): nothing untracked or built."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist): everything but build output
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__"))
        return dest
    for name in filter(None, listed.stdout.split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _pip(venv: Path, *args: str) -> None:
    """``pip install ARGS`` into ``venv``: this interpreter's pip, pointed at the venv's python
    (``--python``), so the venv is made without a pip of its own (no ensurepip)."""
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    assert r.returncode == 0, f"pip install {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = _copy_tracked_files(tmp_path_factory.mktemp("clean-clone"))
    # One venv per checkout: the package is reinstalled into it for each run, so two
    # checkouts testing at once on one machine must not share it.
    key = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + sys.version.encode() + str(ROOT.resolve()).encode()
    ).hexdigest()[:16]
    cached = Path(tempfile.gettempdir()) / f"hcapo-store-notorch-venv-{key}"
    if not (cached / "bin" / "hcapo-store").exists():
        building = Path(tempfile.mkdtemp(prefix="hcapo-store-notorch-build-"))
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(building)], check=True)
        # the package with all its declared dependencies; --no-compile: their modules are compiled
        # when first imported (transformers' thousands of files, most never imported here)
        _pip(building, "--no-compile", str(src))
        shutil.rmtree(cached, ignore_errors=True)
        building.rename(cached)  # venvs are not relocatable: rebuild the console script below
    _pip(cached, "--no-deps", "--force-reinstall", str(src))
    assert subprocess.run([str(cached / "bin" / "python"), "-c", "import torch"], capture_output=True).returncode != 0
    return cached


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as s:
        yield s


def _run(venv: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / "hcapo-store"), "--db", str(tmp_path / "x.db"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "NO_COLOR": "1"},
        timeout=600,
    )


def test_plain_install_scores_against_a_server(venv, server, tiny_model_dir, tmp_path):
    r = _run(venv, tmp_path, "ingest", str(ROOT / "examples" / "trajectories"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run(
        venv,
        tmp_path,
        "score",
        "--server",
        server.url,
        "--tokenizer",
        str(tiny_model_dir),
        "--max-context",
        "2048",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout[r.stdout.index("{") :])
    assert report["scored"] > 0 and report["failed"] == 0
    steps = json.loads(_run(venv, tmp_path, "status", "--json").stdout)["steps"]
    assert report["scored"] == steps
    assert _run(venv, tmp_path, "credits", "compute").returncode == 0
    r = _run(venv, tmp_path, "export", "dataset", str(tmp_path / "d.jsonl"))
    assert r.returncode == 0 and (tmp_path / "d.jsonl").stat().st_size > 0, r.stdout + r.stderr
    # pyarrow is really absent here: one line naming the extra.
    r = _run(venv, tmp_path, "export", "dataset", str(tmp_path / "d.parquet"), "--format", "parquet")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "Error: export --format parquet needs pyarrow, which is not installed: pip install 'hcapo-store[parquet]'"
    ]


def test_plain_install_names_the_local_extra(venv, tmp_path):
    """torch is really absent here: one line naming the extra, no traceback."""
    (tmp_path / "model").mkdir()
    r = _run(venv, tmp_path, "serve-reference", "--model", str(tmp_path / "model"))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "Error: a local model (score --model, serve-reference, demo) needs torch, which is not installed: "
        "pip install 'hcapo-store[local]'"
    ]


WALK_HELP = r"""
import importlib.util, json, sys
import click
import hcapo_store as hs
from hcapo_store.cli import cli

names = [n for n in hs.__all__ if getattr(hs, n) is None]
paths = []
def walk(cmd, path):
    paths.append(path)
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            walk(sub, path + [name])
walk(cli, [])

# each command's --help as `python -m hcapo_store PATH --help` runs it: a forked child per path (this
# process has imported only what `python -m hcapo_store` imports first), its own stdout and exit code
import os, runpy, tempfile
helps = []
for path in paths:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            sys.argv = ["hcapo_store", *path, "--help"]
            code = 0
            try:
                runpy.run_module("hcapo_store", run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                import traceback; traceback.print_exc(); code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0); err.seek(0)
        helps.append([path, os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()])
print(json.dumps({"none": names, "paths": paths, "top_level_cli": importlib.util.find_spec("cli") is not None,
                  "package": hs.__file__, "helps": helps}))
"""


def test_the_installed_wheel_imports_every_public_name_and_every_help(venv, tmp_path):
    """What a user installs (a non-editable install, run from outside the checkout): every name in
    ``__all__`` resolves, every command's --help runs, and no generic top-level ``cli`` module exists."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python = str(venv / "bin" / "python")
    r = subprocess.run([python, "-c", WALK_HELP], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["none"] == [] and not found["top_level_cli"]
    assert str(ROOT) not in found["package"] and "site-packages" in found["package"]
    assert len(found["paths"]) > 15
    assert [h[0] for h in found["helps"]] == found["paths"]
    for path, returncode, stdout, stderr in found["helps"]:  # `python -m hcapo_store PATH --help`, forked
        assert returncode == 0 and "Usage:" in stdout, (path, stderr)
