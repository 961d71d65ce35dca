"""Benchmark: what a prepare worker pays to start (rendering/tokenizers.py ``load_as``).

    python bench/tokenizer_load.py --rounds 5 --before /path/to/older/checkout --json-out r.json

Each round, each side (this tree; with ``--before``, that checkout's ``hcapo_store``) runs in a
fresh process that loads the tokenizer as a parent does (``load_tokenizer``), makes the
builder recipe and starts one worker as ``follow``'s prepare workers start (spawned, importing
everything itself: ``follow`` preloads ingest's modules only), then reports the worker's CPU
seconds and peak RSS (VmHWM: Linux) from its own start to its builder made, and the wall time the parent
waited. Beside it, a fresh interpreter importing ``scoring/worker_imports.py``: what ``score``'s
forkserver imports once before it forks a worker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paired import REPO, alternate, finish, header

QWEN3 = REPO.parent / "shared" / "tokenizers" / "qwen3"


def _worker(recipe, out) -> None:  # type: ignore[no-untyped-def]
    recipe.build()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put(
        {
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "rss_mb": _peak_rss_mb(),
            "torch": "torch" in sys.modules,
        }
    )


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): ``ru_maxrss`` keeps the forking parent's
    across the spawn's exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Builder:  # BuilderRecipe.of reads only whether the builder renders by the rules
    reference = False


def one(tokenizer: str) -> dict[str, object]:
    from hcapo_store.rendering.tokenizers import load_tokenizer
    from hcapo_store.scoring.preparing import BuilderRecipe

    load_tokenizer(tokenizer)
    recipe = BuilderRecipe.of(tokenizer, {}, _Builder())  # type: ignore[arg-type]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    started = time.perf_counter()
    proc = ctx.Process(target=_worker, args=(recipe, out))
    proc.start()
    seen = out.get(timeout=600)
    seen["wall_s"] = time.perf_counter() - started
    proc.join()
    code = "import time, resource; import hcapo_store.scoring.worker_imports; u = resource.getrusage(0); print(u.ru_utime + u.ru_stime)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seen["forkserver_imports_cpu_s"] = float(done.stdout.strip())
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in seen.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(QWEN3 if QWEN3.is_dir() else ""), help="tokenizer directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="another checkout to run in the same rounds (paired)")
    parser.add_argument("--json-out")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.tokenizer:
        raise SystemExit("no tokenizer: pass --tokenizer DIR (../shared/tokenizers/qwen3 is absent)")
    if args.one:
        print(json.dumps(one(args.tokenizer)))
        return
    runs = alternate(Path(__file__), ["--tokenizer", args.tokenizer], args.before, args.rounds)
    doc: dict[str, object] = header(Path(__file__), argv) | {"runs": runs}
    fields = ("cpu_s", "rss_mb", "wall_s", "forkserver_imports_cpu_s")
    medians = {side: {f: statistics.median(r[f] for r in rs) for f in fields} for side, rs in runs.items()}
    doc["medians"] = medians
    for side, m in medians.items():
        print(
            f"{side}: "
            + ", ".join(f"{f} {v:.2f}" for f, v in m.items())
            + f" (torch in the worker: {runs[side][0]['torch']})"
        )
    ratios = None
    if "before" in runs:
        pairs = list(zip(runs["after"], runs["before"], strict=True))
        ratios = {f: round(statistics.median(a[f] / b[f] for a, b in pairs), 3) for f in fields}
    finish(doc, ratios, args.json_out)


if __name__ == "__main__":
    main()
