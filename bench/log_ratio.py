"""Benchmark: ``credits compute --variant log-ratio`` over N episodes × 100 steps (no budget yet).

    python bench/log_ratio.py --episodes 1000
    python bench/log_ratio.py --episodes 10000 --before a34f1e3   # paired: that commit's module first

Builds the store of bench/credits.py (16 stored logprobs per step), copies every score to a
second scorer (the student), and times ``compute_log_ratio`` in this process (peak RSS includes
the build). ``--before REV``: ``hcapo_store/credits/log_ratio.py`` as it was at git revision REV
is timed first, on a copy of the same store, in the same process (a paired before/after).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from credits import SCORER, build  # noqa: E402
from sqlalchemy import text  # noqa: E402

from hcapo_store.credits.log_ratio import compute_log_ratio  # noqa: E402
from hcapo_store.storage import db  # noqa: E402
from hcapo_store.storage.store import Store  # noqa: E402

COPY = (
    "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob, total_action_tokens, "
    "skipped_action_tokens, truncated_prefix_tokens, input_tokens, logprob_start_len, flattened, created_at) "
    "SELECT step_id, 'student', token_logprobs, token_count, mean_logprob, total_action_tokens, "
    "skipped_action_tokens, truncated_prefix_tokens, input_tokens, logprob_start_len, flattened, created_at FROM scores"
)


def _module_at(rev: str, folder: Path):
    """``hcapo_store/credits/log_ratio.py`` as it was at ``rev``, imported under another name."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:hcapo_store/credits/log_ratio.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = folder / "log_ratio_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("log_ratio_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _time(compute, path: Path) -> dict:
    store = Store.open(str(path))
    started = time.perf_counter()
    # the bench's scorers name no weights: --allow-mixed
    run = compute(store, scorer=SCORER, against="student", name="lr", allow_mixed=True).run
    seconds = time.perf_counter() - started
    store.close()
    return {"steps": run.steps, "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--before", metavar="REV", help="time the module at this git revision first (paired)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.db"
        build(path, args.episodes, 100)
        store = Store.open(str(path))
        with db.write(store.engine) as conn:
            conn.execute(text("INSERT INTO scorers (id, label, spec, created_at) VALUES ('student', 's', '{}', 'x')"))
            conn.execute(text(COPY))
        store.close()
        out: dict = {}
        if args.before:
            copy = Path(tmp) / "before.db"
            shutil.copy(path, copy)
            out["before"] = {"rev": args.before, **_time(_module_at(args.before, Path(tmp)).compute_log_ratio, copy)}
            copy.unlink()
        out.update(_time(compute_log_ratio, path))
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(json.dumps(out))


if __name__ == "__main__":
    main()
