"""A forward's whole GPU work (decoder body, LM head, each target's pick) replayed as one CUDA
graph per shape bucket: one launch instead of thousands.

Why: the small policies' forwards are launch-bound (a 0.6B forward of 9k tokens is ~70 ms of
kernels and 40-65 ms of the host's launches), and the launching thread shares the GIL with the
event loop and the preparing threads, so inside a scoring run the GPU waited, mid-forward, for
the next kernel (BENCHMARKS.md, issue 43: ×1.2 the body's time on the 8B, ×2 on the 0.6B).

A strategy beside the plain rule, the model's own eager forward (its own causal mask) on the
same right-padded inputs, and checked against it at run time:

* a shape's first forward is the plain eager one (its values are the answer), then the graph is
  captured and replayed on the same inputs, and the two must agree;
* the first replays on new inputs, then a sample (``verify.CUDA_GRAPHS``: the strategy frame
  every fast path shares), run the plain forward too: its values are the answer;
* a disagreement or a capture that fails turns the graphs off for the process (counted and logged
  once, as every strategy's fallback); parameters that moved (a live policy whose tensors were
  replaced, not updated in place) drop the model's graphs, captured again on the new ones.

Padding: a sequence is right-padded to its width's bucket (a causal model's real positions never
see the positions after them; tests/test_cuda_graphs.py holds padded equal to unpadded), its
scored rows to theirs. A shape without a graph of its own replays the smallest captured one that
holds it with little more padding (``larger_graph``: real episodes' lengths spread over many
buckets, and each new bucket would otherwise cost an eager forward and a capture). Graphs share
one memory pool per model, so the pool holds the largest forward's activations while the model
lives (``release(model)`` frees it)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from hcapo_store.rendering import verify

MAX_GRAPHS = 64  # shapes captured per model; further shapes run eager
CAPTURE_AT = 2  # a shape is captured at its second forward: one seen once runs eager, unpadded
# A sequence is padded to a multiple of 1/128 of its power of two (at least 64 tokens: <= 0.8 %
# padding, ~0.35 % on 9.2k-token episodes); its scored rows, which cost only the LM head, more coarsely.
WIDTH_PARTS, WIDTH_FLOOR = 128, 64
ROWS_PARTS, ROWS_FLOOR = 16, 256
# a shape without its own graph replays a captured one of as many sequences and the same chunk that
# is at most 1/BORROW_WIDTH_PARTS wider and has at most 1/BORROW_ROWS_PARTS more scored rows (or
# ROWS_FLOOR): padding the body costs in proportion, rows only the LM head's share
BORROW_WIDTH_PARTS, BORROW_ROWS_PARTS = 32, 4
TOLERANCE = {torch.float32: 1e-4}  # nats; low precision: DEFAULT_TOLERANCE
DEFAULT_TOLERANCE = 0.05


def bucket(n: int, parts: int = WIDTH_PARTS, floor: int = WIDTH_FLOOR) -> int:
    """``n`` rounded up to a multiple of ``max(floor, 2**floor(log2 n) / parts)``."""
    step = max(floor, (1 << max(n.bit_length() - 1, 0)) // parts)
    return -(-n // step) * step


def shape_key(sequences: int, width: int, rows: int, chunk: int) -> tuple[int, int, int, int]:
    """A forward's graph: its sequences, their padded width, its padded scored rows, the head's chunk."""
    return (sequences, bucket(width), bucket(rows, ROWS_PARTS, ROWS_FLOOR), chunk)


def larger_graph(captured: Any, key: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """The smallest captured key (of ``captured``'s keys) that can replay a forward of ``key``
    within the borrowing bounds above, or None."""
    sequences, width, rows, chunk = key
    most_width = width + width // BORROW_WIDTH_PARTS
    most_rows = rows + max(ROWS_FLOOR, rows // BORROW_ROWS_PARTS)
    fits = [
        k
        for k in captured
        if k[0] == sequences and k[3] == chunk and width <= k[1] <= most_width and rows <= k[2] <= most_rows
    ]
    return min(fits, key=lambda k: (k[1], k[2])) if fits else None


def why_not(model: Any) -> str | None:
    """None when ``model`` can be graphed here, else why not: its attention must be SDPA and every
    layer full causal attention (the causal mask is then SDPA's ``is_causal``, built in no tensor:
    the model's own mask code reads tensors on the host, which a capture forbids)."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention is {getattr(config, '_attn_implementation', None)!r}, not 'sdpa'"
    types = getattr(config, "layer_types", None)
    if not types or any(t != "full_attention" for t in types):
        return "not every layer is full causal attention"
    return None


def causal_masks(model: Any) -> dict[str, None]:
    """The per-layer-type mask mapping a transformers decoder takes as ``attention_mask``: None
    for full attention (SDPA's is_causal)."""
    return {t: None for t in set(model.config.layer_types)}


@dataclass
class _Graph:
    graph: Any
    tokens: torch.Tensor  # [B, W] static input
    rows: torch.Tensor  # [R] static input
    out: torch.Tensor  # [R] float32 static output


@dataclass
class GraphStats:
    captured: int = 0
    replayed: int = 0
    checked: int = 0
    borrowed: int = 0  # replays of a larger shape's graph (larger_graph)
    max_abs_diff: float = 0.0
    eager_shapes: int = 0  # forwards run eager past MAX_GRAPHS

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ModelGraphs:
    """The captured graphs of one model on one device (kept across LogprobModels of it)."""

    device: torch.device
    stream: Any
    pool: Any
    graphs: dict[tuple[int, ...], _Graph] = field(default_factory=dict)
    seen: dict[tuple[int, ...], int] = field(default_factory=dict)  # forwards of each shape not yet captured
    signature: tuple[int, ...] = ()
    stats: GraphStats = field(default_factory=GraphStats)
    lock: Any = field(default_factory=threading.RLock)  # one forward at a time on the static buffers


_BY_MODEL: weakref.WeakKeyDictionary[Any, ModelGraphs] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_OFF: list[str] = []  # why the graphs were turned off in this process (a disagreement, a capture that failed)


def off() -> str | None:
    return _OFF[0] if _OFF else None


def turn_off(detail: str) -> None:
    """The strategy's fallback: counted and logged once (verify.disagreed), off for the process."""
    with _LOCK:
        first = not _OFF
        _OFF.append(detail)
        _BY_MODEL.clear()  # their pools are freed
    if first:
        verify.disagreed(verify.CUDA_GRAPHS, detail)


def graphs_of(model: Any, device: torch.device) -> ModelGraphs:
    with _LOCK:
        found = _BY_MODEL.get(model)
        if found is None or found.device != device:
            found = ModelGraphs(device, torch.cuda.Stream(device), torch.cuda.graph_pool_handle())
            _BY_MODEL[model] = found
        return found


def release(model: Any) -> None:
    """Drop ``model``'s graphs and their memory pool (e.g. before a training step that needs the
    memory); the next scoring captures again."""
    with _LOCK:
        _BY_MODEL.pop(model, None)


def parameter_signature(model: Any) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, DEFAULT_TOLERANCE)


def capture(state: ModelGraphs, key: tuple[int, ...], tokens: torch.Tensor, rows: torch.Tensor, fn: Any) -> _Graph:
    """Capture ``fn(tokens, rows)`` on the model's side stream into its pool (the eager forward
    of the same shapes ran just before on that stream: cuBLAS and the kernels are initialised)."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=state.pool, capture_error_mode="thread_local")
    try:
        out = fn(tokens, rows)
    finally:
        graph.capture_end()
    entry = _Graph(graph, tokens, rows, out)
    state.graphs[key] = entry
    state.stats.captured += 1
    return entry


def check_due() -> bool:
    """Is this replay on new inputs one to check against the plain forward (counts the use)?"""
    return verify.due(verify.CUDA_GRAPHS)
