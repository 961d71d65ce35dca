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
from typing import Any

from hcapo_store.errors import MissingExtra, ScoringError
from hcapo_store.scoring import defaults

try:
    import torch
except ImportError as exc:  # pip install . (no extras): scoring against a server still works
    raise MissingExtra("torch", "local", "a local model (score --model, serve-reference, demo)") from exc


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
    ) -> None:
        """``loaded``: an already loaded causal LM (``model_dir`` then only names it; it is used
        where it is, in its own dtype)."""
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
            # transformers wraps PreTrainedModel.to in a decorator whose stub drops nn.Module.to's signature
            model = model.to(self.device).eval()  # type: ignore[arg-type]
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
        self._lock = threading.Lock()
        # (start, end, its sequences' lengths) of every forward of run() while a list (bench/gpu.py):
        # CUDA events recorded around it on a GPU, perf_counter() seconds on a CPU
        self.timings: list[tuple[Any, Any, tuple[int, ...]]] | None = None

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
        per forward."""
        out: list[list[list[float]] | None] = [None] * len(requests)
        for group in pack_groups([r.length for r in requests], self.pack_tokens):
            values = self._forward([requests[i] for i in group])
            for i, flat in zip(group, values, strict=True):
                spans, offset = [], 0
                for size in requests[i].sizes:
                    spans.append(flat[offset : offset + size])
                    offset += size
                out[i] = spans
        return [spans for spans in out if spans is not None]

    def _forward(self, batch: Sequence[SpanRequest]) -> list[list[float]]:
        width = max(r.length for r in batch)
        cuda = self.device.type == "cuda"
        with self._lock, torch.inference_mode(), _eval(self.model):
            if self.timings is not None:  # CUDA events on a GPU (no wait), the host clock on a CPU
                started: Any = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
                if cuda:
                    started.record()
            if len(batch) == 1:
                tokens = batch[0].tokens.to(self.device, non_blocking=True)[None]
            else:
                tokens = torch.zeros((len(batch), width), dtype=torch.long, device=self.device)
                for i, r in enumerate(batch):
                    tokens[i, : r.length] = r.tokens.to(self.device, non_blocking=True)
            rows = torch.cat([r.rows.to(self.device, non_blocking=True) + i * width for i, r in enumerate(batch)])
            hidden = self._body(input_ids=tokens, use_cache=False).last_hidden_state.flatten(0, 1)
            flat = tokens.flatten()
            picked = [self._target_logprobs(hidden[chunk], flat[chunk + 1]) for chunk in rows.split(self.chunk_size)]
            values = (torch.cat(picked) if picked else torch.empty(0)).tolist()  # the one copy back
            for i, r in enumerate(batch):  # top-k: the log-softmax of the same rows (score_positions')
                if r.top_k:
                    r.top.clear()
                    for chunk in (r.rows.to(self.device) + i * width).split(self.chunk_size):
                        r.top.extend(_top_k(self._log_softmax(hidden[chunk]), r.top_k))
            if self.timings is not None:
                ended: Any = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
                if cuda:
                    ended.record()
                self.timings.append((started, ended, tuple(r.length for r in batch)))
        out, offset = [], 0
        for r in batch:
            out.append(values[offset : offset + len(r.rows)])
            offset += len(r.rows)
        return out

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
        """One forward at a time: the oldest waiting request with the waiting ones it packs with;
        its callers get their values as soon as it ends (the rest wait for the next forward)."""
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                waiting = list(self._pending)
                groups = pack_groups([r.length for r, _ in waiting], self.model.pack_tokens)
                chosen = next(g for g in groups if 0 in g)
                taken = [waiting[i] for i in sorted(chosen)]
                self._pending = deque(w for i, w in enumerate(waiting) if i not in chosen)
            taken = [(r, f) for r, f in taken if f.set_running_or_notify_cancel()]
            if not taken:
                continue
            try:
                results = self.model.run([r for r, _ in taken])
            except BaseException as exc:  # every waiter hears of it; the thread goes on
                for _, future in taken:
                    future.set_exception(exc)
                continue
            for (_, future), result in zip(taken, results, strict=True):
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
        total += (logits[:, start : start + VOCAB_BLOCK].float() - peak[:, None]).exp_().sum(-1)
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
