"""Benchmark: ``credits compute --variant log-ratio`` over N episodes × 100 steps (no budget yet).

    python bench/log_ratio.py --episodes 1000

Builds the store of bench/credits.py (16 stored logprobs per step), copies every score to a
second scorer (the student), and times ``compute_log_ratio`` in this process (peak RSS includes
the build).
"""

from __future__ import annotations

import argparse
import json
import resource
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.db"
        build(path, args.episodes, 100)
        store = Store.open(str(path))
        with db.write(store.engine) as conn:
            conn.execute(text("INSERT INTO scorers (id, label, spec, created_at) VALUES ('student', 's', '{}', 'x')"))
            conn.execute(text(COPY))
        started = time.perf_counter()
        # the bench's scorers name no weights: --allow-mixed
        run = compute_log_ratio(store, scorer=SCORER, against="student", name="lr", allow_mixed=True).run
        seconds = time.perf_counter() - started
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(json.dumps({"steps": run.steps, "seconds": round(seconds, 2), "peak_rss_mb": rss}))
        store.close()


if __name__ == "__main__":
    main()
