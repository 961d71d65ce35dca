"""Cost against episode length: preparing one long agent session for scoring, per layout.

    python bench/long_episode.py --tokenizer ../shared/tokenizers/qwen3 --steps 250 500 1000 2000 4000 10000

For each length, one synthetic session (Pi format, ``devkit/synth.py``: bash turns with
reasoning and tool output, a plan, subtasks) is written, ingested into a scratch SQLite store
and loaded back, as ``score`` does; then, at ``--max-context`` (32768), the time to build the
requests of every step (what ``score --dry-run`` does per episode, plus the conversation's
floor) is measured for

* ``--prompt-layout episode``: one rendering of the conversation, spans placed in linear time;
* ``--prompt-layout per-step`` (grouped, the default ``sliding`` truncation): a prompt cut
  from each step's whole history, rendered in bounded windows once the history passes
  1.6 x ``--max-context`` (docs/SCORING.md), up to ``--per-step-max`` steps; the row says
  how many steps were built on bounded renders and whether an episode fell back to whole
  histories (which grows with the square of the length);
* ``--truncation turns`` (per-step, grouped): each step rendered over the head and the most
  recent whole turns that fit, up to ``--turns-max`` steps.

Prints seconds, microseconds per step and the ratio to the previous length (x2 per
doubling is linear, x4 quadratic). Nothing is sent anywhere; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hcapo_store.devkit.synth import EpisodeBuilder
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.episode_layout import conversation_tokens
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import GroupPrompt
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.scoring.grouping import plan_requests
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store


def long_episode(scratch: Path, steps: int) -> Any:
    """A session of about ``steps`` assistant steps, ingested and loaded back."""
    builder = EpisodeBuilder(seed=steps, plan_ids=("S1", "S2", "S3", "S4"))
    per_subtask = max((steps - 10) // 4, 1)
    builder.standard(steps_per_subtask=per_subtask, output_words=60).write(scratch / f"ep{steps}")
    store = Store.open(str(scratch / f"ep{steps}.db"))
    started = time.perf_counter()
    report = ingest(store, [scratch / f"ep{steps}"])
    ingest_s = time.perf_counter() - started
    if report.failed:
        raise SystemExit(f"the {steps}-step session failed to ingest")
    with store.engine.connect() as conn:
        episode = load_episode(conn, store.query("SELECT id FROM episodes")[1][0][0])
    store.close()
    return episode, ingest_s


def plan(tokenizer: Any, episode: Any, layout: str, max_context: int, truncation: str = "sliding") -> dict[str, Any]:
    builder = PromptBuilder(tokenizer, max_context=max_context, layout=layout, truncation=truncation)
    started = time.perf_counter()
    requests = plan_requests(builder, episode.messages, episode.outcome, episode.steps)
    floor = conversation_tokens(builder, episode.messages, episode.outcome, episode.steps)
    seconds = time.perf_counter() - started
    groups = [r for r in requests if isinstance(r, GroupPrompt)]
    sent = sum(len(g.input_ids) for g in groups)
    return {
        "bounded_steps": builder.bounded_steps,
        "whole_history_episodes": builder.whole_history_episodes,
        "seconds": round(seconds, 3),
        "us_per_step": round(1e6 * seconds / len(episode.steps), 1),
        "requests": len(groups),
        "scored_steps": sum(len(g.members) for g in groups),
        "floor": floor,
        "xfloor": round(sent / floor, 2) if floor else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--steps", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000, 10000])
    ap.add_argument("--per-step-max", type=int, default=4000, help="longest session timed with the per-step layout")
    ap.add_argument("--turns-max", type=int, default=4000, help="longest session timed with --truncation turns")
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for n in args.steps:
            episode, ingest_s = long_episode(Path(scratch), n)
            row: dict[str, Any] = {"steps": len(episode.steps), "messages": len(episode.messages)}
            row["ingest_s"] = round(ingest_s, 3)
            row["episode"] = plan(tokenizer, episode, "episode", args.max_context)
            if n <= args.per_step_max:
                row["per-step"] = plan(tokenizer, episode, "per-step", args.max_context)
            if n <= args.turns_max:
                row["turns"] = plan(tokenizer, episode, "per-step", args.max_context, "turns")
            rows.append(row)
            if not args.json:
                print_row(row, rows[-2] if len(rows) > 1 else None)
    if args.json:
        print(json.dumps({"machine": platform.platform(), "tokenizer": args.tokenizer.name, "rows": rows}, indent=1))


def print_row(row: dict[str, Any], previous: dict[str, Any] | None) -> None:
    parts = [f"{row['steps']:6} steps ({row['messages']} messages), ingest {row['ingest_s']:.2f}s"]
    for layout in ("episode", "per-step", "turns"):
        m = row.get(layout)
        if m is None:
            continue
        growth = ""
        if previous and layout in previous and previous[layout]["seconds"]:
            growth = (
                f", x{m['seconds'] / previous[layout]['seconds']:.1f} for x{row['steps'] / previous['steps']:.1f} steps"
            )
        bounded = ""
        if layout == "per-step":
            bounded = f", {m['bounded_steps']} steps on bounded renders"
            if m["whole_history_episodes"]:
                bounded += " (whole histories: the template failed the check)"
        parts.append(
            f"{layout}: {m['seconds']:.2f}s ({m['us_per_step']:.0f} us/step{growth}), "
            f"{m['requests']} req, {m['xfloor']}x floor{bounded}"
        )
    print("\n    ".join(parts), flush=True)


if __name__ == "__main__":
    main()
