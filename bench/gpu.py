"""The in-process and live scoring paths on a GPU against the prefill floor (issue 43).

    bash bench/gpu_wheels.sh                      # here: .gpu/wheels and .gpu/qwen3.tar.gz (carry .gpu)
    python3 -m pip install -q --no-index --no-deps --target /tmp/hcapo/site-packages .gpu/wheels/*.whl  # GPU
    export PYTHONPATH=/tmp/hcapo/site-packages
    PYTHONUNBUFFERED=1 python3 bench/gpu.py --out "$OUT/gpu.json"
    python bench/gpu.py --size tiny --tokenizer DIR --out /tmp/gpu.json # the CPU check (tests)
    python bench/gpu.py --summary gpu-8b.json gpu-small.json           # a saved run's lines (no torch)

Per model shape (random bf16 weights of Qwen3-0.6B, -1.7B and -8B shapes, built on the GPU:
meta init, ``to_empty`` on the device, normal init; no download), it measures

* ``floor``: the decoder body alone over one sequence (``model.model(ids)``) at 2k / 8k / 32k
  tokens (tokens/s, TFLOP/s), and ``LogprobModel.score_spans`` with ~30 % of the positions
  scored at the same lengths (its time over the body's);
* ``paths``: ``prepare`` + ``run_scoring`` with the live backend (``LiveModelBackend``, the policy
  scoring itself: ``score_live``'s path) on synthetic 99-step episodes
  (``EpisodeBuilder(...).standard(steps_per_subtask=22)``), prompt layouts ``episode`` and
  ``per-step``, concurrency 1 / 2 / 4: conversation and sent tokens/s, the share of the floor
  (the body's time for the same forwards over the run's wall time), the GPU-busy share (CUDA
  events around each forward over the wall time), the GPU's idle milliseconds per step, the
  forwards' time over the body's (``busy_over_floor``) and, with CUDA graphs, the replayed forwards'
  alone (``replay_over_floor``: captures and checks left out) and each kind's count (``forward_kinds``);
* ``floor_after``: the body alone again after the runs, at the middle length, over the first
  measurement (``over_before`` < 1: the GPU ran slower under the runs' sustained load);
* ``drift``: log-probabilities of one sequence (8k tokens, ~30 % scored) with the weights in
  bf16 and the same weights in fp32: mean and max absolute difference (nats).

Each shape's JSON is printed as one line when done; the whole file (``--out``, else
``$OUT/gpu.json``) is rewritten after every measurement, so a run stopped early leaves what
it measured. ``--budget-s`` bounds the whole run: a measurement that would not fit is skipped
and says so. ``--size tiny`` runs the same code on the CPU in seconds (tests/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_common import VOCAB, add_common_args, build_model, elapsed_ms, resolve_tokenizer, save, start, sync

GPU_ORDER = ("8b", "0.6b", "1.7b")  # the 8B first: its 0.90 is the goal
# of the time left, per shape (others 1): the 8B's forwards take ~3x the 1.7B's, and its goal needs a long
# window (one periodic check in a 24-forward window was 4 % of it; over a long run one in 64 is ~1.6 %)
SHARE_WEIGHT = {"8b": 4.0}
SCORED_SHARE = 0.3  # of the positions scored in the floor's score_spans and in the drift
__all__ = ["VOCAB", "build_model", "save", "sync"]  # gpu_gaps.py reads them here too


def main() -> None:
    if sys.argv[1:2] == ["--summary"]:  # a saved run's lines, no GPU and no torch needed
        for name in sys.argv[2:]:
            print(f"{name}:")
            print("\n".join(summary(json.loads(Path(name).read_text(encoding="utf-8")))))
        return
    args = parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s
    out, device, doc = start(args, "gpu", "gpu.json")
    import torch

    tiny = args.size == "tiny"
    doc["prepare"] = args.prepare
    doc["shapes"] = []
    save(out, doc)
    work = Path(tempfile.mkdtemp(prefix="hcapo-gpu-"))
    episodes = Episodes(work, args)
    doc["episodes"] = episodes.describe()
    save(out, doc)
    shapes = ["tiny"] if tiny else [s for s in GPU_ORDER if s in args.shapes]
    for index, shape in enumerate(shapes):
        left = deadline - time.monotonic()
        weights = [SHARE_WEIGHT.get(s, 1.0) for s in shapes[index:]]
        share = left * weights[0] / sum(weights)  # what is left, split over the shapes still to go
        result: dict[str, Any] = {"shape": shape}
        doc["shapes"].append(result)
        try:

            def flush(what: str, result: dict = result) -> None:
                save(out, doc)
                print(f"[{time.monotonic() - started:6.1f} s] {result['shape']}: {what}", file=sys.stderr, flush=True)

            measure_shape(shape, args, device, episodes, result, time.monotonic() + share, flush)
        except Exception as exc:  # the next shape still runs; the error is in the JSON
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()[-4000:]
        result["seconds"] = round(time.monotonic() - started, 1)
        save(out, doc)
        print(json.dumps(result), flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    doc["seconds"] = round(time.monotonic() - started, 1)
    save(out, doc)
    print(json.dumps({"summary": summary(doc)}), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p, out="gpu.json", budget_s=270.0)
    p.add_argument("--shapes", nargs="+", default=list(GPU_ORDER), choices=list(GPU_ORDER))
    p.add_argument("--episodes", type=int, default=32, help="episodes of the episode layout (at most)")
    p.add_argument("--per-step-episodes", type=int, default=4, help="episodes of the per-step layout (at most)")
    p.add_argument("--measure-s", type=float, default=4.0, help="aim of one end-to-end measurement, seconds")
    p.add_argument("--run-episodes", type=int, default=0,
                   help="episodes of every end-to-end run and capture pass (0: as many as fit --measure-s)")  # fmt: skip
    p.add_argument("--capture-passes", type=int, default=3,
                   help="with graphs on: unmeasured passes over a layout's episodes before its runs, until one\n"
                        "captures no new shape (at most this many)")  # fmt: skip
    p.add_argument("--layouts", nargs="+", default=["episode", "per-step"], choices=["episode", "per-step"])
    p.add_argument("--drift", action=argparse.BooleanOptionalAction, default=True, help="bf16 against fp32 logprobs")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prepare", nargs="+", default=["processes", "threads"], choices=["processes", "threads"],
                   help="where the runs prepare their requests (RunOptions.prepare_workers): each layout and\n"
                        "concurrency is run once per choice, the ratios side by side")  # fmt: skip
    p.add_argument("--pack-tokens", type=pack_value, nargs="+", default=[None],
                   help="the most tokens one forward packs (LogprobModel.pack_tokens; 0: one sequence a\n"
                        "forward; 'default': the library's GPU default, the default): each run once per value")  # fmt: skip
    p.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="CUDA graphs of the forwards (LogprobModel.cuda_graphs; the library's default: on): each\n"
                        "run once per choice, after one pass that captures the layout's shapes")  # fmt: skip
    args = p.parse_args()
    if args.size == "tiny":
        args.episodes = min(args.episodes, 2)
        args.per_step_episodes = min(args.per_step_episodes, 1)
        # 15-step episodes: the per-step layout's resends grow as the square of the steps
        args.steps_per_subtask = min(args.steps_per_subtask, 1)
        args.measure_s = min(args.measure_s, 1.0)
        args.concurrency = [max(c for c in args.concurrency if c <= 2)] if min(args.concurrency) <= 2 else [1]
        args.budget_s = max(args.budget_s, 1800.0)  # a shared CPU: no skipping, the test checks every key
    args.tokenizer = resolve_tokenizer(p, args.tokenizer)
    return args


def pack_value(text: str) -> int | None:
    """``--pack-tokens``: a number of tokens, or ``default`` (None: the library's GPU default)."""
    return None if text == "default" else int(text)


# --- the model ---------------------------------------------------------------------------------


def timed(fn: Any, device: Any, *, min_reps: int, max_s: float) -> float:
    """Median seconds of ``fn()`` after one warm-up, at least ``min_reps`` runs or ``max_s``."""
    fn()
    sync(device)
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - begin < max_s and len(times) < 20):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
        if time.perf_counter() - begin > max_s and len(times) >= 2:
            break
    return statistics.median(times)


