"""Benchmark: the scoring client's CPU per step (claim → build prompt → request → verify →
commit) against a zero-latency server (budget: ≤ 1 ms of client CPU per step with
``--prompt-layout episode``, preparation, bookkeeping and HTTP included: the end-to-end run;
BENCHMARKS.md, issue 34 "The client budget, restated").

    python bench/bookkeeping.py --episodes 16 --repeat 3 --prompt-layout episode
    python bench/bookkeeping.py --episodes 6 --repeat 3
    python bench/bookkeeping.py --episodes 6 --db postgresql://postgres@127.0.0.1:5432/postgres
    python bench/bookkeeping.py --episodes 6 --workers 4 --db postgresql://…   # + N worker processes

The server is a raw-asyncio HTTP/1.1 server in a child process (its own core): it answers
``/generate`` at once with correctly shaped ``input_token_logprobs`` echoing the sent ids
(value -0.5), so everything measured is the client. Inputs (``--input``):
  real       (default) copies of the long real-format samples (bench/ingest.py: 99 steps,
             69k and 101k Qwen3 tokens per episode), scored at max_context 32768, so
             requests carry 20–27k ids as in production;
  budget     synthetic 99-step episodes of ~25k tokens (the shape the budget was derived
             from: 8 ms of GPU prefill per step), at max_context 32768 (one request each);
  synthetic  the older 15-step synthetic episodes with long thinking, at max_context 4096
             (~4k-id requests; every scored span 2048 tokens).
The end-to-end run (prompts planned during the run: the budget's figure) and the
bookkeeping-only run (prompts planned beforehand) are each repeated ``--repeat`` times; each
bookkeeping run is paired with the same run with request and response bodies through the
stdlib ``json`` (the baseline the orjson path replaces), alternating the order. Requests go
through httpx's own transport, as in production. The real Scheduler runs through
``scoring.prepare`` / ``run_scoring``; the time inside prompt building, the HTTP round trip
(+ verification) and the database is measured by wrapping those calls (they overlap across
the ``--concurrency`` workers, so they are shares of work, not of wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import types
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

try:
    import orjson

    _dumps, _loads = orjson.dumps, orjson.loads
except ImportError:  # pragma: no cover
    orjson = None
    _dumps, _loads = (lambda o: json.dumps(o).encode()), json.loads

PREFILL_TOKENS_PER_S = 30_000  # an 8B model's prefill on one H100 (issue 34, "The client budget, restated")
QWEN3 = REPO.parent / "shared" / "tokenizers" / "qwen3"


# --------------------------------------------------------------------------- the zero-latency server


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, info: bytes, tokenizer: Any) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path, _ = lines[0].split(b" ", 2)
            length = 0
            for line in lines[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length) if length else b""
            if path.startswith(b"/generate"):
                req = _loads(body)
                ids = req["input_ids"]
                start = req.get("logprob_start_len")
                if start is None:  # the vocabulary probe before a run: a prefill without logprobs
                    entries = []
                else:
                    entries = [[None, ids[start], None]] + [[-0.5, t, None] for t in ids[start + 1 :]]
                out = _dumps(
                    {
                        "text": "",
                        "output_ids": [],
                        "meta_info": {
                            "id": req.get("rid"),
                            "finish_reason": {"type": "length", "length": 0},
                            "prompt_tokens": len(ids),
                            "completion_tokens": 0,
                            "cached_tokens": 0,
                            "input_token_logprobs": entries,
                            "output_token_logprobs": [],
                        },
                    }
                )
            elif path.startswith(b"/tokenize"):
                req = _loads(body)
                tokens = tokenizer(req["prompt"], add_special_tokens=req.get("add_special_tokens", True))["input_ids"]
                out = _dumps({"tokens": list(tokens), "count": len(tokens), "max_model_len": 1 << 20})
            elif path.startswith(b"/model_info") or path.startswith(b"/server_info"):
                out = info
            else:
                out = b'{"ok": true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(out)).encode()
                + b"\r\n\r\n"
                + out
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _serve(sock: socket.socket, tokenizer_path: str) -> None:
    info = _dumps({"model_path": "bench-model", "tokenizer_path": tokenizer_path, "context_length": 1 << 20})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)  # the client's probe text goes through /tokenize

    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: _handle(r, w, info, tokenizer), sock=sock)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start_server(tokenizer_path: str, backlog: int = 256) -> tuple[str, multiprocessing.process.BaseProcess]:
    """:func:`_serve` in a forked process on a free port of 127.0.0.1: (its URL, the process;
    terminate it when done). The listening socket is the child's alone once it has started."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = multiprocessing.get_context("fork").Process(target=_serve, args=(sock, tokenizer_path), daemon=True)
    server.start()
    sock.close()
    return url, server


