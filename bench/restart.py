"""How long scoring stays idle after its server comes back from a restart (issue 33 item 5).

Online loops restart the inference server at every weight sync. This runs the real scheduler
against the zero-latency server of bench/bookkeeping.py, kills that server after the first
results, keeps it away for ``--outage`` seconds, starts it again on the same port, and prints
the seconds from "the server listens again" to "the next result is committed" (resume_lag_s).

``--plain-sleep`` waits out every retry backoff without probing the server (the behaviour
before health.py), for a paired before/after comparison in one checkout. The run never
gives up on the server (``down_after`` and ``max_attempts`` high), as a loop that rides
through restarts would run; the jitter is seeded, so both variants draw the same backoffs.

    python bench/restart.py --outage 10 [--plain-sleep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outage", type=float, default=10.0, help="seconds the server stays away")
    parser.add_argument("--episodes", type=int, default=200)  # enough that the kill lands mid-run
    parser.add_argument("--plain-sleep", action="store_true", help="backoff without probing (before health.py)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bookkeeping import _serve

    from hcapo_store.devkit.synth import write_standard_episodes
    from hcapo_store.devkit.tiny_model import build_demo_tokenizer
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.scoring import health
    from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
    from hcapo_store.scoring.scheduler import RunOptions
    from hcapo_store.storage.store import Store

    if args.plain_sleep:

        async def plain(self, delay, exc, stopping):  # the backoff as it was: a blind sleep
            await asyncio.sleep(delay)

        health.ServerHealth.wait_before_retry = plain  # type: ignore[method-assign]

    tmp = Path(tempfile.mkdtemp(prefix="hcapo-bench-restart-"))
    tokenizer = str(build_demo_tokenizer(tmp / "tokenizer"))
    write_standard_episodes(tmp / "episodes", args.episodes, seed=1, steps_per_subtask=2, output_words=20)
    store = Store.open(str(tmp / "store.db"))
    ingest(store, [tmp / "episodes"])
    fork = multiprocessing.get_context("fork")
    sock = _listen(0)
    port = sock.getsockname()[1]
    server = fork.Process(target=_serve, args=(sock, tokenizer), daemon=True)
    server.start()
    sock.close()
    prep = prepare(store, ScoreConfig(server=f"http://127.0.0.1:{port}", tokenizer=tokenizer))

    landed: list[tuple[float, int]] = []  # (monotonic, scored so far)
    first = threading.Event()

    def progress(report) -> None:
        landed.append((time.monotonic(), report.scored))
        first.set()

    random.seed(args.seed)
    options = RunOptions(concurrency=1, max_attempts=10_000, down_after=10_000)
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(report=run_scoring(store, prep, options, on_progress=progress))
    )
    worker.start()
    first.wait()
    server.kill()  # a restart: the port refuses connections until the new server listens
    server.join()
    killed = time.monotonic()
    time.sleep(args.outage)
    sock = _listen(port)
    back = time.monotonic()
    server = fork.Process(target=_serve, args=(sock, tokenizer), daemon=True)
    server.start()
    sock.close()
    worker.join()
    server.kill()
    after = [t for t, _ in landed if t > back]
    report = result["report"]
    print(
        json.dumps(
            {
                "variant": "plain-sleep" if args.plain_sleep else "probe",
                "outage_s": round(back - killed, 2),
                "resume_lag_s": round(after[0] - back, 2) if after else None,
                "scored": report.scored,
                "retried": report.retried,
            }
        )
    )
    store.close()


if __name__ == "__main__":
    main()