def spans_of(length: int, share: float, every: int = 40) -> list[tuple[int, int]]:
    """Spans over ``share`` of the positions in [1, length): the last ``share x every``
    positions of every ``every`` (as the actions of an episode lie through it)."""
    span = max(1, int(every * share))
    return [(max(1, s - span), s) for s in range(every, length + 1, every)]


def body_flops(config: Any, tokens: int) -> float:
    """The decoder body's forward FLOPs over one causal sequence: 2 per weight per token (no
    embedding, no head) plus the causal attention products."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return 2.0 * layers * per_layer * tokens + 2.0 * layers * q * tokens * tokens


def measure_floor(model: Any, device: Any, lengths: list[int], vocab: int, max_s: float) -> dict[str, Any]:
    import torch

    from hcapo_store.scoring.forward import LogprobModel

    scorer = LogprobModel("bench", loaded=model)
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    for length in lengths:
        ids = torch.randint(0, vocab, (length,), generator=gen)
        on_device = ids.to(device)[None]
        spans = spans_of(length, SCORED_SHARE)

        def body(on_device: Any = on_device) -> None:
            with torch.inference_mode():
                model.model(input_ids=on_device, use_cache=False)

        reps = (3 if length < 16384 else 2) if device.type == "cuda" else 1
        try:
            seconds = timed(body, device, min_reps=reps, max_s=max_s)
            id_list = ids.tolist()
            spans_s = timed(lambda i=id_list, s=spans: scorer.score_spans(i, s), device, min_reps=reps, max_s=max_s)
        except Exception as exc:  # e.g. out of memory at 32k: the other lengths still count
            out[str(length)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            continue
        out[str(length)] = {
            "tokens_per_s": round(length / seconds),
            "seconds": round(seconds, 5),
            "tflops": round(body_flops(model.config, length) / seconds / 1e12, 1),
            "score_spans_over_floor": round(spans_s / seconds, 3),
            "scored_positions": sum(e - s for s, e in spans),
        }
    return out


def floor_seconds(floor: dict[str, Any], tokens: int) -> float:
    """The body's seconds for one sequence of ``tokens``, interpolated in log-log between the
    measured lengths (extrapolated from the nearest two outside them)."""
    points = sorted((int(k), v["seconds"]) for k, v in floor.items() if "seconds" in v)
    if not points:
        raise ValueError("no floor was measured")
    if len(points) == 1:
        return points[0][1] * tokens / points[0][0]
    i = 0
    while i < len(points) - 2 and tokens > points[i + 1][0]:
        i += 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    slope = (math.log(y1) - math.log(y0)) / (math.log(x1) - math.log(x0))
    return y0 * math.exp(slope * (math.log(max(tokens, 1)) - math.log(x0)))


def measure_drift(model: Any, device: Any, length: int, vocab: int) -> dict[str, Any]:
    """The same weights scored in bf16 and in fp32 (the model is turned to fp32 in place)."""
    import torch

    from hcapo_store.scoring.forward import LogprobModel

    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(2)).tolist()
    spans = spans_of(length, SCORED_SHARE)
    bf16 = [v for s in LogprobModel("bench", loaded=model).score_spans(ids, spans) for v in s]
    model.float()
    fp32 = [v for s in LogprobModel("bench", loaded=model).score_spans(ids, spans) for v in s]
    diffs = [abs(a - b) for a, b in zip(bf16, fp32, strict=True)]
    return {
        "tokens": length,
        "scored": len(diffs),
        "mean_abs_nats": round(statistics.fmean(diffs), 5),
        "max_abs_nats": round(max(diffs), 5),
        "mean_logprob_fp32": round(statistics.fmean(fp32), 4),
    }


# --- the episodes and the scoring path ------------------------------------------------------------


class Episodes:
    """The synthetic episodes, ingested once into a store every run scores into (each run under a
    scorer of its own: its own weight version)."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        from hcapo_store.devkit.synth import EpisodeBuilder
        from hcapo_store.ingestion.pipeline import ingest
        from hcapo_store.storage import db
        from hcapo_store.storage.store import Store

        started = time.perf_counter()
        count = max(args.episodes, args.per_step_episodes)
        paths = [
            EpisodeBuilder(seed=i, episode_id=i, reward=round(0.1 + 0.8 * (i % 7) / 6, 3))
            .standard(steps_per_subtask=args.steps_per_subtask)
            .write(work / "episodes" / f"episode_{i:03d}")
            for i in range(1, count + 1)
        ]
        self.store = Store.open(str(work / "bench.db"))
        report = ingest(self.store, paths, jobs=1)
        if report.failed:
            raise SystemExit(f"{report.failed} synthetic episode(s) failed to ingest")
        from sqlalchemy import text

        with db.read(self.store.engine) as conn:
            self.ids = [str(r[0]) for r in conn.execute(text("SELECT id FROM episodes ORDER BY id"))]
            self.steps = int(conn.execute(text("SELECT COUNT(*) FROM steps")).scalar_one()) // len(self.ids)
        self.tokenizer = args.tokenizer
        self.ingest_s = time.perf_counter() - started

    def describe(self) -> dict[str, Any]:
        return {"count": len(self.ids), "steps_each": self.steps, "ingest_s": round(self.ingest_s, 2)}


