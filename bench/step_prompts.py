"""Per-step prompts (``PromptBuilder.build_episode``, the default per-step layout) of real-size
episodes, on the CPU.

    python bench/step_prompts.py                                # the long samples, --max-context 32768
    python bench/step_prompts.py --before /tmp/old --rounds 3   # alternating with another checkout: ratios
    python bench/step_prompts.py --json OUT

The episode folders (default ../shared/samples/long/*: 99 steps, 69k and 101k Qwen3 tokens) are
ingested into a scratch store and loaded back as ``score`` does. In one process, a builder as
deployed (every strategy checked by its policy) and one with the checks off (``verify.UNCHECKED``,
which nothing that stores a score uses: it measures what the checks cost) each build every
episode's prompts once unmeasured, then ``--passes`` times in turn; CPU ms per step
(``time.process_time``) per pass, and medians; beside them, packing the deployed builder's ids
as a worker process does (``PackedIds.of``). Counted too, where the code has them: the steps
built on bounded renders and on edited renders, and the strategy fallbacks (none expected).
``--before DIR``: each round runs this script on this tree and then on DIR's ``hcapo_store`` (a
checkout of another commit), in fresh processes, ``--rounds`` times; medians per side and their
ratios.
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
SHARED = HERE.parent.parent / "shared"
sys.path.insert(0, str(HERE))
import _paired as paired  # noqa: E402


def _episodes(paths: list[str]) -> list[Any]:
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage.episodes import load_episode
    from hcapo_store.storage.store import Store

    with Store.open(str(Path(tempfile.mkdtemp(prefix="hcapo-sp-")) / "s.db")) as store:
        if ingest(store, [Path(p) for p in paths], jobs=1).failed:
            raise SystemExit("an episode failed to ingest")
        with store.engine.connect() as conn:
            ids = [r[0] for r in store.query("SELECT id FROM episodes WHERE is_current ORDER BY name")[1]]
            return [load_episode(conn, i) for i in ids]


def measure(
    tokenizer: str, episodes: list[str], max_context: int, passes: int, action_span: str = "rendered"
) -> dict[str, Any]:
    """One process's timings on whatever ``hcapo_store`` it imports."""
    import hcapo_store
    from hcapo_store.rendering import verify
    from hcapo_store.rendering.prompts import PromptBuilder
    from hcapo_store.rendering.tokenizers import load_tokenizer

    tok = load_tokenizer(tokenizer)
    eps = _episodes(episodes)
    steps = sum(len(ep.steps) for ep in eps)
    builders = {
        "checked": PromptBuilder(tok, max_context=max_context, action_span=action_span),
        "unchecked": PromptBuilder(tok, max_context=max_context, checks=verify.UNCHECKED, action_span=action_span),
    }
    before = verify.fallbacks()

    def build(builder: Any) -> float:
        t = time.process_time()
        for ep in eps:
            builder.build_episode(ep.messages, ep.outcome, ep.steps)
        return (time.process_time() - t) * 1000 / steps

    first = {name: round(build(b), 3) for name, b in builders.items()}  # template checks, caches: apart
    counted = {name: (getattr(b, "edited_steps", None), b.bounded_steps) for name, b in builders.items()}

    # what a worker process does next (scoring/preparing.py ``packed``): each request's ids packed;
    # built after the first pass, which stays each builder's first
    from hcapo_store.rendering.requests import PackedIds

    prompts = [p for ep in eps for p in builders["checked"].build_episode(ep.messages, ep.outcome, ep.steps)]
    ids = [p.input_ids for p in prompts if type(getattr(p, "input_ids", None)) is list]

    def pack() -> float:
        t = time.process_time()
        for one in ids:
            PackedIds.of(one)
        return (time.process_time() - t) * 1000 / steps

    ms: dict[str, list[float]] = {name: [] for name in builders}
    packing: list[float] = []
    for _ in range(passes):
        for name, b in builders.items():
            ms[name].append(round(build(b), 3))
        packing.append(round(pack(), 3))
    return {
        "hcapo_store": str(Path(hcapo_store.__file__).parent),
        "episodes": [f"{len(ep.steps)} steps" for ep in eps],
        "steps": steps,
        "first_pass_ms_per_step": first,
        "ms_per_step": ms,
        "packing_ms_per_step": packing,
        "ids_packed_per_step": round(sum(map(len, ids)) / steps),
        "edited_steps_first_pass": {name: c[0] for name, c in counted.items()},
        "bounded_steps_first_pass": {name: c[1] for name, c in counted.items()},
        "fallbacks": verify.since(before),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "qwen3"), help="a tokenizer directory")
    p.add_argument("--episodes", nargs="+", help="episode folders: ../shared/samples/long/*")
    p.add_argument("--max-context", type=int, default=32768)
    p.add_argument("--passes", type=int, default=4, help="measured passes per builder in a process: 4")
    p.add_argument(
        "--action-span",
        choices=["rendered", "policy"],
        default="rendered",
        help="the builders' action span (policy: the log-ratio family's trainer path)",
    )
    p.add_argument("--before", help="another checkout's root: alternate with it, print ratios")
    p.add_argument("--rounds", type=int, default=3, help="with --before: rounds, each side once per round: 3")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: print one side's JSON
    args = p.parse_args(argv)
    args.episodes = args.episodes or sorted(str(d) for d in (SHARED / "samples" / "long").glob("episode_*"))
    if not Path(args.tokenizer).is_dir() or not args.episodes:
        raise SystemExit("needs a tokenizer (--tokenizer DIR) and episode folders (--episodes DIR ...)")
    if args.one:
        print(json.dumps(measure(args.tokenizer, args.episodes, args.max_context, args.passes, args.action_span)))
        return {}
    child = ["--tokenizer", args.tokenizer, "--max-context", str(args.max_context), "--passes", str(args.passes)]
    child += ["--action-span", args.action_span]
    runs = paired.alternate(Path(__file__).resolve(), [*child, "--episodes", *args.episodes], args.before, args.rounds)
    doc: dict[str, Any] = {
        **paired.header(Path(__file__), argv),
        "max_context": args.max_context,
        "action_span": args.action_span,
        "sides": {},
    }
    for side, got in runs.items():
        row: dict[str, Any] = {"hcapo_store": got[0]["hcapo_store"], "episodes": got[0]["episodes"]}
        for name in ("checked", "unchecked"):
            row[f"{name}_ms_per_step_median"] = round(
                statistics.median(v for run in got for v in run["ms_per_step"][name]), 3
            )
        row["packing_ms_per_step_median"] = round(
            statistics.median(v for run in got for v in run["packing_ms_per_step"]), 3
        )
        row["ids_packed_per_step"] = got[0]["ids_packed_per_step"]
        row["checks_share"] = round(1 - row["unchecked_ms_per_step_median"] / row["checked_ms_per_step_median"], 3)
        row["edited_steps_first_pass"] = got[0]["edited_steps_first_pass"]["checked"]
        row["bounded_steps_first_pass"] = got[0]["bounded_steps_first_pass"]["checked"]
        row["fallbacks"] = [run["fallbacks"] for run in got]
        row["runs"] = got
        doc["sides"][side] = row
        print(
            f"{side:6s} ({row['hcapo_store']}): {row['checked_ms_per_step_median']} ms/step as deployed, "
            f"{row['unchecked_ms_per_step_median']} unchecked (checks {100 * row['checks_share']:.0f} %); "
            f"packing the ids {row['packing_ms_per_step_median']} ms/step ({row['ids_packed_per_step']} ids); "
            f"steps edited {row['edited_steps_first_pass']}, bounded {row['bounded_steps_first_pass']}; "
            f"fallbacks {row['fallbacks']}"
        )
    ratios = None
    if args.before:
        a, b = doc["sides"]["after"], doc["sides"]["before"]
        ratios = {
            name: round(a[f"{name}_ms_per_step_median"] / b[f"{name}_ms_per_step_median"], 3)
            if b[f"{name}_ms_per_step_median"]
            else None
            for name in ("checked", "unchecked", "packing")
        }
    return paired.finish(doc, ratios, args.json_out)


if __name__ == "__main__":
    main()