# --------------------------------------------------------------------------- synthetic episodes


def write_long_episodes(root: Path, n: int, *, words_per_action: int, steps_per_subtask: int) -> None:
    """Standard episodes whose every assistant turn carries a long thinking block."""
    import random

    from hcapo_store.devkit.synth import EpisodeBuilder, words

    for i in range(1, n + 1):
        b = EpisodeBuilder(seed=i, episode_id=i, reward=round(random.Random(i).random(), 4))
        b.standard(steps_per_subtask=steps_per_subtask, output_words=60)
        rng = random.Random(1000 + i)
        for entry in b.entries:
            message = entry.get("message") or {}
            if message.get("role") == "assistant":
                message["content"].insert(
                    0,
                    {
                        "type": "thinking",
                        "thinking": words(rng, words_per_action),
                        "thinkingSignature": "reasoning_content",
                    },
                )
        b.write(root / f"episode_{i:03d}")


# --------------------------------------------------------------------------- timing hooks


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, name: str, dt: float) -> None:
        with self._lock:
            self.seconds[name] += dt
            self.calls[name] += 1

    def wrap_sync(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def wrapped(*a: Any, **kw: Any) -> Any:
            # The calling thread's CPU (sync calls run in one thread; threads a library starts,
            # such as the tokenizer's batch workers, are not in it): wall time would count the
            # waits for the GIL while the event loop runs.
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.thread_time() - t)

        setattr(owner, attr, wrapped)

    def wrap_async(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        async def wrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t)

        setattr(owner, attr, wrapped)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=6)
    ap.add_argument("--input", choices=("real", "budget", "synthetic"), default="real")
    ap.add_argument("--steps-per-subtask", type=int, default=1, help="synthetic: 15 steps per episode with 1")
    ap.add_argument(
        "--words-per-action", type=int, default=2300, help="synthetic: thinking words added to every action"
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=None, help="default: 32768 (real), 4096 (synthetic)")
    ap.add_argument(
        "--baseline-input",
        choices=("synthetic",),
        help="also pair with the old synthetic ~4k-id requests (7 episodes of 15 steps per --episodes)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="end-to-end runs, and bookkeeping runs each paired with a stdlib-json run (alternating order)",
    )
    ap.add_argument("--max-logprob-tokens", type=int, default=2048)
    ap.add_argument(
        "--tokenizer",
        default=str(QWEN3) if QWEN3.is_dir() else None,
        help="tokenizer directory (default: the shared Qwen3 tokenizer, else the demo tokenizer)",
    )
    ap.add_argument("--db", default=None, help="database URL or SQLite path (default: a fresh temporary SQLite file)")
    ap.add_argument("--no-timers", action="store_true", help="do not wrap calls to time the parts")
    ap.add_argument("--profile", metavar="FILE", help="write a cProfile of the scoring run to FILE")
    ap.add_argument(
        "--profile-end-to-end", action="store_true", help="--profile the first end-to-end run instead of bookkeeping"
    )
    ap.add_argument("--only-bookkeeping", action="store_true", help="skip the end-to-end run (e.g. to profile)")
    ap.add_argument(
        "--workers", type=int, default=0, help="also run bookkeeping with N separate worker processes sharing the queue"
    )
    ap.add_argument(
        "--prompt-layout",
        choices=("per-step", "episode"),
        default="per-step",
        help="episode: one rendering per episode, its steps scored in windows of --max-context (many steps per request)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.max_context is None:
        args.max_context = 4096 if args.input == "synthetic" else 32768

    from sqlalchemy import text

    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.rendering.prompts import PromptBuilder
    from hcapo_store.scoring import preparing as preparing_mod
    from hcapo_store.scoring import scheduler as scheduler_mod
    from hcapo_store.scoring import work_queue
    from hcapo_store.scoring.backends.sglang import SGLangBackend
    from hcapo_store.scoring.job import ScoreConfig, prepare
    from hcapo_store.scoring.scheduler import RunOptions
    from hcapo_store.scoring.writer import ResultWriter
    from hcapo_store.storage.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="hcapo-bench-bookkeeping-"))
    tokenizer = args.tokenizer
    if tokenizer is None:
        from hcapo_store.devkit.tiny_model import build_demo_tokenizer

        tokenizer = str(build_demo_tokenizer(tmp / "tokenizer"))

    url, server = start_server(tokenizer)

    t = time.perf_counter()
    if args.input == "real":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ingest import write_real_episodes

        write_real_episodes(tmp / "episodes", args.episodes)
    elif args.input == "budget":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ingest import BUDGET_OUTPUT_WORDS, write_synthetic_episodes

        write_synthetic_episodes(tmp / "episodes", args.episodes, output_words=BUDGET_OUTPUT_WORDS)
    else:
        write_long_episodes(
            tmp / "episodes",
            args.episodes,
            words_per_action=args.words_per_action,
            steps_per_subtask=args.steps_per_subtask,
        )
    store = Store.open(args.db or str(tmp / "bench.db"))
    report = ingest(store, [tmp / "episodes"])
    setup_s = time.perf_counter() - t

    cfg = ScoreConfig(
        backend="sglang",
        server=url,
        tokenizer=tokenizer,
        max_context=args.max_context,
        max_logprob_tokens=args.max_logprob_tokens,
        prompt_layout=args.prompt_layout,
    )
    prep = prepare(store, cfg)
    if args.db:  # a reused database: start this scorer from scratch
        _reset_scorer(store, prep.scorer_id)

    timers = Timers()
    if not args.no_timers:
        timers.wrap_sync(PromptBuilder, "build_episode", "prompt building")
        timers.wrap_sync(preparing_mod, "load_episode", "DB load_episode (thread CPU)")
        timers.wrap_sync(preparing_mod, "plan_requests_and_floor", "planning (thread CPU)")
        timers.wrap_async(SGLangBackend, "score", "HTTP request + verify")
        timers.wrap_sync(work_queue, "claim", "DB claim")
        timers.wrap_sync(work_queue, "write_results", "DB commit (write_results)")
        timers.wrap_sync(work_queue, "heartbeat", "DB heartbeat")
        timers.wrap_sync(scheduler_mod, "score_row", "score_row (numpy)")
        timers.wrap_sync(ResultWriter, "_write", "flush (one commit, in the writer thread)")

    options = RunOptions(concurrency=args.concurrency)
    runs: dict[str, Any] = {}
    end_to_end: list[dict[str, Any]] = []
    if not args.only_bookkeeping:
        for rep in range(args.repeat):  # planned during each run: preparation is in the figure
            _reset_scorer(store, prep.scorer_id)
            e2e_profile = args.profile if (rep == 0 and args.profile_end_to_end) else None
            end_to_end.append(_timed_run(store, prep, options, timers, profile=e2e_profile))
            runs[f"end_to_end#{rep + 1}"] = end_to_end[-1]
    # The same run again with every request planned beforehand (prompts, grouping and the
    # episode's floor): claim → request → verify → commit only (client-side preparation has
    # its own budget, bench/prep.py).
    plans = [(store, prep.builder)]
    cases: dict[str, tuple[Any, Any, bool]] = {
        "bookkeeping": (store, prep, None),
        "bookkeeping_stdlib_json": (store, prep, "stdlib-json"),
    }
    if args.baseline_input == "synthetic":
        # The old bench's ~4k-id requests, same code and server, paired in the same process.
        write_long_episodes(
            tmp / "synthetic",
            max(args.episodes * 7, 1),
            words_per_action=args.words_per_action,
            steps_per_subtask=args.steps_per_subtask,
        )
        store2 = Store.open(str(tmp / "synthetic.db"))
        ingest(store2, [tmp / "synthetic"])
        prep2 = prepare(store2, replace(cfg, max_context=4096))
        plans.append((store2, prep2.builder))
        cases["bookkeeping_synthetic_4k"] = (store2, prep2, None)
    _prebuild_requests(plans, preparing_mod)
    pairs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for rep in range(args.repeat):
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for mode in order:
            case_store, case_prep, variant = cases[mode]
            _reset_scorer(case_store, case_prep.scorer_id)
            with _json_codec(stdlib=variant == "stdlib-json"):
                profile = args.profile if (rep == 0 and mode == "bookkeeping" and not args.profile_end_to_end) else None
                pairs[mode].append(_timed_run(case_store, case_prep, options, timers, profile=profile))
    for mode, results in pairs.items():
        for rep, result in enumerate(results):
            runs[f"{mode}#{rep + 1}"] = result
    summary = {mode: _min_med_max([r["steps_per_s"] for r in results]) for mode, results in pairs.items()}
    summary.update(
        {
            f"{mode}_client_cpu_ms_per_step": _min_med_max(
                [1000 * r["client_cpu_s"] / max(r["steps"], 1) for r in results]
            )
            for mode, results in pairs.items()
        }
    )
    summary["orjson_over_stdlib"] = _min_med_max(
        [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(pairs["bookkeeping"], pairs["bookkeeping_stdlib_json"])]
    )
    if end_to_end:  # the budget's figure: preparation, bookkeeping and HTTP
        summary["end_to_end_client_cpu_ms_per_step"] = _min_med_max(
            [1000 * r["client_cpu_s"] / max(r["steps"], 1) for r in end_to_end]
        )
    if "bookkeeping_synthetic_4k" in pairs:
        summary["client_cpu_real_over_synthetic_4k"] = _min_med_max(
            [
                (a["client_cpu_s"] / a["steps"]) / (b["client_cpu_s"] / b["steps"])
                for a, b in zip(pairs["bookkeeping"], pairs["bookkeeping_synthetic_4k"])
            ]
        )
    if "bookkeeping_synthetic_4k" in cases:
        cases["bookkeeping_synthetic_4k"][0].close()

    if args.workers:
        runs[f"workers_{args.workers}"] = _run_workers(store, prep, options, args.workers)

    with store.engine.connect() as conn:
        tokens = conn.execute(
            text(
                "SELECT MIN(token_count), AVG(token_count), AVG(input_tokens), AVG(sent_tokens) "
                "FROM scores WHERE scorer_id = :s"
            ),
            {"s": prep.scorer_id},
        ).one()
    # What the budget protects: the GPUs. A step's share of the prompt tokens sent, prefilled at
    # PREFILL_TOKENS_PER_S (an 8B model on one H100, issue 34), is the GPU time the client's
    # CPU per step is set against: how many such GPUs one client core keeps busy.
    sent_per_step = float(tokens[3] or 0)
    gpu_ms_per_step = 1000 * sent_per_step / PREFILL_TOKENS_PER_S
    if end_to_end:
        client_ms = summary["end_to_end_client_cpu_ms_per_step"][1]
        summary["gpus_per_client_core"] = (gpu_ms_per_step / client_ms,) * 3 if client_ms else (0.0, 0.0, 0.0)
    server.terminate()
    store.close()

    out = {
        "episodes": args.episodes,
        "concurrency": args.concurrency,
        "db": store.display,
        "min_scored_tokens": tokens[0],
        "mean_scored_tokens": float(tokens[1] or 0),
        "mean_input_tokens": float(tokens[2] or 0),
        "sent_tokens_per_step": round(sent_per_step, 1),
        "gpu_ms_per_step_at_prefill_rate": round(gpu_ms_per_step, 2),
        "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        "budget_client_cpu_ms_per_step": 1.0,
        "setup_s": round(setup_s, 2),
        "ingested": report.new,
        "timing_hooks": not args.no_timers,
        **runs,
        "summary": summary,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"{args.episodes} episodes, scored span min {tokens[0]} / mean {out['mean_scored_tokens']:.0f} tokens, "
        f"mean input {out['mean_input_tokens']:.0f} tokens, concurrency {args.concurrency}, {out['db']}"
    )
    print(
        f"prompt tokens sent per step {sent_per_step:.0f} → {gpu_ms_per_step:.1f} ms of GPU prefill per step "
        f"at {PREFILL_TOKENS_PER_S:,} tokens/s"
    )
    for mode, run in runs.items():
        label = {
            "end_to_end": "end to end (prompts planned during the run)",
            "bookkeeping": "bookkeeping only (prompts prebuilt): claim, request, verify, commit",
            "bookkeeping_stdlib_json": "bookkeeping only, stdlib json bodies (baseline)",
            "bookkeeping_synthetic_4k": "bookkeeping only, old synthetic ~4k-id requests (baseline)",
        }.get(mode.split("#")[0], f"bookkeeping, {args.workers} worker processes sharing the queue (prompts prebuilt)")
        if "#" in mode:
            label += f", run {mode.split('#')[1]}"
        print(
            f"{label}: {run['steps']} steps ({run['failed']} failed) in {run['wall_s']:.2f} s → "
            f"{run['steps_per_s']:.0f} steps/s; client CPU {run['client_cpu_s']:.2f} s → "
            f"{run['steps_per_client_cpu_s']:.0f} steps per CPU-second"
            + ("" if args.no_timers else " [with timing hooks]")
        )
        for name, seconds in sorted(run["parts_s"].items(), key=lambda kv: -kv[1]):
            print(
                f"  {name:28s} {seconds:7.3f} s  {1000 * seconds / max(run['steps'], 1):7.3f} ms/step"
                f"  ({run['parts_calls'][name]} calls)"
            )
    for mode, (lo, med, hi) in summary.items():
        unit = "×" if "_over_" in mode or mode == "gpus_per_client_core" else ""
        print(
            f"{mode}: min {unit}{lo:.2f} / median {unit}{med:.2f} / max {unit}{hi:.2f}"
            + ("" if unit else " ms" if mode.endswith("ms_per_step") else " steps/s")
        )
    print(
        "budget (BENCHMARKS.md): <= 1 ms of client CPU per step end to end with --prompt-layout episode "
        "(one client core keeps >= 8 GPUs busy at the prefill floor); the timed parts overlap across workers"
    )


