"""The verl 0.9.1 environment tests run verl in (verl pins transformers<5.11, this one is newer).

Built once per machine under the temp dir, keyed by verl's requirements, this package's
dependencies and the Python version (not by the code: the checkout is put on ``PYTHONPATH``),
under a file lock so two test workers build it once. ``HCAPO_VERL_VENV`` names a ready venv.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PIP_TIMEOUT_S = 1800  # a hang guard: the first build downloads torch, verl and ray


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["optional-dependencies"]["verl"], *project["dependencies"]]


def _pip(venv: Path, *args: str) -> None:
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    if r.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def verl_python() -> Path:
    """The python of a venv with torch 2.13.0, verl 0.9.1 and this package's dependencies."""
    ready = os.environ.get("HCAPO_VERL_VENV")
    if ready:
        return Path(ready) / "bin" / "python"
    reqs = _requirements()
    key = hashlib.sha256((" ".join(reqs) + sys.version).encode()).hexdigest()[:16]
    venv = Path(tempfile.gettempdir()) / f"hcapo-store-verl-venv-{key}"
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker building it: wait for it
        if not (venv / "ok").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            _pip(venv, "torch==2.13.0")  # the CPU build here, as in .ci/run
            _pip(venv, *reqs)
            (venv / "ok").write_text(" ".join(reqs))
    return venv / "bin" / "python"


def run_env() -> dict[str, str]:
    """The environment for a process in that venv: this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
