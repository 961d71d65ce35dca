"""Benchmark: the scoring client's CPU per request, by transport, side by side in one run.

    python bench/http_client.py                   # 800 requests a round, concurrency 8, 3 rounds
    python bench/http_client.py --json

Each round sends the same requests through ``HttpClient`` over each transport kind
(``http.transport_for``: "auto", the origin pool on the event loop's sockets; "anyio", the same
pool on httpcore's anyio streams; "httpx", httpx's own transport, which the client used before
the nineteenth session and still uses through a proxy) to the zero-latency ``/generate`` server
of bench/bookkeeping.py in its own process. The requests are shaped like a per-step batch's
(``--ids`` of 8k-22k token ids, the logprobs of the last 60 asked for: ~88 KB a request on
average), so what is measured is the client's own work per request: JSON of the payload, the
HTTP exchange, reading and decoding the answer. Reported: client CPU ms per request (process
time over the round) and wall ms per request; ratios against "httpx" in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bookkeeping import QWEN3, start_server  # noqa: E402

KINDS = ("auto", "anyio", "httpx")


def _payloads(count: int, low: int, high: int, seed: int = 0) -> list[dict[str, Any]]:
    import numpy as np

    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(low, high)
        ids = np.array([rng.randrange(150_000) for _ in range(n)], dtype=np.int32)  # as PackedIds go out
        out.append(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": n - 60,
                "rid": f"bench-{i}",
            }
        )
    return out


async def _round(url: str, kind: str, payloads: list[dict[str, Any]], n: int, concurrency: int) -> tuple[float, float]:
    from hcapo_store.scoring.backends.http import HttpClient

    client = HttpClient(url, transport=kind)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            answer = await client.post_json("/generate", payloads[i % len(payloads)])
            return len(answer["meta_info"]["input_token_logprobs"])

    try:
        await asyncio.gather(*(one(i) for i in range(concurrency)))  # connections open, warm
        wall, cpu = time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*(one(i) for i in range(n)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await client.close()
    if any(c != 60 for c in counts):
        raise SystemExit(f"{kind}: an answer without its 60 logprobs")
    return cpu / n * 1e3, wall / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=800, help="requests per transport per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--ids", type=int, nargs=2, default=(8_000, 22_000), metavar=("LOW", "HIGH"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tokenizer = str(QWEN3) if QWEN3.is_dir() else None
    if tokenizer is None:
        from hcapo_store.devkit.tiny_model import build_demo_tokenizer

        tokenizer = str(build_demo_tokenizer(Path(os.environ.get("TMPDIR", "/tmp")) / "hcapo-bench-http-tok"))
    url, server = start_server(tokenizer)
    payloads = _payloads(16, *args.ids)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            order = KINDS if r % 2 == 0 else tuple(reversed(KINDS))  # neither side always first
            got = {k: asyncio.run(_round(url, k, payloads, args.requests, args.concurrency)) for k in order}
            for kind in KINDS:
                cpu, wall = got[kind]
                rows.append(
                    {
                        "round": r + 1,
                        "transport": kind,
                        "cpu_ms_per_request": round(cpu, 3),
                        "wall_ms_per_request": round(wall, 3),
                        "cpu_over_httpx": round(cpu / got["httpx"][0], 3),
                    }
                )
                if not args.json:
                    print(
                        f"round {r + 1} {kind:6s} {cpu:.3f} CPU-ms / request, {wall:.3f} ms wall "
                        f"(CPU ×{cpu / got['httpx'][0]:.2f} httpx's)",
                        flush=True,
                    )
    finally:
        server.terminate()
    medians = {
        k: round(statistics.median(row["cpu_over_httpx"] for row in rows if row["transport"] == k), 3) for k in KINDS
    }
    result = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "ids": list(args.ids),
        "rows": rows,
        "median_cpu_over_httpx": medians,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print("median CPU per request over httpx's transport: " + ", ".join(f"{k} ×{v}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
