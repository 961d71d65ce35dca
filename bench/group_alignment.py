"""The hand-off's alignments of GRPO groups' rows, on the CPU (what ``Handoff`` computes for a row it
places by search: its ``turns`` and ``whole`` alignments).

    python bench/group_alignment.py                        # 3 groups of 8 rows, the 99-step prompt
    python bench/group_alignment.py --before /tmp/old      # alternating with another checkout: ratios
    python bench/group_alignment.py --json OUT
    python bench/group_alignment.py --groups 0 --episodes ../shared/samples/long/*   # real episodes, alone

Each group's prompt is bench/hindsight_pass.py's (the synthetic episode up to its last assistant turn:
197 messages, 99 steps, ~9.1k Qwen3 tokens), its first message marked with the group's number so no
two groups share a history; each row is the prompt and a short completion of its own. One
tokenizer object for the run, as a trainer keeps one. Per row, the CPU seconds
(``time.process_time``) of ``EpisodeRenderer(tok).align`` for both renderings: the group's first
row (a history not seen before) and its other rows (the group's shared history) are reported
apart. ``--episodes``: episode folders ingested into a scratch store, each aligned whole, alone
(every piece new: what a tokenized export or a multi-turn trainer's row costs). ``--before DIR``: each round runs this script on this tree and then on DIR's
``hcapo_store`` (a checkout of another commit), in fresh processes, ``--rounds`` times; medians
per side and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED_TOKENIZER = HERE.parent.parent / "shared" / "tokenizers" / "qwen3"
sys.path.insert(0, str(HERE))
import _paired as paired  # noqa: E402


def _episodes(paths: list[str]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each episode folder's messages, as the store keeps them (ingested into a scratch store)."""
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage import db
    from hcapo_store.storage.episodes import load_messages
    from hcapo_store.storage.store import Store

    out = []
    with Store.open(str(Path(tempfile.mkdtemp(prefix="hcapo-ga-")) / "s.db")) as store:
        if ingest(store, [Path(p) for p in paths], jobs=1).failed:
            raise SystemExit("an episode failed to ingest")
        with db.read(store.engine) as conn:
            for ep_id, name in conn.exec_driver_sql("SELECT id, name FROM episodes ORDER BY name").all():
                out.append((str(name), [dict(m) for m in load_messages(conn, int(ep_id))]))
    return out


def measure(tokenizer: str, groups: int, rows: int, steps_per_subtask: int, episodes: list[str]) -> dict[str, Any]:
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
    alone = []
    for name, msgs in _episodes(episodes) if episodes else []:
        at = [(k, m) for k, m in enumerate(i for i, x in enumerate(msgs) if x.get("role") == "assistant")]
        t = time.process_time()
        renderer = EpisodeRenderer(tok)
        turns, whole = renderer.align(msgs, at, "turns"), renderer.align(msgs, at, "whole")
        spent = time.process_time() - t
        placed = [len(turns.spans), len(whole.spans)]
        alone.append({"episode": name, "steps": len(at), "placed": placed, "ms": round(spent * 1000, 2)})
    return {
        "hcapo_store": str(Path(hcapo_store.__file__).parent),
        "episode_steps": steps,
        "first_row_ms": [round(s * 1000, 2) for s in first],
        "other_rows_ms": [round(s * 1000, 2) for s in others],
        "episodes": alone,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(SHARED_TOKENIZER), help="a Qwen3 tokenizer directory")
    p.add_argument("--groups", type=int, default=3, help="groups, each a prompt of its own: 3")
    p.add_argument("--rows", type=int, default=8, help="rows per group: 8")
    p.add_argument("--steps-per-subtask", type=int, default=22, help="the synthetic episode's size: 22 (99 steps)")
    p.add_argument(
        "--episodes", nargs="+", help="episode folders (e.g. ../shared/samples/long/*): each aligned whole, alone"
    )
    p.add_argument("--before", help="another checkout's root: alternate with it, print ratios")
    p.add_argument("--rounds", type=int, default=3, help="with --before: rounds, each side once per round: 3")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: print one side's JSON
    args = p.parse_args(argv)
    if not Path(args.tokenizer).is_dir():
        raise SystemExit(f"no tokenizer at {args.tokenizer}: pass --tokenizer DIR (a Qwen3 tokenizer)")
    if args.one:
        print(json.dumps(measure(args.tokenizer, args.groups, args.rows, args.steps_per_subtask, args.episodes)))
        return {}
    child = ["--tokenizer", args.tokenizer, "--groups", str(args.groups), "--rows", str(args.rows)]
    child += [
        "--steps-per-subtask",
        str(args.steps_per_subtask),
        *(["--episodes", *args.episodes] if args.episodes else []),
    ]
    runs = paired.alternate(Path(__file__).resolve(), child, args.before, args.rounds)
    doc: dict[str, Any] = {**paired.header(Path(__file__), argv), "groups": args.groups, "rows": args.rows, "sides": {}}
    for side, got in runs.items():
        row: dict[str, Any] = {"hcapo_store": got[0]["hcapo_store"], "episode_steps": got[0]["episode_steps"]}
        for kind in ("first_row", "other_rows"):
            values = [v for run in got for v in run[f"{kind}_ms"]]
            row[f"{kind}_ms_median"] = round(statistics.median(values), 2) if values else None
        row["episodes_ms_median"] = {
            ep["episode"]: round(statistics.median(run["episodes"][i]["ms"] for run in got), 2)
            for i, ep in enumerate(got[0]["episodes"])
        }
        row["runs"] = got
        doc["sides"][side] = row
        print(
            f"{side:6s} ({row['hcapo_store']}): rows {row['first_row_ms_median']} ms first, {row['other_rows_ms_median']} ms others"
        )
        for ep in got[0]["episodes"]:
            print(
                f"{side:6s} {ep['episode']}: {ep['steps']} steps, placed {ep['placed']}, {row['episodes_ms_median'][ep['episode']]} ms"
            )
    ratios: dict[str, Any] | None = None
    if args.before:
        a, b = doc["sides"]["after"], doc["sides"]["before"]
        ratios = {
            kind: round(a[f"{kind}_ms_median"] / b[f"{kind}_ms_median"], 3)
            for kind in ("first_row", "other_rows")
            if a[f"{kind}_ms_median"] and b[f"{kind}_ms_median"]
        }
        ratios["episodes"] = {
            name: round(ms / b["episodes_ms_median"][name], 3) for name, ms in a["episodes_ms_median"].items()
        }
    return paired.finish(doc, ratios, args.json_out)


if __name__ == "__main__":
    main()