def score_run(
    model: Any,
    episodes: Episodes,
    ids: list[str],
    *,
    layout: str,
    concurrency: int,
    version: str,
    hook: Any = None,
    prepare: str | None = None,
    graphs: bool | None = None,
    pack_tokens: int | None = None,
) -> dict:
    """``prepare`` + ``run_scoring`` with the live backend over ``ids``; the forwards timed with
    CUDA events (LogprobModel.timings). ``hook``: called with the run's LogprobModel once it is
    made, before its first forward (bench/gpu_gaps.py wraps its forwards). ``prepare``:
    ``processes`` (``defaults.PREPARE_PROCESSES`` workers) or ``threads``; None: the library's
    default for the device (RunOptions.prepare_workers). ``graphs``: CUDA graphs on or off (None:
    the library's default); the run's captures, replays and checks are in its ``graphs``.
    ``pack_tokens``: the most tokens one forward packs (0: one sequence a forward; None: the
    library's GPU default, on the CPU too)."""
    from hcapo_store.rendering import verify
    from hcapo_store.scoring import defaults
    from hcapo_store.scoring import graphs as cuda_graphs
    from hcapo_store.scoring.backends.inprocess import LiveModelBackend
    from hcapo_store.scoring.job import ScoreConfig, run_scoring
    from hcapo_store.scoring.job import prepare as prepare_scorer
    from hcapo_store.scoring.scheduler import RunOptions
    from hcapo_store.scoring.scorer import floor_accounting
    from hcapo_store.scoring.work_queue import Filters
    from hcapo_store.storage import db

    timings: list[Any] = []  # LogprobModel.timings: a ForwardTiming per forward

    class Timed(LiveModelBackend):
        async def start(self) -> None:
            await super().start()
            self.scorer.timings = timings
            # as on a GPU, on the CPU too (tiny)
            self.scorer.pack_tokens = defaults.PACK_TOKENS if pack_tokens is None else pack_tokens
            if graphs is not None:
                self.scorer.cuda_graphs = graphs
            if hook is not None:
                hook(self.scorer)

    backend = Timed(model, weight_version=version, name="bench")
    cfg = ScoreConfig(
        backend=LiveModelBackend.kind, tokenizer=episodes.tokenizer, prompt_layout=layout, weight_version=version
    )  # type: ignore[arg-type]
    state = cuda_graphs.graphs_of(model, next(model.parameters()).device) if torch_cuda(model) else None
    stats_before = state.stats.as_dict() if state is not None else {}
    fallbacks_before = verify.fallbacks()
    t0 = time.perf_counter()
    prep = prepare_scorer(episodes.store, cfg, backend)
    t1 = time.perf_counter()
    workers = None if prepare is None else defaults.PREPARE_PROCESSES if prepare == "processes" else 0
    options = RunOptions(concurrency=concurrency, filters=Filters(episodes=tuple(ids)), prepare_workers=workers)
    report = run_scoring(episodes.store, prep, options)
    wall = time.perf_counter() - t1
    with db.read(episodes.store.engine) as conn:
        floor = floor_accounting(conn, prep.scorer_id)
    if timings and not isinstance(timings[0].started, float):  # CUDA events: all recorded before reading
        import torch

        torch.cuda.synchronize()
    spans = [elapsed_ms(t) / 1000.0 for t in timings]
    busy = sum(spans) if timings else None
    replays = [i for i, t in enumerate(timings) if t.how == "replay"]
    graph_row: dict[str, Any] = {"off": cuda_graphs.off(), "fallbacks": verify.since(fallbacks_before)}
    if state is not None:
        after = state.stats.as_dict()
        graph_row.update(
            {k: after[k] - stats_before.get(k, 0) for k in ("captured", "replayed", "checked", "borrowed")}
        )
        graph_row["max_abs_diff"] = after["max_abs_diff"]
        graph_row["shapes"] = len(state.graphs)
    return {
        "graphs": graph_row,
        "prepare_s": round(t1 - t0, 3),
        "wall_s": round(wall, 3),
        "episodes": len(ids),
        "steps": report.scored,
        "failed": report.failed,
        "forwards": len(timings),
        "forward_kinds": {how: sum(t.how == how for t in timings) for how in sorted({t.how for t in timings})},
        "packed_forwards": sum(len(t.lengths) > 1 for t in timings),
        "sequence_tokens": [n for t in timings for n in t.lengths],
        "replay_s": sum(spans[i] for i in replays),  # the replayed forwards alone: the steady state's
        "replay_sequence_tokens": [n for i in replays for n in timings[i].lengths],
        "sent_tokens": report.prompt_tokens,
        "conversation_tokens": floor["conversation_tokens"],
        "busy_s": busy,
        "prepare": prepare
        or ("processes" if workers is None and prep.backend.computes_in()["device"] == "cuda" else "threads"),
    }


