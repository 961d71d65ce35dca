"""A bench script run on this tree and, with ``--before DIR``, on another checkout's ``hcapo_store``,
in fresh processes, the sides alternating round by round (bench/group_alignment.py,
bench/step_prompts.py). Each child is the script itself with ``--one``: it prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def child(script: Path, tree: Path, args: list[str]) -> dict[str, Any]:
    """``script --one ARGS`` importing ``tree``'s ``hcapo_store``; its last line, parsed."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(script), "--one", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternate(script: Path, args: list[str], before: str | None, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Each side's runs: ``after`` (this tree) and, with ``before``, that checkout, ``rounds`` times."""
    trees = {"after": REPO} | ({"before": Path(before).resolve()} if before else {})
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in trees}
    for _ in range(rounds if before else 1):
        for side, tree in trees.items():
            runs[side].append(child(script, tree, args))
    return runs


def header(script: Path, argv: list[str] | None) -> dict[str, Any]:
    """What a result file says of its run: the command, the machine, the date."""
    return {
        "command": f"python bench/{script.name} " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def finish(doc: dict[str, Any], ratios: dict[str, Any] | None, json_out: str | None) -> dict[str, Any]:
    """The after / before ratios (when paired) printed and kept; the document written to ``json_out``."""
    if ratios is not None:
        doc["after_over_before"] = ratios
        print(f"after / before: {ratios}")
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return doc


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
