"""Security floors of the dependencies (issue 34 item 7): declared in pyproject and met here."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
FLOORS = {"jinja2": (3, 1, 6)}  # 3.1.6: |attr can no longer reach str.format and escape the sandbox


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_security_floors_are_declared_and_installed():
    deps = PYPROJECT.read_text().split("dependencies = [", 1)[1].split("]", 1)[0]
    for name, floor in FLOORS.items():
        declared = re.search(rf'"{name}>=([0-9.]+)"', deps)
        assert declared is not None, f"{name} has no >= floor in pyproject's dependencies"
        assert _release(declared.group(1)) >= floor, (name, declared.group(1))
        assert _release(version(name)) >= floor, (name, version(name))