def _min_med_max(values: list[float]) -> tuple[float, float, float]:
    return (min(values), statistics.median(values), max(values)) if values else (0.0, 0.0, 0.0)


class _json_codec:
    """Within the block, HttpClient encodes and decodes bodies with the stdlib json."""

    def __init__(self, *, stdlib: bool) -> None:
        self.stdlib = stdlib

    def __enter__(self) -> None:
        from hcapo_store.scoring.backends import http

        self.saved = http.orjson
        if self.stdlib:  # orjson is a hard dependency now: swap in a stand-in with its two calls
            # option: orjson's flags (its numpy support: ids from worker processes come as arrays)
            http.orjson = types.SimpleNamespace(
                dumps=lambda obj, option=0: json.dumps(obj, default=lambda a: a.tolist()).encode(), loads=json.loads
            )

    def __exit__(self, *exc: object) -> None:
        from hcapo_store.scoring.backends import http

        http.orjson = self.saved


def _timed_run(store: Any, prep: Any, options: Any, timers: Timers, *, profile: str | None = None) -> dict[str, Any]:
    from hcapo_store.scoring.job import run_scoring

    timers.seconds.clear()
    timers.calls.clear()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile(time.process_time)  # CPU shares: waiting on the server is not cost
        profiler.enable()
    t, cpu = time.perf_counter(), time.process_time()
    result = run_scoring(store, prep, options)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return {
        "steps": result.scored,
        "failed": result.failed,
        "wall_s": round(wall, 3),
        "steps_per_s": round(result.scored / wall, 1) if wall else 0.0,
        # The client's own CPU time (all threads): what it could sustain on a free core.
        "client_cpu_s": round(cpu, 3),
        "steps_per_client_cpu_s": round(result.scored / cpu, 1) if cpu else 0.0,
        "parts_s": {k: round(v, 3) for k, v in timers.seconds.items()},
        "parts_calls": dict(timers.calls),
    }


