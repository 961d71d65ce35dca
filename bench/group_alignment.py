"""The hand-off's alignments of GRPO groups' rows, on the CPU (what ``Handoff`` computes for a row it
places by search: its ``turns`` and ``whole`` alignments).

    python bench/group_alignment.py                        # 3 groups of 8 rows, the 99-step prompt
    python bench/group_alignment.py --before /tmp/old      # alternating with another checkout: ratios
    python bench/group_alignment.py --json OUT

Each group's prompt is bench/hindsight_pass.py's (the synthetic episode up to its last assistant turn:
197 messages, 99 steps, ~9.1k Qwen3 tokens), its first message marked with the group's number so no
two groups share a history; each row is the prompt and a short completion of its own. One
tokenizer object for the run, as a trainer keeps one. Per row, the CPU seconds
(``time.process_time``) of ``EpisodeRenderer(tok).align`` for both renderings: the group's first
row (a history not seen before) and its other rows (the group's shared history) are reported
apart. ``--before DIR``: each round runs this script on this tree and then on DIR's
``hcapo_store`` (a checkout of another commit), in fresh processes, ``--rounds`` times; medians
per side and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED_TOKENIZER = HERE.parent.parent / "shared" / "tokenizers" / "qwen3"


def measure(tokenizer: str, groups: int, rows: int, steps_per_subtask: int) -> dict[str, Any]:
    """One process's timings on whatever ``hcapo_store`` it imports."""
    import hcapo_store  # the one on PYTHONPATH, before _gpu_common puts this tree first on the path
    from hcapo_store.rendering.alignment import EpisodeRenderer

    sys.path.insert(0, str(HERE))
    import _gpu_common as common
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    prompt, steps = common.episode_prompt(Path(tempfile.mkdtemp(prefix="hcapo-ga-")), steps_per_subtask, False)
    first: list[float] = []
    others: list[float] = []
    for g in range(groups):
        head = [{**prompt[0], "content": f"{prompt[0].get('content') or ''} (group {g})"}, *prompt[1:]]
        for r in range(rows):
            msgs = [*head, {"role": "assistant", "content": str(1000 + 37 * r + 101 * g)[-3:]}]
            at = [(k, m) for k, m in enumerate(i for i, x in enumerate(msgs) if x["role"] == "assistant")]
            t = time.process_time()
            renderer = EpisodeRenderer(tok)
            turns, whole = renderer.align(msgs, at, "turns"), renderer.align(msgs, at, "whole")
            (first if r == 0 else others).append(time.process_time() - t)
            assert len(turns.spans) == len(whole.spans) == len(at), (len(turns.spans), len(whole.spans))
    return {
        "hcapo_store": str(Path(hcapo_store.__file__).parent),
        "episode_steps": steps,
        "first_row_ms": [round(s * 1000, 2) for s in first],
        "other_rows_ms": [round(s * 1000, 2) for s in others],
    }


def _run(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--tokenizer", args.tokenizer]
    cmd += ["--groups", str(args.groups), "--rows", str(args.rows), "--steps-per-subtask", str(args.steps_per_subtask)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(SHARED_TOKENIZER), help="a Qwen3 tokenizer directory")
    p.add_argument("--groups", type=int, default=3, help="groups, each a prompt of its own: 3")
    p.add_argument("--rows", type=int, default=8, help="rows per group: 8")
    p.add_argument("--steps-per-subtask", type=int, default=22, help="the synthetic episode's size: 22 (99 steps)")
    p.add_argument("--before", help="another checkout's root: alternate with it, print ratios")
    p.add_argument("--rounds", type=int, default=3, help="with --before: rounds, each side once per round: 3")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: print one side's JSON
    args = p.parse_args(argv)
    if not Path(args.tokenizer).is_dir():
        raise SystemExit(f"no tokenizer at {args.tokenizer}: pass --tokenizer DIR (a Qwen3 tokenizer)")
    if args.one:
        print(json.dumps(measure(args.tokenizer, args.groups, args.rows, args.steps_per_subtask)))
        return {}
    trees = {"after": HERE.parent} | ({"before": Path(args.before).resolve()} if args.before else {})
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in trees}
    for _ in range(args.rounds if args.before else 1):
        for side, tree in trees.items():
            runs[side].append(_run(tree, args))
    doc: dict[str, Any] = {
        "command": "python bench/group_alignment.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "groups": args.groups,
        "rows": args.rows,
        "sides": {},
    }
    for side, got in runs.items():
        first = [v for run in got for v in run["first_row_ms"]]
        others = [v for run in got for v in run["other_rows_ms"]]
        doc["sides"][side] = {
            "hcapo_store": got[0]["hcapo_store"],
            "episode_steps": got[0]["episode_steps"],
            "first_row_ms_median": round(statistics.median(first), 2),
            "other_rows_ms_median": round(statistics.median(others), 2),
            "runs": got,
        }
        print(
            f"{side:6s} first row {doc['sides'][side]['first_row_ms_median']:8.1f} ms   "
            f"other rows {doc['sides'][side]['other_rows_ms_median']:7.1f} ms   ({got[0]['hcapo_store']})"
        )
    if args.before:
        a, b = doc["sides"]["after"], doc["sides"]["before"]
        doc["after_over_before"] = {
            "first_row": round(a["first_row_ms_median"] / b["first_row_ms_median"], 3),
            "other_rows": round(a["other_rows_ms_median"] / b["other_rows_ms_median"], 3),
        }
        print(
            f"after / before: first row ×{doc['after_over_before']['first_row']}, other rows ×{doc['after_over_before']['other_rows']}"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return doc


if __name__ == "__main__":
    main()
