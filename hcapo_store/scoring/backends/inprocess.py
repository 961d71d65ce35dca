"""In-process backend: the same prompts and stored results as a server, no server.

Wraps ``LogprobModel`` (chunked LM head): each request is checked and put in tensors in a
worker thread, then queued for the model's own thread (``ForwardQueue``), so the scheduler's
event loop keeps building and committing while the model computes, and the next requests are
ready when a forward ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hcapo_store.errors import InferenceError
from hcapo_store.rendering.requests import GroupPrompt, StepPrompt
from hcapo_store.scoring import defaults
from hcapo_store.scoring.backends.base import LOGPROB_FLOOR, BackendScore, outside_logprobs, precision_identity

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config + weight files (names and contents): the model's identity."""
    h = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.name == "config.json" or path.suffix in WEIGHT_SUFFIXES:
            h.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


class InProcessBackend:
    """``device``: cpu, cuda, cuda:N; None: the GPU when there is one. ``dtype``: bfloat16,
    float16, float32; None: the checkpoint's own on a GPU, float32 on the CPU. Both are part
    of the scorer unless float32 on the CPU (``precision_identity``). ``cuda_graphs``: on a GPU,
    each forward shape replayed as a CUDA graph (scoring/graphs.py; the same values)."""

    kind = "transformers"
    in_process = True  # the model computes in this process (scoring/preparing.py chooses by it)
    top_k = 0  # ``score --top-k K``: set by ``prepare``; the same forward keeps each row's top K

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | None = None,
        dtype: str | None = None,
        chunk_size: int = defaults.LM_HEAD_ROWS,
        cuda_graphs: bool = defaults.CUDA_GRAPHS,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.device = device
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.cuda_graphs = cuda_graphs
        self.scorer: Any = None
        self.queue: Any = None
        self._fingerprint: str | None = None
        self._computes_in: dict[str, str] | None = None

    async def start(self) -> None:
        from hcapo_store.scoring.forward import LogprobModel

        if self.scorer is None:
            self.scorer = await asyncio.to_thread(
                LogprobModel,
                self.model_dir,
                device=self.device,
                dtype=self.dtype,
                chunk_size=self.chunk_size,
                cuda_graphs=self.cuda_graphs,
            )
        if self._fingerprint is None:
            self._fingerprint = await asyncio.to_thread(model_fingerprint, self.model_dir)
        self._open_queue()

    def _open_queue(self) -> None:
        from hcapo_store.scoring.forward import ForwardQueue

        self.computes_in()  # read while the model is here (prepare() closes a live backend before identity())
        if self.queue is None:
            self.queue = ForwardQueue(self.scorer)

    async def close(self) -> None:
        queue, self.queue = self.queue, None
        if queue is not None:
            await asyncio.to_thread(queue.close)
        self.scorer = None

    def computes_in(self) -> dict[str, str]:
        """The loaded model's dtype and device type (read at start): recorded with the scorer."""
        from hcapo_store.scoring.forward import dtype_name

        if self.scorer is not None:
            self._computes_in = {"dtype": dtype_name(self.scorer.dtype), "device": self.scorer.device.type}
        if self._computes_in is None:
            raise RuntimeError("start() the backend before asking for its identity")
        return self._computes_in

    def identity(self) -> dict[str, Any]:
        identity = {"kind": self.kind, "model": self.model_dir.name, "model_sha256": self._fingerprint}
        return {**identity, **precision_identity(**self.computes_in())}

    def context_length(self) -> int | None:
        value = getattr(self.scorer.model.config, "max_position_embeddings", None) if self.scorer else None
        return value if isinstance(value, int) else None

    async def check_token_id(self, token_id: int) -> str | None:
        """None when ``token_id`` is inside the model's vocabulary, else why not."""
        size = self.scorer.vocab_size
        return None if 0 <= token_id < size else f"token id {token_id} is not in the model's vocabulary [0, {size})"

    def tokenizer_path(self) -> str:
        return str(self.model_dir)

    @property
    def display_url(self) -> str:
        return str(self.model_dir)

    def loads_tokenizer_from(self, directory: str | Path) -> bool:
        """Is ``directory`` the model directory (whose tokenizer ``server_tokens`` loads)?"""
        return Path(directory).resolve() == self.model_dir

    async def server_tokens(self, text: str) -> tuple[list[int], bool] | None:
        """``text`` as the model directory's own tokenizer encodes it (no special tokens added),
        so a ``--tokenizer`` beside ``--model`` is probed as a server's is; None when the
        directory holds no tokenizer (then the highest-id check alone applies)."""
        if not any((self.model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from hcapo_store.rendering.tokenizers import load_tokenizer

        try:
            own = await asyncio.to_thread(load_tokenizer, self.model_dir)
        except ValueError:
            return None
        return list(own(text, add_special_tokens=False)["input_ids"]), False

    def model_id(self) -> str:
        return str(self.model_dir)

    async def score(self, prompt: StepPrompt) -> BackendScore:
        return (await self._score_spans(prompt.input_ids, [(prompt.first_scored, len(prompt.input_ids))]))[0]

    async def score_group(self, group: GroupPrompt) -> list[BackendScore]:
        """One decoder pass over the group's ids; the LM head only on the members' spans."""
        return await self._score_spans(group.input_ids, group.spans)

    async def _score_spans(self, ids: Sequence[int], spans: list[tuple[int, int]]) -> list[BackendScore]:
        """The request is checked and put in tensors in a worker thread (while the model runs
        another), then queued for the model's thread (``ForwardQueue``)."""
        started = time.monotonic()
        if self.queue is None:
            self._open_queue()
        try:
            request = await asyncio.to_thread(self.scorer.prepare, ids, spans, self.top_k)
            values = await asyncio.wrap_future(self.queue.submit(request))
        except (RuntimeError, ValueError) as exc:  # e.g. out of memory, bad ids
            raise InferenceError("model_error", f"{type(exc).__name__}: {exc}", retryable=False) from exc
        latency = time.monotonic() - started
        for span, v in zip(spans, values):
            _check_logprobs(span, v)
        tops: list[list[list[tuple[int, float]]] | None] = [None] * len(values)
        if self.top_k:  # the request's rows, span by span
            ends = [sum(len(v) for v in values[: i + 1]) for i in range(len(values))]
            tops = [request.top[end - len(v) : end] for v, end in zip(values, ends)]
        return [
            BackendScore(
                logprobs=v,
                prompt_tokens=len(ids),
                cached_tokens=0,
                latency_s=latency,
                model_id=self.model_id(),
                top=top,
            )
            for v, top in zip(values, tops)
        ]


def _check_logprobs(span: tuple[int, int], values: Sequence[float]) -> None:
    """Refuse what the HTTP backends refuse (sglang.py, vllm.py): a logprob that is not finite,
    above 0 beyond rounding, or below ``LOGPROB_FLOOR``. A model in float16 whose logits overflow
    gives -inf or NaN: stored, they made a step's mean -inf (or a NaN the database refused with a
    traceback); a failed attempt names the position instead."""
    bad = outside_logprobs(values)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise InferenceError(
            "bad_response",
            f"position {span[0] + j}: the model's logprob {float(values[j])!r} is not a log-probability within "
            f"[{LOGPROB_FLOOR:g}, 0] ({int(bad.sum())} of the span's {len(values)}): its logits overflowed? "
            "(float16 does at large activations: --dtype bfloat16 or float32)",
            retryable=False,
        )


class LiveModelBackend(InProcessBackend):
    """The policy being trained, scoring its own rollouts in process (HCAPO online).

    Its weights change between iterations and are not fingerprinted (hashing a large model
    at every step would cost more than the scoring): the caller names them with
    ``weight_version``, which is part of the scorer, so scores of two versions never meet in
    one credit run; so are its dtype and device type. The model is
    used where it is, in its dtype, put in eval mode for each forward pass and given back in
    the mode it was in (dropout must not touch the scores)."""

    kind = "transformers-live"

    def __init__(
        self,
        model: Any,
        *,
        weight_version: str,
        chunk_size: int = defaults.LM_HEAD_ROWS,
        name: str | None = None,
        cuda_graphs: bool = defaults.CUDA_GRAPHS,
    ) -> None:
        if not weight_version:
            raise ValueError("a live model needs its weight_version (e.g. the training step)")
        config_name = str(getattr(model.config, "_name_or_path", "") or "live-model")
        self.model_name = name or Path(config_name).name or "live-model"
        super().__init__(Path(self.model_name), chunk_size=chunk_size, cuda_graphs=cuda_graphs)
        self.live = model
        self.version = str(weight_version)

    async def start(self) -> None:
        from hcapo_store.scoring.forward import LogprobModel

        if self.scorer is None:
            self.scorer = LogprobModel(
                self.model_name, chunk_size=self.chunk_size, loaded=self.live, cuda_graphs=self.cuda_graphs
            )
        self._open_queue()

    def identity(self) -> dict[str, Any]:
        # always both: a live scorer is new at every weight version anyway
        return {"kind": self.kind, "model": self.model_name, "weight_version": self.version, **self.computes_in()}

    def weight_version(self) -> str:
        return self.version

    def tokenizer_path(self) -> str:
        return ""  # a live model has no directory of its own: the caller passes the tokenizer

    def loads_tokenizer_from(self, directory: str | Path) -> bool:
        return False

    async def server_tokens(self, text: str) -> tuple[list[int], bool] | None:
        return None  # no directory, so no tokenizer of its own to probe against

    def model_id(self) -> str:
        return f"{self.model_name}@{self.version}"