def _worker(url: str, prep: Any, options: Any, out: Any) -> None:
    """One forked worker process: its own engine, the shared queue, prebuilt prompts."""
    from hcapo_store.scoring.job import run_scoring
    from hcapo_store.storage.store import Store

    store = Store.open(url, create=False)
    t, cpu = time.perf_counter(), time.process_time()
    report = run_scoring(store, prep, options)
    out.send((report.scored, report.failed, time.perf_counter() - t, time.process_time() - cpu))
    store.close()


def _run_workers(store: Any, prep: Any, options: Any, n: int) -> dict[str, Any]:
    """N processes on one queue; wall time from the first start to the last exit."""

    _reset_scorer(store, prep.scorer_id)
    store.engine.dispose()  # forked children must not inherit open database connections
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    t = time.perf_counter()
    for i in range(n):
        recv, send = ctx.Pipe(duplex=False)
        opts = replace(options, worker_id=f"bench-w{i + 1}")
        proc = ctx.Process(target=_worker, args=(store.url, prep, opts, send))
        proc.start()
        pipes.append(recv)
        procs.append(proc)
    results = [p.recv() for p in pipes]
    for proc in procs:
        proc.join()
    wall = time.perf_counter() - t
    scored = sum(r[0] for r in results)
    cpu = sum(r[3] for r in results)
    return {
        "steps": scored,
        "failed": sum(r[1] for r in results),
        "wall_s": round(wall, 3),
        "steps_per_s": round(scored / wall, 1) if wall else 0.0,
        "client_cpu_s": round(cpu, 3),
        "steps_per_client_cpu_s": round(scored / cpu, 1) if cpu else 0.0,
        "per_worker_steps": [r[0] for r in results],
        "parts_s": {},
        "parts_calls": {},
    }