def torch_cuda(model: Any) -> bool:
    return next(model.parameters()).device.type == "cuda"


def path_row(run: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    wall, steps = run["wall_s"], max(run["steps"], 1)
    row = {k: v for k, v in run.items() if k not in ("sequence_tokens", "replay_sequence_tokens", "replay_s")}
    from hcapo_store.rendering import verify

    kinds = run.get("forward_kinds") or {}
    if kinds.get("replay") or kinds.get("check"):  # a window's checks against its replays at the policy's rate
        replays = kinds.get("replay", 0) + kinds.get("check", 0)
        row["checks_at_policy_rate"] = round(replays / verify.CUDA_GRAPHS.every, 2)
    row["conversation_tokens_per_s"] = round(run["conversation_tokens"] / wall)
    row["sent_tokens_per_s"] = round(run["sent_tokens"] / wall)
    try:
        floor_s = sum(floor_seconds(floor, n) for n in run["sequence_tokens"])  # each sequence on its own
        row["floor_s"] = round(floor_s, 3)
        row["share_of_floor"] = round(floor_s / wall, 3)
        if run["replay_sequence_tokens"]:  # the replayed forwards' time over the body's for their sequences
            replay_floor = sum(floor_seconds(floor, n) for n in run["replay_sequence_tokens"])
            row["replay_over_floor"] = round(run["replay_s"] / replay_floor, 3)
    except ValueError as exc:  # no floor point was measured: the run's own figures still count
        row["share_of_floor"] = None
        row["floor_error"] = str(exc)
    if run["busy_s"] is not None:
        row["gpu_busy_share"] = round(run["busy_s"] / wall, 3)
        if row.get("floor_s"):  # the forwards' own time over the body's: captures and checks show here
            row["busy_over_floor"] = round(run["busy_s"] / row["floor_s"], 3)
        row["gpu_idle_ms_per_step"] = round((wall - run["busy_s"]) / steps * 1000, 3)
        row["busy_s"] = round(run["busy_s"], 3)
    row["wall_ms_per_step"] = round(wall / steps * 1000, 3)
    return row


def measure_shape(
    shape: str, args: argparse.Namespace, device: Any, episodes: Episodes, result: dict, until: float, flush: Any
) -> None:
    import torch

    from hcapo_store.rendering.tokenizers import load_tokenizer

    tiny = shape == "tiny"
    vocab = VOCAB if not tiny else -(-len(load_tokenizer(episodes.tokenizer)) // 64) * 64
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    model = build_model(shape, max(vocab, len(load_tokenizer(episodes.tokenizer))), device)
    sync(device)
    result["build_s"] = round(time.perf_counter() - t, 2)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    flush("built")
    lengths = [128, 256, 512] if tiny else [2048, 8192, 32768]
    result["floor"] = floor = measure_floor(model, device, lengths, vocab, max_s=0.0 if tiny else 1.5)
    flush("floor")

    # warm-up: the first forwards of a run pay for kernels and caches (2.1 s on the 8B)
    # (in processes when they are measured: their pool starts here and is kept for the runs)
    warm = score_run(
        model, episodes, episodes.ids[:1], layout="episode", concurrency=1, version=f"{shape}-warm",
        prepare=args.prepare[0],
    )  # fmt: skip
    per_episode = warm["sent_tokens"] / max(warm["episodes"], 1)
    result["warmup"] = {"wall_s": warm["wall_s"], "tokens_per_episode": round(per_episode)}
    flush("warm-up")
    paths: dict[str, Any] = {}
    result["paths"] = paths
    drift_reserve = (0.5 if tiny else 12.0) if args.drift else 0.0  # seconds kept for the drift at the end
    # a cautious guess of the path's tokens/s, 0.6 of the floor (measured with graphs on an H200: 0.80-0.94;
    # a cap of 20k tok/s, the eager small shapes' rate, skipped the 0.6B's and 1.7B's runs on 2026-12-04),
    # then 0.7 of what the last run reached (concurrency 4 runs first: the default, the goal)
    rates = [p["tokens_per_s"] for p in floor.values() if "tokens_per_s" in p] or [20000.0]
    guess = 0.6 * len(rates) / sum(1 / r for r in rates)
    result["graph_warm"] = {}
    for layout, most in (("episode", args.episodes), ("per-step", args.per_step_episodes)):
        if layout not in args.layouts:
            continue
        rate = guess
        sent = per_episode * (1.0 if layout == "episode" else 7.3)  # per-step: ~7x the tokens per episode
        combos = [
            (c, p, g, k)
            for c in sorted(args.concurrency, reverse=True)
            for k in args.pack_tokens
            for p in args.prepare
            for g in args.graphs
        ]
        # (concurrency, pack tokens) whose shapes the capture passes have seen: the packing decides them
        warmed: set[tuple[int, int | None]] = set()
        for concurrency, prepare, graphed, pack in combos:
            packing = f"/pack{'default' if pack is None else pack}" if len(args.pack_tokens) > 1 else ""
            key = f"{layout}/c{concurrency}/{prepare}/{'graphs' if graphed == 'on' else 'eager'}{packing}"
            fit = int(args.measure_s * rate / sent)  # episodes in about --measure-s
            n = max(min(most, len(episodes.ids), max(fit, min(concurrency, int(2 * args.measure_s * rate / sent)))), 1)
            if args.run_episodes:
                n = min(args.run_episodes, most, len(episodes.ids))
            expect = n * sent / rate + 1.0
            if graphed == "on" and (concurrency, pack) not in warmed:
                expect *= 1 + min(args.capture_passes, 2)  # a pass that captures, one that confirms, the run
            if time.monotonic() + expect > until - drift_reserve:
                paths[key] = {"skipped": f"would not fit the time left (~{expect:.0f} s)"}
                continue
            version = f"{shape}-{layout}-c{concurrency}-{prepare}-{graphed}-pack{pack}"
            try:
                if graphed == "on" and (concurrency, pack) not in warmed:
                    # capture passes (not measured) at the run's concurrency until one captures nothing
                    passes = []
                    for again in range(args.capture_passes):
                        warm_run = score_run(
                            model, episodes, episodes.ids[:n], layout=layout, concurrency=concurrency,
                            version=f"{version}-capture{again}", prepare=prepare, graphs=True, pack_tokens=pack,
                        )  # fmt: skip
                        passes.append({"wall_s": warm_run["wall_s"], "graphs": warm_run["graphs"]})
                        if not warm_run["graphs"].get("captured"):
                            break
                    result["graph_warm"][f"{layout}/c{concurrency}{packing}"] = {"episodes": n, "passes": passes}
                    warmed.add((concurrency, pack))
                run = score_run(
                    model, episodes, episodes.ids[:n], layout=layout, concurrency=concurrency, version=version,
                    prepare=prepare, graphs=graphed == "on", pack_tokens=pack,
                )  # fmt: skip
                paths[key] = row = path_row(run, floor)
                rate = max(row["sent_tokens_per_s"] * 0.7, 1.0)  # eager runs ~x0.7 the graphed (0.6B)
                sent = run["sent_tokens"] / max(run["episodes"], 1)
            except Exception as exc:
                paths[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            flush(f"{key}: {json.dumps(paths[key])[:200]}")
    # the floor again after the runs, at the middle length: a GPU that slowed under the runs'
    # sustained load (clocks, heat) makes every share above read low by about this ratio
    middle = lengths[len(lengths) // 2]
    again = measure_floor(model, device, [middle], vocab, max_s=0.0 if tiny else 1.5).get(str(middle), {})
    if "tokens_per_s" in again and "tokens_per_s" in floor.get(str(middle), {}):
        result["floor_after"] = {
            "tokens": middle,
            "tokens_per_s": again["tokens_per_s"],
            "over_before": round(again["tokens_per_s"] / floor[str(middle)]["tokens_per_s"], 3),
        }
    result["prepare_compare"] = compare(paths, 2, "processes", "threads")
    result["graphs_compare"] = compare(paths, 3, "graphs", "eager")
    if device.type == "cuda":
        result["peak_gib_bf16"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    try:
        if args.drift:
            result["drift"] = measure_drift(model, device, 256 if tiny else 8192, vocab)
    except Exception as exc:
        result["drift"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compare(paths: dict[str, Any], part: int, a: str, b: str) -> dict[str, Any]:
    """The runs measured both ways (their keys differ only in ``part``, ``a`` against ``b``): the
    share of the floor, GPU-busy share and ms per step each way, and ``a`` over ``b``."""
    out: dict[str, Any] = {}
    for key, row in paths.items():
        parts = key.split("/")
        if parts[part] != a:
            continue
        other = paths.get("/".join(parts[:part] + [b] + parts[part + 1 :]))
        if not other or "share_of_floor" not in row or "share_of_floor" not in other:
            continue
        pair: dict[str, Any] = {a: row.get("share_of_floor"), b: other.get("share_of_floor")}
        if pair[a] and pair[b]:
            pair["ratio"] = round(pair[a] / pair[b], 3)
        for name in ("gpu_busy_share", "wall_ms_per_step"):
            if name in row and name in other:
                pair[name] = [row[name], other[name]]  # [a, b]
        out["/".join(p for i, p in enumerate(parts) if i != part)] = pair
    return out


def summary(doc: dict[str, Any]) -> list[str]:
    lines = []
    for r in doc["shapes"]:
        if "error" in r:
            lines.append(f"{r['shape']}: error {r['error']}")
            continue
        floor = r.get("floor", {})
        head = f"{r['shape']}: floor " + " / ".join(str(v.get("tokens_per_s", "error")) for v in floor.values())
        head += " tok/s"
        if "floor_after" in r:
            head += f" (after the runs x{r['floor_after']['over_before']})"
        parts = [head]
        for key, row in r.get("paths", {}).items():
            if "conversation_tokens_per_s" in row:
                busy = f", busy {row['gpu_busy_share']}" if "gpu_busy_share" in row else ""
                busy += f", forwards x{row['busy_over_floor']} the body's" if "busy_over_floor" in row else ""
                busy += f", replays x{row['replay_over_floor']}" if "replay_over_floor" in row else ""
                kinds = row.get("forward_kinds") or {}
                busy += f", forwards {kinds}" if kinds else ""
                if "checks_at_policy_rate" in row:  # the window's checks against the policy's one in 64
                    busy += f" (checks at the policy's rate: {row['checks_at_policy_rate']})"
                borrowed = (row.get("graphs") or {}).get("borrowed")
                busy += f", borrowed {borrowed}" if borrowed else ""
                parts.append(f"{key} {row['conversation_tokens_per_s']} tok/s ({row['share_of_floor']} of floor{busy})")
            else:
                parts.append(f"{key} {row.get('skipped') or row.get('error')}")
        for run, pair in r.get("prepare_compare", {}).items():
            parts.append(f"{run} processes/threads {pair['processes']}/{pair['threads']} (x{pair.get('ratio')})")
        for run, pair in r.get("graphs_compare", {}).items():
            parts.append(f"{run} graphs/eager {pair['graphs']}/{pair['eager']} (x{pair.get('ratio')})")
        if "mean_abs_nats" in r.get("drift", {}):
            parts.append(f"drift mean {r['drift']['mean_abs_nats']} max {r['drift']['max_abs_nats']}")
        lines.append("; ".join(parts))
    return lines


if __name__ == "__main__":  # ingest may start worker processes that import this module
    from hcapo_store import worker_processes

    # the application names its workers' imports (the library never sets the forkserver's list)
    worker_processes.preload(worker_processes.INGEST, worker_processes.PREPARE)
    main()
