"""Where a scoring forward's time goes inside a run on a GPU (issue 43): kernels or gaps.

    python3 -m pip install -q --no-index --no-deps --target /tmp/hcapo/site-packages .gpu/wheels/*.whl  # GPU
    export PYTHONPATH=/tmp/hcapo/site-packages
    PYTHONUNBUFFERED=1 python3 bench/gpu_gaps.py --out "$OUT/gaps.json"
    python bench/gpu_gaps.py --size tiny --tokenizer DIR --out /tmp/gaps.json  # the CPU check (tests)

bench/gpu.py found each forward's CUDA-event time inside an end-to-end run 1.6-2.3x the decoder
body's time at the same length on the small shapes, while ``score_spans`` alone is within 1.05-1.15
of it. This script tells the causes apart, per shape (default the 0.6B; ``--shapes 0.6b 8b`` adds
the 8B), on one sequence of an episode's length (``L``, ~9.2k Qwen3 tokens, 42 % of its positions
scored as in the episode layout):

* ``alone`` (a): ``LogprobModel.score_spans`` with no event loop beside it, and the decoder body
  alone (``model.model(ids)``), and two sequences packed into one forward: CUDA-event ms (median,
  unprofiled) and, from one torch.profiler capture, the kernels' busy ms (their union), count, and
  the gaps between them by size, and the host's kernel launches (their span beside the kernels':
  alike when the host sets the pace; gaps over 0.5 ms: the launching thread stopped, e.g. waiting
  for the GIL). ``gap_share`` = 1 - kernel busy / event ms: the GPU idle inside the forward.
* ``head`` (d): the LM-head part alone on the sequence's ~3.9k scored rows: the
  ``_target_logprobs`` chunk loop at the configured ``chunk_size`` (512), at 2048, and all rows in
  one chunk, and the head's matrix product alone (its floor).
* ``switch`` (c): ``prepare`` + ``run_scoring`` (live backend, episode layout) at concurrency 4 and
  1, with the interpreter's default switch interval and with ``sys.setswitchinterval(1e-4)`` (set
  in this process for the run only: a diagnosis, not a library setting): share of the floor, GPU
  busy share, per forward the event ms and the model thread's host ms off the CPU (waiting).
* ``in_run`` (b): the same run at concurrency 4 with ``--profile-forwards`` (default the 3rd and
  4th) each captured by torch.profiler in the model thread: kernels' busy ms over the forward's
  event ms, beside the unprofiled forwards of the same run (``gap_share_vs_unprofiled``: kernel
  busy over the unprofiled forwards' median event ms per token, scaled to the profiled one's tokens).

``--traces`` (default on, GPU only) writes each profiled forward's chrome trace beside ``--out``
(``gaps-SHAPE-alone.json.gz``, ``-body``, ``-in-run-N``). Hooks only: each forward is wrapped on
the run's LogprobModel instance (``launch``), nothing of the library changes. Every measurement catches its own error (recorded, the rest still run), the
JSON (``--out``, else ``$OUT/gaps.json``) is rewritten after each, and a progress line with the
elapsed seconds goes to stderr. ``--size tiny`` runs the same code on the CPU in seconds: there
the profiler's top-level CPU ops stand in for kernels and the host clock for CUDA events.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_common as common  # the options, start-up, model and JSON shared with bench/gpu.py
import gpu as base  # bench/gpu.py: the episodes, the end-to-end run, the floor

SCORED_SHARE = 0.42  # of an episode's positions scored in the episode layout (21 of every 50)
SCORED_EVERY = 50
GAP_BUCKETS_US = (5.0, 50.0, 500.0)  # gaps between kernels: <=5 us, 5-50, 50-500, >500 us


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s
    out, device, doc = common.start(args, "gpu_gaps", "gaps.json")
    import torch

    tiny = args.size == "tiny"
    doc["switch_interval_default_s"] = sys.getswitchinterval()
    doc["shapes"] = []

    def flush(what: str) -> None:
        common.save(out, doc)
        print(f"[{time.monotonic() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    flush("start")
    work = Path(tempfile.mkdtemp(prefix="hcapo-gaps-"))
    episodes = base.Episodes(work, args)
    doc["episodes"] = episodes.describe()
    flush("episodes ingested")
    for shape in ["tiny"] if tiny else args.shapes:
        result: dict[str, Any] = {"shape": shape}
        doc["shapes"].append(result)
        try:
            measure_shape(shape, args, device, episodes, result, deadline, lambda what, s=shape: flush(f"{s}: {what}"))
        except Exception as exc:  # the next shape still runs; the error is in the JSON
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()[-4000:]
        result["seconds"] = round(time.monotonic() - started, 1)
        flush(f"{shape}: done")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    doc["seconds"] = round(time.monotonic() - started, 1)
    doc["summary"] = summary(doc)
    common.save(out, doc)
    for line in doc["summary"]:
        print(line, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    common.add_common_args(p, out="gaps.json", budget_s=170.0)
    p.add_argument("--shapes", nargs="+", default=["0.6b"], choices=["0.6b", "1.7b", "8b"], help="default: 0.6b")
    p.add_argument("--episodes", type=int, default=16, help="episodes per end-to-end run (the 8B: half)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each forward alone")
    p.add_argument("--switch-interval", type=float, default=1e-4, help="sys.setswitchinterval of (c), seconds")
    p.add_argument("--profile-forwards", type=int, nargs="+", default=[2, 3], help="forwards of (b) profiled, from 0")
    p.add_argument("--traces", action=argparse.BooleanOptionalAction, default=True,
                   help="chrome traces (.json.gz) of the profiled forwards beside --out")  # fmt: skip
    args = p.parse_args()
    args.per_step_episodes = 0  # base.Episodes' field: this script runs the episode layout only
    if args.size == "tiny":
        args.episodes = min(args.episodes, 2)
        args.budget_s = max(args.budget_s, 900.0)  # a shared CPU: no skipping, the test checks every key
        args.steps_per_subtask = min(args.steps_per_subtask, 1)
        args.reps = min(args.reps, 2)
        args.profile_forwards = [0]  # tiny episodes may share a forward: the first one exists
    args.tokenizer = common.resolve_tokenizer(p, args.tokenizer)
    return args


# --- measuring a region -----------------------------------------------------------------------


def event_times(fn: Callable[[], Any], device: Any, reps: int) -> list[float]:
    """Milliseconds of ``fn()`` between CUDA events recorded around it (host clock on a CPU),
    after one warm-up call."""
    import torch

    fn()
    common.sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1000.0)
    return times


@contextlib.contextmanager
def profiling(device: Any) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield prof
        common.sync(device)


def activity(prof: Any, device: Any, trace: Path | None = None) -> dict[str, Any]:
    """The device work of a profiler capture: kernels (and copies, memsets) on a GPU, the top-level
    CPU ops on a CPU. ``busy_ms``: the union of their intervals; ``span_ms``: first start to last
    end; the gaps between them by size; the heaviest kernels and the CUDA runtime calls; the host's
    kernel launches: their span (beside the kernels' span: launch-bound when alike) and the long
    gaps between them (the launching thread stopped: a GIL wait, a synchronisation)."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if not getattr(e, "is_user_annotation", False)]
    if device.type == "cuda":
        work = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        work = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None and not e.is_async]
    spans = sorted((e.time_range.start, e.time_range.end) for e in work)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    buckets: dict[str, list[float]] = {}
    edges = (0.0, *GAP_BUCKETS_US, float("inf"))
    for low, high in zip(edges, edges[1:]):
        inside = [g for g in gaps if low < g <= high]
        name = f"le_{high:g}us" if low == 0 else (f"gt_{low:g}us" if high == float("inf") else f"{low:g}_{high:g}us")
        buckets[name] = [len(inside), round(sum(inside) / 1000, 3)]  # [count, ms]
    busy = sum(end - start for start, end in merged)
    span = (merged[-1][1] - merged[0][0]) if merged else 0.0
    by_name: dict[str, list[float]] = {}
    for e in work:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    runtime: dict[str, list[float]] = {}
    for e in events:  # CUDA runtime and driver API calls, any thread
        if e.device_type == DeviceType.CPU and e.name.startswith("cu"):
            entry = runtime.setdefault(e.name, [0, 0.0, 0.0])
            took = e.time_range.end - e.time_range.start
            entry[0] += 1
            entry[1] += took
            entry[2] = max(entry[2], took)
    # the host's pace: kernel launches (any thread) and the gaps between them (a GIL wait shows as ms)
    launches = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith(("cudaLaunch", "cuLaunch"))
    )
    launch_gaps = [b[0] - a[1] for a, b in zip(launches, launches[1:])]
    long_gaps = [g for g in launch_gaps if g > GAP_BUCKETS_US[-1]]
    out: dict[str, Any] = {
        "launches": len(launches),
        "launch_span_ms": round((launches[-1][1] - launches[0][0]) / 1000, 3) if launches else None,
        "launch_gaps_gt_500us": [len(long_gaps), round(sum(long_gaps) / 1000, 3)],  # [count, ms]
        "launch_max_gap_ms": round(max(launch_gaps, default=0.0) / 1000, 3),
        "kernels": len(work),
        "kernel_sum_ms": round(sum(e.time_range.end - e.time_range.start for e in work) / 1000, 3),
        "busy_ms": round(busy / 1000, 3),
        "span_ms": round(span / 1000, 3),
        "gap_ms": round((span - busy) / 1000, 3),
        "max_gap_ms": round(max(gaps, default=0.0) / 1000, 3),
        "gaps": buckets,
        "top": [
            [name, n, round(us / 1000, 3)] for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]
        ],
        "runtime": {
            name: [n, round(us / 1000, 3), round(peak / 1000, 3)]
            for name, (n, us, peak) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:8]
        },  # [calls, ms, longest ms]
    }
    if trace is not None:
        try:
            prof.export_chrome_trace(str(trace))
            out["trace"] = trace.name
        except Exception as exc:
            out["trace_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


class Probe:
    """Wraps a LogprobModel's ``launch`` on the instance (the library is untouched; each launched
    forward waited for here, so none runs ahead of the next under the probe): per forward its
    sequence lengths, the host's wall ms and the calling thread's CPU ms (wall - CPU: the model
    thread waiting, for the GIL or a lock), and for the forwards whose index is in ``profile_at`` a
    torch.profiler capture of that forward alone (``activity``)."""

    def __init__(self, scorer: Any, device: Any, profile_at: set[int] = frozenset(), trace: Any = None) -> None:
        self.scorer, self.device = scorer, device
        self.profile_at = set(profile_at)
        self.trace = trace  # index -> Path | None
        self.rows: list[dict[str, Any]] = []
        self.slots: list[int] = []  # each row's index in scorer.timings (one entry per forward)
        self.inner = scorer.launch
        scorer.launch = self
        if scorer.timings is None:
            scorer.timings = []

    def __call__(self, batch: Any) -> Any:
        index = len(self.rows)
        row: dict[str, Any] = {"lengths": [r.length for r in batch], "scored": sum(len(r.rows) for r in batch)}
        stack, prof = contextlib.ExitStack(), None
        if index in self.profile_at:
            try:  # a profiler that will not start must not fail the forward
                prof = stack.enter_context(profiling(self.device))
            except Exception as exc:
                row["profile_error"] = f"{type(exc).__name__}: {exc}"[:500]
        slot = len(self.scorer.timings)
        try:
            with stack:
                wall, cpu = time.perf_counter(), time.thread_time()
                out = self.inner(batch)
                common.sync(self.device)
                row["wall_ms"] = round((time.perf_counter() - wall) * 1000, 3)
                row["cpu_ms"] = round((time.thread_time() - cpu) * 1000, 3)
        except Exception as exc:
            if "wall_ms" not in row:  # the forward itself failed: the run hears of it
                raise
            row["profile_error"] = f"{type(exc).__name__}: {exc}"[:500]
            prof = None
        if prof is not None:
            try:
                row["profile"] = activity(prof, self.device, self.trace(index) if self.trace else None)
            except Exception as exc:
                row["profile_error"] = f"{type(exc).__name__}: {exc}"[:500]
        self.rows.append(row)
        self.slots.append(slot)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The rows with each forward's event ms (LogprobModel.timings, one per forward)."""
        common.sync(self.device)
        timings = self.scorer.timings
        for row, slot in zip(self.rows, self.slots):
            row["event_ms"] = round(common.elapsed_ms(timings[slot]), 3)
            row["off_cpu_ms"] = round(row["wall_ms"] - row["cpu_ms"], 3)
        return self.rows


def gap_share(busy_ms: float, event_ms: float) -> float:
    return round(1.0 - busy_ms / event_ms, 3) if event_ms > 0 else float("nan")


# --- the measurements ---------------------------------------------------------------------------


def measure_shape(
    shape: str, args: argparse.Namespace, device: Any, episodes: Any, result: dict, deadline: float, flush: Any
) -> None:
    import torch

    from hcapo_store.rendering.tokenizers import load_tokenizer
    from hcapo_store.scoring import defaults
    from hcapo_store.scoring.forward import LogprobModel

    tiny = shape == "tiny"
    vocab = common.VOCAB if not tiny else -(-len(load_tokenizer(episodes.tokenizer)) // 64) * 64
    t = time.perf_counter()
    model = common.build_model(shape, max(vocab, len(load_tokenizer(episodes.tokenizer))), device)
    common.sync(device)
    result["build_s"] = round(time.perf_counter() - t, 2)
    flush("built")
    n_run = args.episodes if shape != "8b" else max(2, args.episodes // 2)
    ids = episodes.ids[: min(n_run, len(episodes.ids))]
    out_dir = Path(args.out or Path(os.environ.get("OUT", ".")) / "gaps.json").parent

    def trace_path(name: str) -> Path | None:
        return out_dir / f"gaps-{shape}-{name}.json.gz" if args.traces and not tiny else None

    def step(key: str, fn: Callable[[], Any], need_s: float) -> Any:
        """One measurement: skipped when it would not fit, its error recorded, the JSON saved."""
        if time.monotonic() + need_s > deadline:
            result[key] = {"skipped": f"would not fit the time left (~{need_s:.0f} s)"}
        else:
            try:
                result[key] = fn()
            except Exception as exc:
                result[key] = {
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "traceback": traceback.format_exc()[-3000:],
                }
        flush(f"{key}: {json.dumps(result[key])[:200]}")
        return result[key]

    # warm-up (kernels, caches) and the episodes' length
    warm = base.score_run(model, episodes, ids[:1], layout="episode", concurrency=1, version=f"{shape}-warm")
    length = round(warm["sent_tokens"] / max(warm["episodes"], 1))
    if tiny:  # the CPU's LM head over the real vocabulary is slow: a short sequence checks the same code
        length = min(length, 200)
    result["warmup"] = {"wall_s": warm["wall_s"], "tokens_per_episode": length}
    flush("warm-up")
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(2)]
    spans = base.spans_of(length, SCORED_SHARE, every=SCORED_EVERY)
    result["sequence"] = {"tokens": length, "scored_rows": sum(e - s for s, e in spans)}
    big = shape == "8b"

    # the floor at the episodes' own length and twice it (a packed pair): what share_of_floor divides by
    floor = step(
        "floor",
        lambda: base.measure_floor(model, device, [length, 2 * length], vocab, 0.0 if tiny else 1.0),
        20 if big else 6,
    )
    floor = floor if isinstance(floor, dict) and "error" not in floor and "skipped" not in floor else {}

    def alone() -> dict[str, Any]:
        with profiling(device):  # the profiler's own first start (CUPTI) stays out of the forwards
            torch.ones(8, device=device).add_(1)
        scorer = LogprobModel("bench", loaded=model, pack_tokens=defaults.PACK_TOKENS)
        probe = Probe(scorer, device)
        for _ in range(1 + args.reps):  # the first: warm-up
            scorer.score_spans(tokens[0], spans)
        probe.profile_at = {len(probe.rows)}
        probe.trace = lambda i: trace_path("alone")
        scorer.score_spans(tokens[0], spans)
        scorer.score_spans_many([(tokens[0], spans), (tokens[1], spans)])  # warm-up of the packed shape
        for _ in range(max(2, args.reps // 2)):
            scorer.score_spans_many([(tokens[0], spans), (tokens[1], spans)])
        probe.profile_at = {len(probe.rows)}
        probe.trace = None
        scorer.score_spans_many([(tokens[0], spans), (tokens[1], spans)])
        rows = probe.finish()
        single = [r for r in rows[1 : 1 + args.reps]]
        packed = [r for r in rows[3 + args.reps : -1]]
        one = torch.tensor(tokens[0], device=device)[None]

        def body() -> None:
            with torch.inference_mode():
                model.model(input_ids=one, use_cache=False)

        body_ms = event_times(body, device, args.reps)
        with profiling(device) as prof:
            body()
        body_act = activity(prof, device, trace_path("body"))
        spans_ms = statistics.median(r["event_ms"] for r in single)
        spans_act = rows[1 + args.reps].get("profile", {})
        packed_ms = statistics.median(r["event_ms"] for r in packed)
        packed_act = rows[-1].get("profile", {})
        return {
            "score_spans": {
                "event_ms": round(spans_ms, 3),
                "event_ms_all": [r["event_ms"] for r in single],
                "host_wall_ms": statistics.median(r["wall_ms"] for r in single),
                "host_off_cpu_ms": statistics.median(r["off_cpu_ms"] for r in single),
                "gap_share": gap_share(spans_act.get("busy_ms", float("nan")), spans_ms),
                "profiled": spans_act,
                "profiled_event_ms": rows[1 + args.reps]["event_ms"],
                "profiled_event_minus_span_ms": round(
                    rows[1 + args.reps]["event_ms"] - spans_act.get("span_ms", float("nan")), 3
                ),
            },
            "body": {
                "event_ms": round(statistics.median(body_ms), 3),
                "event_ms_all": [round(x, 3) for x in body_ms],
                "gap_share": gap_share(body_act["busy_ms"], statistics.median(body_ms)),
                "profiled": body_act,
            },
            "packed2": {
                "event_ms": round(packed_ms, 3),
                "gap_share": gap_share(packed_act.get("busy_ms", float("nan")), packed_ms),
                "profiled": packed_act,
            },
            "score_spans_over_body": round(spans_ms / statistics.median(body_ms), 3),
            "kernel_busy_spans_over_body": round(spans_act.get("busy_ms", float("nan")) / body_act["busy_ms"], 3),
        }

    step("alone", alone, 15 if big else 8)

    def head() -> dict[str, Any]:
        scorer = LogprobModel("bench", loaded=model)
        request = scorer.prepare(tokens[0], spans)
        with torch.inference_mode():
            ids_on = request.tokens.to(device)
            hidden = model.model(input_ids=ids_on[None], use_cache=False).last_hidden_state[0]
            rows = request.rows.to(device)

            def loop(size: int) -> Callable[[], list[float]]:
                def run() -> list[float]:
                    with torch.inference_mode():
                        picked = [scorer._target_logprobs(hidden[c], ids_on[c + 1]) for c in rows.split(size)]
                        return torch.cat(picked).tolist()

                return run

            def matmul() -> None:
                with torch.inference_mode():
                    scorer._head(hidden[rows])

            out: dict[str, Any] = {"rows": len(rows), "chunk_size": scorer.chunk_size}
            sizes = [scorer.chunk_size, 2048, len(rows)]
            reference = loop(len(rows))()
            for size in dict.fromkeys(sizes):
                fn = loop(size)
                ms = event_times(fn, device, args.reps)
                with profiling(device) as prof:
                    fn()
                act = activity(prof, device)
                diff = max((abs(a - b) for a, b in zip(fn(), reference)), default=0.0)
                out[f"chunk_{size}"] = {
                    "event_ms": round(statistics.median(ms), 3),
                    "kernels": act["kernels"],
                    "busy_ms": act["busy_ms"],
                    "gap_share": gap_share(act["busy_ms"], statistics.median(ms)),
                    "max_abs_diff_vs_one_chunk": diff,
                }
            out["head_matmul_ms"] = round(statistics.median(event_times(matmul, device, args.reps)), 3)
        return out

    step("head", head, 8 if big else 4)

    def run(concurrency: int, interval: float | None, profile_at: set[int] = frozenset()) -> dict[str, Any]:
        probes: list[Probe] = []

        def hook(scorer: Any) -> None:
            probes.append(Probe(scorer, device, profile_at, lambda i: trace_path(f"in-run-{i}")))

        before = memory_counters(device)
        default = sys.getswitchinterval()
        if interval is not None:
            sys.setswitchinterval(interval)
        try:
            version = (
                f"{shape}-c{concurrency}-{'switch' if interval else 'default'}-{'profiled' if profile_at else 'plain'}"
            )
            done = base.score_run(
                model, episodes, ids, layout="episode", concurrency=concurrency, version=version, hook=hook
            )
        finally:
            sys.setswitchinterval(default)
        row = base.path_row(done, floor) if floor else {k: v for k, v in done.items() if k != "sequence_tokens"}
        forwards = [f for probe in probes for f in probe.finish()]  # prepare starts the backend too
        after = memory_counters(device)
        row["switch_interval_s"] = interval if interval is not None else default
        row["memory_counters_delta"] = {k: after[k] - before.get(k, 0) for k in after}
        plain = [f for f in forwards if "profile" not in f]
        if plain:
            row["forward_event_ms_median"] = statistics.median(f["event_ms"] for f in plain)
            row["forward_off_cpu_ms_median"] = statistics.median(f["off_cpu_ms"] for f in plain)
            per_token = statistics.median(f["event_ms"] / sum(f["lengths"]) for f in plain)
            if floor:
                row["forward_event_over_floor"] = round(
                    sum(f["event_ms"] for f in plain)
                    / (1000 * sum(base.floor_seconds(floor, n) for f in plain for n in f["lengths"])),
                    3,
                )
        for f in forwards:
            prof = f.get("profile")
            if prof and "event_ms" in f:
                f["gap_share"] = gap_share(prof["busy_ms"], f["event_ms"])
                f["event_minus_span_ms"] = round(
                    f["event_ms"] - prof["span_ms"], 3
                )  # before the first kernel, after the last
                if plain:
                    f["gap_share_vs_unprofiled"] = gap_share(prof["busy_ms"], per_token * sum(f["lengths"]))
        row["forwards_detail"] = forwards
        return row

    seconds = 12 if big else 5  # one end-to-end run, prepare included
    switch: dict[str, Any] = {}
    result["switch"] = switch
    for concurrency in (4,) if tiny else (4, 1):  # tiny: the same code, once
        for label, interval in (("default", None), ("switch", args.switch_interval)):
            key = f"c{concurrency}/{label}"
            if time.monotonic() + seconds > deadline:
                switch[key] = {"skipped": f"would not fit the time left (~{seconds} s)"}
                continue
            try:
                switch[key] = run(concurrency, interval)
            except Exception as exc:
                switch[key] = {
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "traceback": traceback.format_exc()[-3000:],
                }
            flush(
                f"switch {key}: {json.dumps({k: switch[key].get(k) for k in ('share_of_floor', 'gpu_busy_share', 'forward_event_over_floor', 'forward_off_cpu_ms_median', 'error')})}"
            )

    step("in_run", lambda: run(4, None, set(args.profile_forwards)), seconds + 6)
    if device.type == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)


def memory_counters(device: Any) -> dict[str, int]:
    """The CUDA caching allocator's device and host (pinned) allocation counters: a rise during a run
    is allocator churn (cudaMalloc / cudaFree / cudaHostAlloc in the run)."""
    import torch

    if device.type != "cuda":
        return {}
    stats = dict(torch.cuda.memory_stats())
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    out = {k: int(stats[k]) for k in keys if k in stats}
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        with contextlib.suppress(Exception):
            h = dict(host())
            out.update({f"host_{k}": int(h[k]) for k in ("num_host_alloc", "num_host_free") if k in h})
    return out


def summary(doc: dict[str, Any]) -> list[str]:
    lines = []
    for r in doc["shapes"]:
        if "error" in r:
            lines.append(f"{r['shape']}: error {r['error']}")
            continue
        parts = [f"{r['shape']} (L={r.get('sequence', {}).get('tokens')})"]
        a = r.get("alone", {})
        if "score_spans" in a:
            s, b = a["score_spans"], a["body"]
            parts.append(
                f"alone: spans {s['event_ms']} ms (gap {s['gap_share']}, launches over"
                f" {s['profiled'].get('launch_span_ms')} ms, kernels over {s['profiled'].get('span_ms')} ms),"
                f" body {b['event_ms']} ms (gap {b['gap_share']}),"
                f" packed2 {a['packed2']['event_ms']} ms (gap {a['packed2']['gap_share']})"
            )
        h = r.get("head", {})
        if "head_matmul_ms" in h:
            chunks = ", ".join(f"{k} {v['event_ms']} ms/{v['kernels']}k" for k, v in h.items() if isinstance(v, dict))
            parts.append(f"head: {chunks}, matmul {h['head_matmul_ms']} ms")
        for key, row in r.get("switch", {}).items():
            if "gpu_busy_share" in row:
                parts.append(
                    f"{key}: floor {row.get('share_of_floor')} busy {row['gpu_busy_share']}"
                    f" fwd/floor {row.get('forward_event_over_floor')} off-cpu {row.get('forward_off_cpu_ms_median')} ms"
                )
            else:
                parts.append(f"{key}: {row.get('skipped') or row.get('error')}")
        run = r.get("in_run", {})
        for f in run.get("forwards_detail", []):
            if "gap_share" in f:
                parts.append(
                    f"in-run fwd {f['lengths']}: {f['event_ms']} ms, kernels {f['profile']['busy_ms']} ms,"
                    f" gap {f['gap_share']} (vs unprofiled {f.get('gap_share_vs_unprofiled')}),"
                    f" launch gaps >0.5 ms {f['profile']['launch_gaps_gt_500us']}, kernel gaps {f['profile']['gaps']}"
                )
        lines.append("; ".join(parts))
    return lines


if __name__ == "__main__":  # ingest may start worker processes that import this module
    main()