def _prebuild_requests(plans: list[tuple[Any, Any]], preparing_mod: Any) -> None:
    """Every episode's requests and floor, planned now for each (store, builder); the
    preparation's planning call (scoring/preparing.py) answers from them (a claim of other
    steps than all of them is planned live)."""
    from sqlalchemy import text

    from hcapo_store.storage.episodes import load_episode

    plan = preparing_mod.plan_requests_and_floor
    built: dict[tuple[Any, ...], Any] = {}

    def key(builder: Any, messages: Any, outcome: Any, steps: Any) -> tuple[Any, ...]:
        return (id(builder), outcome.reward, messages[0]["content"][:200], tuple(s.step_index for s in steps))

    for store, builder in plans:
        with store.engine.connect() as conn:
            for (episode_id,) in conn.execute(text("SELECT id FROM episodes WHERE is_current")).all():
                e = load_episode(conn, episode_id)
                built[key(builder, e.messages, e.outcome, e.steps)] = plan(
                    builder, e.messages, e.outcome, e.steps, e.steps
                )

    def prebuilt(builder: Any, messages: Any, outcome: Any, steps: Any, all_steps: Any, **kw: Any) -> Any:
        hit = built.get(key(builder, messages, outcome, steps))
        return hit if hit is not None else plan(builder, messages, outcome, steps, all_steps, **kw)

    preparing_mod.plan_requests_and_floor = prebuilt


def _reset_scorer(store: Any, scorer_id: str) -> None:
    from sqlalchemy import text

    with store.engine.begin() as conn:
        conn.execute(text("DELETE FROM scores WHERE scorer_id = :s"), {"s": scorer_id})
        conn.execute(
            text("DELETE FROM attempt_errors WHERE attempt_id IN (SELECT id FROM attempts WHERE scorer_id = :s)"),
            {"s": scorer_id},
        )
        conn.execute(text("DELETE FROM attempts WHERE scorer_id = :s"), {"s": scorer_id})


if __name__ == "__main__":
    main()
