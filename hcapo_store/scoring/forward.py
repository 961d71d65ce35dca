"""In-process scoring with a local transformers causal LM (CPU or GPU, no server).

Only the scored positions get logits. The decoder body runs once over the whole sequence
for hidden states; the LM head then runs on slices of the scored span. A full-head forward
of a Qwen-vocabulary model materialises 0.6 MB of fp32 logits per position (19 GB at 32k
tokens); in chunks the peak is ``chunk_size`` rows.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hcapo_store.errors import MissingExtra, ScoringError
from hcapo_store.rendering.requests import PackedIds
from hcapo_store.scoring import defaults

try:
    import torch
except ImportError as exc:  # pip install . (no extras): scoring against a server still works
    raise MissingExtra("torch", "local", "a local model (score --model, serve-reference, demo)") from exc

from hcapo_store.scoring import graphs  # after the torch check above


@dataclass(frozen=True)
class PositionScores:
    """Scores of the targets ``input_ids[first_scored:]`` (one entry per target).

    ``ranks`` (1 = most likely, as vLLM counts) and ``top`` (the ``top_k`` most likely
    ``(token_id, logprob)`` per position) are filled only when asked for. ``next_token`` is
    the greedy continuation ``(token_id, logprob)`` after the last input token, if asked.
    """

    logprobs: list[float]
    ranks: list[int] | None = None
    top: list[list[tuple[int, float]]] | None = None
    next_token: tuple[int, float] | None = None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; None: the GPU when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ScoringError(f"device {device!r} is not cpu, cuda or cuda:N") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ScoringError(f"device {device!r} is not cpu, cuda or cuda:N")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ScoringError(f"device {device!r}: this torch sees no CUDA GPU (use --device cpu)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ScoringError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPU(s)")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """A dtype by name (``defaults.DTYPES``); None: float32 on the CPU, and on a GPU None too
    (the checkpoint's own, read when it loads)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return getattr(torch, defaults.CPU_DTYPE) if device.type == "cpu" else None
    if dtype not in defaults.DTYPES:
        raise ScoringError(f"dtype {dtype!r} is not one of {', '.join(defaults.DTYPES)}")
    return getattr(torch, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SpanRequest:
    """One sequence and the spans of it to score, checked and in tensors (on the host; pinned
    when the model is on a GPU, so the copy to it does not wait for the forward in flight).
    Made by :meth:`LogprobModel.prepare` in any thread, outside the model's lock."""

    tokens: torch.Tensor  # [length] token ids
    rows: torch.Tensor  # [scored] the positions whose logits score a token (target = tokens[row + 1])
    sizes: tuple[int, ...]  # scored tokens per span, in order
    top_k: int = 0  # > 0: the forward also keeps each scored row's K most likely (id, logprob)
    # filled by the forward when ``top_k``: one list of K pairs per scored row, in ``rows`` order
    top: list[list[tuple[int, float]]] = field(default_factory=list, compare=False)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


class ForwardTiming(NamedTuple):
    """One forward as :attr:`LogprobModel.timings` records it (bench/gpu.py)."""

    started: Any  # a CUDA event recorded before it on a GPU (no wait), perf_counter() seconds on a CPU
    ended: Any
    lengths: tuple[int, ...]  # its sequences' lengths
    # eager | replay (a CUDA graph's, alone) | capture (the rule, the capture and a replay compared)
    # | check (a replay and the rule beside it)
    how: str


@dataclass(frozen=True)
class InFlight:
    """A launched forward (:meth:`LogprobModel.launch`): its values are ready once ``event`` is."""

    batch: tuple[SpanRequest, ...]
    values: torch.Tensor  # float32, one per scored row in request order (pinned host memory on a GPU)
    event: Any = None  # torch.cuda.Event after the copy back; None on a CPU
    check: Any = None  # (mismatches, largest difference, count) of a graph checked against the rule
    graphs: Any = None  # the model's graphs.ModelGraphs when one was used


def _fill(tokens: torch.Tensor, rows: torch.Tensor, batch: Sequence[SpanRequest]) -> None:
    """A forward's inputs (a graph's static ones, or an eager forward's): the sequences
    right-padded with 0 into ``tokens`` [B, W], their scored rows (flat indices into B x W) then
    0s into ``rows`` (copies from pinned memory on a GPU, asynchronous)."""
    width = tokens.shape[1]
    tokens.zero_()
    rows.zero_()
    offset = 0
    for i, r in enumerate(batch):
        tokens[i, : r.length].copy_(r.tokens, non_blocking=True)
        n = len(r.rows)
        if n:
            part = rows[offset : offset + n]
            part.copy_(r.rows, non_blocking=True)
            if i:
                part += i * width
        offset += n


def _compare(got: torch.Tensor, rule: torch.Tensor, tol: float) -> tuple[torch.Tensor, ...]:
    """On the device (read with the values): how many differ by more than ``tol``, the largest
    difference, how many were compared."""
    close = torch.isclose(got, rule, rtol=0.0, atol=tol, equal_nan=True)
    largest = (got - rule).abs().nan_to_num(nan=0.0).max() if len(got) else torch.zeros((), device=got.device)
    return (~close).sum(), largest, torch.tensor(len(got))


class LogprobModel:
    """Teacher-forced log-probabilities from a local causal LM. Thread-safe: one forward
    pass runs at a time.

    ``device``: ``cpu``, ``cuda``, ``cuda:N``; None: the GPU when there is one. ``dtype``: a
    ``torch.dtype`` or its name; None: the checkpoint's own on a GPU, float32 on the CPU.
    ``pack_tokens``: the most tokens (padding included) one forward of :meth:`run` may hold
    when it packs several short requests; None: ``defaults.PACK_TOKENS`` on a GPU, 0 (one
    request per forward) on the CPU."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        chunk_size: int = defaults.LM_HEAD_ROWS,
        pack_tokens: int | None = None,
        loaded: Any = None,
        cuda_graphs: bool = defaults.CUDA_GRAPHS,
    ) -> None:
        """``loaded``: an already loaded causal LM (``model_dir`` then only names it; it is used
        where it is, in its own dtype). ``cuda_graphs``: on a GPU, replay each forward shape as
        a CUDA graph where the model allows (scoring/graphs.py; checked against the eager path)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress display owns the terminal

        if chunk_size < 1:
            raise ScoringError(f"chunk_size must be at least 1, got {chunk_size}")
        self.model_dir = Path(model_dir)
        self.chunk_size = chunk_size
        if loaded is None:
            self.device = resolve_device(device)
            asked = resolve_dtype(dtype, self.device)
            try:
                model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=asked or "auto")
            except (OSError, ValueError) as exc:
                raise ScoringError(f"cannot load a causal LM from {self.model_dir}: {exc}") from exc
            model = model.to(self.device).eval()
        else:  # a live model (the policy being trained): used where it is, as it is
            model = loaded
            self.device = next(model.parameters()).device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        _reject_logit_transforms(model.config)
        self.model = model
        self._body = self.model.get_decoder()
        self._head = self.model.get_output_embeddings()
        self.vocab_size: int = self._head.out_features
        if pack_tokens is None:
            pack_tokens = defaults.PACK_TOKENS if self.device.type == "cuda" else 0
        self.pack_tokens = pack_tokens
        self.cuda_graphs = cuda_graphs
        self._graphs_unfit = graphs.why_not(model)  # None: this model can be graphed
        self._lock = threading.Lock()
        # every forward's ForwardTiming while a list (bench/gpu.py)
        self.timings: list[ForwardTiming] | None = None

    def score(self, input_ids: Sequence[int], first_scored: int) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for i in range(first_scored, len(input_ids))."""
        return self.score_positions(input_ids, first_scored).logprobs

    def score_spans(self, input_ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        """Per span ``[start, end)``, log p(input_ids[i] | input_ids[:i]) for i in the span.

        One decoder pass over the whole sequence; the LM head runs only on the rows that
        score a span token, ``chunk_size`` rows at a time (a grouped request's spans are a
        small part of its positions)."""
        return self.run([self.prepare(input_ids, spans)])[0]

    def score_spans_many(
        self, requests: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]]]]
    ) -> list[list[list[float]]]:
        """``score_spans`` of several ``(input_ids, spans)``, in order; short ones share a
        forward up to ``pack_tokens`` (:meth:`run`)."""
        return self.run([self.prepare(ids, spans) for ids, spans in requests])

    def prepare(self, input_ids: Sequence[int], spans: Sequence[tuple[int, int]], top_k: int = 0) -> SpanRequest:
        """Check a request and put it in tensors: the CPU work of a request, done in the caller's
        thread while the model runs another (raises ValueError on bad ids or spans). ``top_k``:
        the same forward also fills the request's ``top`` (``score --top-k``)."""
        if not input_ids:
            raise ValueError("input_ids cannot be empty.")
        n = len(input_ids)
        for start, end in spans:
            if not 1 <= start <= end <= n:
                raise ValueError(f"span [{start}, {end}) is outside [1, {n}]")
        try:
            if isinstance(input_ids, PackedIds):  # from a worker process: its buffer, not an int at a time
                tokens = torch.frombuffer(input_ids.as_array, dtype=torch.int32).to(torch.long)
            else:
                tokens = torch.tensor(input_ids, dtype=torch.long)
        except (TypeError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"input_ids must be integers: {exc}") from None
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        sizes = tuple(end - start for start, end in spans)
        if spans:
            rows = torch.cat([torch.arange(start - 1, end - 1, dtype=torch.long) for start, end in spans])
        else:
            rows = torch.empty(0, dtype=torch.long)
        if self.device.type == "cuda":  # pinned: the copy to the GPU is asynchronous
            tokens = tokens.pin_memory()
            rows = rows.pin_memory() if len(rows) else rows
        return SpanRequest(tokens, rows, sizes, top_k)

    def run(self, requests: Sequence[SpanRequest]) -> list[list[list[float]]]:
        """The spans' log-probabilities of each prepared request, in order. Requests whose
        tokens together (right-padded to the longest: a causal model's real positions never
        see the padding after them) fit ``pack_tokens`` with at most ``PACK_WASTE`` padding
        share one forward; the LM head's picks stay on the device and come back in one copy
        per forward, the next forward launched before the last one's values are read."""
        out: list[list[list[float]] | None] = [None] * len(requests)
        flights: deque[tuple[list[int], InFlight]] = deque()

        def read_oldest() -> None:
            group, flight = flights.popleft()
            for i, spans in zip(group, self.finish(flight), strict=True):
                out[i] = spans

        for group in pack_groups([r.length for r in requests], self.pack_tokens):
            flights.append((group, self.launch([requests[i] for i in group])))
            if len(flights) > 1:
                read_oldest()
        while flights:
            read_oldest()
        return [spans for spans in out if spans is not None]

    def launch(self, batch: Sequence[SpanRequest]) -> InFlight:
        """Queue one forward of ``batch`` on the device; its values are read by :meth:`finish`
        (on a GPU they come back in one asynchronous copy, so the model's thread can launch the
        next forward while this one runs). A CUDA graph of the forward's shape replays it when
        the model allows (scoring/graphs.py), checked against this eager path."""
        width = max(r.length for r in batch)
        cuda = self.device.type == "cuda"
        with self._lock, torch.inference_mode(), _eval(self.model):
            state = self._graph_state(batch) if cuda else None
            stream = state.stream if state is not None else None
            # the graphs' static buffers are the model's: one forward at a time uses them (two
            # LogprobModels of one live model in two threads wait here), the copy out queued before the next
            graph_lock = state.lock if state is not None else contextlib.nullcontext()
            with graph_lock, torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None:  # whatever the caller's stream did to the weights comes first
                    stream.wait_stream(torch.cuda.default_stream(self.device))
                if self.timings is not None:  # CUDA events on a GPU (no wait), the host clock on a CPU
                    started: Any = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
                    if cuda:
                        started.record()
                graphed = self._graphed(state, batch, width) if state is not None else None
                check, how = None, "eager"
                if graphed is not None:
                    values, check, how = graphed
                else:
                    tokens, rows = self._eager_inputs(batch, width)
                    hidden = self._hidden(tokens)
                    values = self._pick_rows(hidden, tokens, rows)
                    for i, r in enumerate(batch):  # top-k: the log-softmax of the same rows (score_positions')
                        if r.top_k:
                            r.top.clear()
                            for chunk in (r.rows.to(self.device) + i * width).split(self.chunk_size):
                                r.top.extend(_top_k(self._log_softmax(hidden[chunk]), r.top_k))
                if self.timings is not None:
                    ended: Any = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
                    if cuda:
                        ended.record()
                    self.timings.append(ForwardTiming(started, ended, tuple(r.length for r in batch), how))
                event = None
                if cuda:  # the one copy back, asynchronous: finish() waits for it
                    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                    host.copy_(values, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    values = host
        return InFlight(tuple(batch), values, event, check, state)

    def finish(self, flight: InFlight) -> list[list[list[float]]]:
        """The values of a launched forward, request by request and span by span (waits for it)."""
        if flight.event is not None:
            flight.event.synchronize()
        values = flight.values.tolist()
        if flight.check is not None:
            self._judge(flight)
        out = []
        offset = 0
        for r in flight.batch:
            spans = []
            for size in r.sizes:
                spans.append(values[offset : offset + size])
                offset += size
            out.append(spans)
        return out

    def _picks(self, tokens: torch.Tensor, rows: torch.Tensor, masks: dict[str, None] | None = None) -> torch.Tensor:
        """The forward: the body over ``tokens`` [B, W], then each row of ``rows`` (flat indices
        into B x W) scores the token after it. ``masks``: the per-layer-type causal masks given
        to the body (graphs.causal_masks: none built on the host); None: the model's own."""
        return self._pick_rows(self._hidden(tokens, masks), tokens, rows)

    def _hidden(self, tokens: torch.Tensor, masks: dict[str, None] | None = None) -> torch.Tensor:
        """The body's last hidden states of ``tokens`` [B, W], flattened to [B x W, hidden]."""
        extra = {} if masks is None else {"attention_mask": masks}
        return self._body(input_ids=tokens, use_cache=False, **extra).last_hidden_state.flatten(0, 1)

    def _pick_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        flat = tokens.flatten()
        picked = [self._target_logprobs(hidden[chunk], flat[chunk + 1]) for chunk in rows.split(self.chunk_size)]
        return torch.cat(picked) if picked else torch.empty(0, device=tokens.device)

    def _eager_inputs(self, batch: Sequence[SpanRequest], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch right-padded to ``width`` and its flat scored rows, unbucketed (``_fill``, as a
        graph's inputs are filled)."""
        tokens = torch.empty((len(batch), width), dtype=torch.long, device=self.device)
        rows = torch.empty(sum(len(r.rows) for r in batch), dtype=torch.long, device=self.device)
        _fill(tokens, rows, batch)
        return tokens, rows

    def _graph_state(self, batch: Sequence[SpanRequest]) -> Any:
        """The model's graphs when this forward may use one, else None."""
        if not self.cuda_graphs or self._graphs_unfit or graphs.off() is not None:
            return None
        if any(r.top_k for r in batch) or not any(len(r.rows) for r in batch):
            return None
        state = graphs.graphs_of(self.model, self.device)
        signature = graphs.parameter_signature(self.model)
        with state.lock:
            if signature != state.signature:  # new tensors (not updated in place): the graphs read the old ones
                state.graphs.clear()
                state.signature = signature
        return state

    def _graphed(self, state: Any, batch: Sequence[SpanRequest], width: int) -> tuple[torch.Tensor, Any, str] | None:
        """The forward by its shape's graph: (values on the device, the check to judge in finish or
        None, how: ForwardTiming.how); None: run it eager (a shape's first sighting, too many shapes)."""
        scored = sum(len(r.rows) for r in batch)
        key = graphs.shape_key(len(batch), width, scored, self.chunk_size)
        entry = state.graphs.get(key)
        tol = graphs.tolerance(self.dtype)
        if entry is None and (larger := graphs.larger_graph(state.graphs, key)) is not None:
            entry = state.graphs[larger]  # its buffers hold this forward, padded a little more
            state.stats.borrowed += 1
        if entry is None:
            seen = state.seen[key] = state.seen.get(key, 0) + 1
            if seen < graphs.CAPTURE_AT or len(state.graphs) >= graphs.MAX_GRAPHS:
                state.stats.eager_shapes += seen >= graphs.CAPTURE_AT
                return None
            del state.seen[key]
            tokens = torch.zeros(key[:2], dtype=torch.long, device=self.device)
            rows = torch.zeros(key[2], dtype=torch.long, device=self.device)
            _fill(tokens, rows, batch)
            plain = self._picks(tokens, rows)  # the rule, and the warm-up the capture needs
            masks = graphs.causal_masks(self.model)
            try:
                entry = graphs.capture(state, key, tokens, rows, lambda t, r: self._picks(t, r, masks))
            except Exception as exc:  # any failure of the capture: the rule's values stand
                graphs.turn_off(f"capturing a forward of shape {key[:3]} failed: {type(exc).__name__}: {exc}")
                return plain[:scored], None, "eager"
            entry.graph.replay()
            return plain[:scored], _compare(entry.out[:scored], plain[:scored], tol), "capture"
        _fill(entry.tokens, entry.rows, batch)
        entry.graph.replay()
        state.stats.replayed += 1
        if graphs.check_due():
            plain = self._picks(entry.tokens, entry.rows)
            return plain[:scored], _compare(entry.out[:scored], plain[:scored], tol), "check"
        return entry.out[:scored], None, "replay"

    def _judge(self, flight: InFlight) -> None:
        mismatched, largest, count = (float(t) for t in flight.check)
        stats = flight.graphs.stats
        stats.checked += 1
        stats.max_abs_diff = max(stats.max_abs_diff, largest)
        if mismatched:
            graphs.turn_off(
                f"{int(mismatched)} of {int(count)} logprobs differ by more than {graphs.tolerance(self.dtype)}"
                f" nats (largest {largest:.3g})"
            )

    def _target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) of each row: its logit minus the row's logsumexp, in float32 (equal to
        the target's entry of a float32 log-softmax of the row within float32 rounding) without
        a float32 copy of the whole rows."""
        logits = self._head(hidden)
        picked = logits.gather(-1, targets[:, None])[:, 0].float()
        return picked - logsumexp_f32(logits)

    def score_batch(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[list[float]]:
        """``score`` for several ``(input_ids, first_scored)`` pairs, in order.

        One forward pass per sequence: padding would change the matmul shapes (and so the
        last bits of the result) and multiply peak memory, for little gain on CPU.
        """
        return [self.score(ids, first) for ids, first in requests]

    def score_positions(
        self,
        input_ids: Sequence[int],
        first_scored: int,
        *,
        top_k: int = 0,
        ranks: bool = False,
        next_token: bool = False,
    ) -> PositionScores:
        """Scores of ``input_ids[first_scored:]``, optionally with ranks, top-k and the
        greedy next token. ``first_scored == len(input_ids)`` scores nothing."""
        if not (top_k or ranks or next_token):  # the logprobs alone: picked on the device, one copy back
            if not 1 <= first_scored <= len(input_ids):
                raise ValueError(f"first_scored must be in [1, {len(input_ids)}], got {first_scored}")
            return PositionScores(logprobs=self.score_spans(input_ids, [(first_scored, len(input_ids))])[0])
        ids = self._validate(input_ids, first_scored)
        end = len(ids) if next_token else len(ids) - 1
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        logprobs: list[float] = []
        rank_list: list[int] = []
        top: list[list[tuple[int, float]]] = []
        greedy: tuple[int, float] | None = None
        with self._lock, torch.inference_mode():
            hidden = self._hidden_states(tokens)
            # The row of position p scores token p + 1; the row of the last position (only
            # present with next_token) has no target and gives the greedy continuation.
            for start in range(first_scored - 1, end, self.chunk_size):
                stop = min(start + self.chunk_size, end)
                rows = self._log_softmax(hidden[start:stop])
                scored = rows[: min(stop, len(ids) - 1) - start]
                targets = tokens[start + 1 : start + 1 + len(scored)]
                chosen = scored.gather(-1, targets[:, None])
                # the sampled token's logprob as the span path computes it (its own head): the
                # same value whether or not ranks or top-k are asked for
                logprobs += self._target_logprobs(hidden[start : start + len(scored)], targets).tolist()
                if ranks:
                    rank_list += ((scored > chosen).sum(-1) + 1).tolist()
                if top_k:
                    top += _top_k(scored, top_k)
                if next_token and stop == len(ids):
                    value, index = rows[-1].max(-1)
                    greedy = (int(index), float(value))
        return PositionScores(
            logprobs=logprobs,
            ranks=rank_list if ranks else None,
            top=top if top_k else None,
            next_token=greedy,
        )

    def model_info(self) -> dict[str, Any]:
        """What was loaded, for logs and for the scorer identity."""
        config = self.model.config
        return {
            "model_dir": str(self.model_dir),
            "architectures": list(getattr(config, "architectures", None) or []),
            "model_type": config.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": getattr(config, "hidden_size", None),
            "num_hidden_layers": getattr(config, "num_hidden_layers", None),
            "max_position_embeddings": getattr(config, "max_position_embeddings", None),
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "chunk_size": self.chunk_size,
        }

    def _validate(self, input_ids: Sequence[int], first_scored: int) -> list[int]:
        ids = list(input_ids)
        if not ids:
            raise ValueError("input_ids cannot be empty.")
        if not 1 <= first_scored <= len(ids):
            raise ValueError(f"first_scored must be in [1, {len(ids)}], got {first_scored}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._body(input_ids=tokens[None], use_cache=False).last_hidden_state[0]

    def _log_softmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(hidden).float().log_softmax(-1)


class ForwardQueue:
    """The model's own thread, fed by a queue of prepared requests: the CPU work of the next
    requests (rendering, :meth:`LogprobModel.prepare`) is done by their callers while the model
    runs the current forward, and whatever is waiting when a forward ends goes into the next
    one (packed when short: :meth:`LogprobModel.run`). ``submit`` from any thread; ``close``
    ends the thread once the queue is empty."""

    def __init__(self, model: LogprobModel) -> None:
        self.model = model
        self._pending: deque[tuple[SpanRequest, Future[list[list[float]]]]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, request: SpanRequest) -> Future[list[list[float]]]:
        future: Future[list[list[float]]] = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the model's queue is closed")
            self._pending.append((request, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="hcapo-model", daemon=True)
                self._thread.start()
            self._wake.notify()
        return future

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _serve(self) -> None:
        """One forward at a time on the device: the oldest waiting request with the waiting ones
        it packs with. When more are waiting, the next forward is launched before the current
        one's values are read, so the device never waits for this thread between them; its
        callers get their values as soon as it ends."""
        flight: tuple[list[Future[list[list[float]]]], InFlight] | None = None
        while True:
            with self._wake:
                while not self._pending and not self._closed and flight is None:
                    self._wake.wait()
                if not self._pending and flight is None:
                    return  # closed, and nothing waits or runs
                taken = self._take() if self._pending else []
            launched = None
            if taken:
                try:
                    launched = ([f for _, f in taken], self.model.launch([r for r, _ in taken]))
                except BaseException as exc:  # every waiter hears of it; the thread goes on
                    for _, future in taken:
                        future.set_exception(exc)
            if flight is not None:
                self._deliver(*flight)
            flight = launched

    def _take(self) -> list[tuple[SpanRequest, Future[list[list[float]]]]]:
        """The next forward's requests (under ``_wake``), the cancelled ones dropped."""
        waiting = list(self._pending)
        groups = pack_groups([r.length for r, _ in waiting], self.model.pack_tokens)
        chosen = next(g for g in groups if 0 in g)
        self._pending = deque(w for i, w in enumerate(waiting) if i not in chosen)
        return [waiting[i] for i in sorted(chosen) if waiting[i][1].set_running_or_notify_cancel()]

    def _deliver(self, futures: list[Future[list[list[float]]]], flight: InFlight) -> None:
        try:
            results = self.model.finish(flight)
        except BaseException as exc:
            for future in futures:
                future.set_exception(exc)
            return
        for future, result in zip(futures, results, strict=True):
            future.set_result(result)


VOCAB_BLOCK = 32768  # vocabulary columns turned to float32 at once by logsumexp_f32


def logsumexp_f32(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp, computed in float32 (as a float32 log-softmax would) over logits of
    any float dtype, a block of ``VOCAB_BLOCK`` columns at a time: no float32 copy of whole rows."""
    if logits.dtype == torch.float32:
        return torch.logsumexp(logits, -1)
    peak = logits.amax(-1).float()  # exact in any float dtype
    peak = peak.masked_fill(~torch.isfinite(peak), 0.0)
    total = torch.zeros_like(peak)
    for start in range(0, logits.shape[-1], VOCAB_BLOCK):
        # the subtraction promotes the block to float32 as it reads it: the values of
        # ``block.float() - peak`` without the float copy first (one pass over the block fewer)
        total += torch.sub(logits[:, start : start + VOCAB_BLOCK], peak[:, None]).exp_().sum(-1)
    return total.log_() + peak


def pack_groups(lengths: Sequence[int], pack_tokens: int, waste: float = defaults.PACK_WASTE) -> list[list[int]]:
    """Indexes of ``lengths`` in forwards: longest first, each forward adding the next longest
    while ``count x longest`` stays within ``pack_tokens`` and padding within ``waste`` of it;
    ``pack_tokens`` 0: one per forward."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and pack_tokens:
            group = groups[-1]
            width = lengths[group[0]]
            cells = width * (len(group) + 1)
            real = sum(lengths[j] for j in group) + lengths[i]
            if cells <= pack_tokens and cells - real <= waste * cells:
                group.append(i)
                continue
        groups.append([i])
    return groups


@contextlib.contextmanager
def _eval(model: Any) -> Iterator[None]:
    """The model in eval mode for a forward (dropout must not touch the scores), then given back
    in the mode it was in (a live policy in training)."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train(True)


def _top_k(rows: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    values, indices = rows.topk(min(k, rows.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]


def _reject_logit_transforms(config: Any) -> None:
    """The chunked path applies the LM head only; a model that rescales or soft-caps its
    logits after the head would be scored wrongly, so refuse it."""
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (
        None,
        1.0,
    ):
        raise ScoringError(
            f"{config.model_type}: logit soft-capping/scaling after the LM head is not supported by the chunked scorer"
        )
