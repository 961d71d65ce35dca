"""In-process scoring with a local transformers causal LM (CPU or GPU, no server).

Only the scored positions get logits. The decoder body runs once over the whole sequence
for hidden states; the LM head then runs on slices of the scored span. A full-head forward
of a Qwen-vocabulary model materialises 0.6 MB of fp32 logits per position (19 GB at 32k
tokens); in chunks the peak is ``chunk_size`` rows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hcapo_store.errors import MissingExtra, ScoringError

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


class LogprobModel:
    """Teacher-forced log-probabilities from a local causal LM. Thread-safe: one forward
    pass runs at a time."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        chunk_size: int = 512,
        loaded: Any = None,
    ) -> None:
        """``loaded``: an already loaded causal LM (``model_dir`` then only names it)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress display owns the terminal

        if chunk_size < 1:
            raise ScoringError(f"chunk_size must be at least 1, got {chunk_size}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.chunk_size = chunk_size
        if loaded is None:
            try:
                model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype)
            except (OSError, ValueError) as exc:
                raise ScoringError(f"cannot load a causal LM from {self.model_dir}: {exc}") from exc
            # transformers wraps PreTrainedModel.to in a decorator whose stub drops nn.Module.to's signature
            model = model.to(self.device).eval()  # type: ignore[arg-type]
        else:  # a live model (the policy being trained): used where it is, as it is
            model = loaded
            self.device = next(model.parameters()).device
        _reject_logit_transforms(model.config)
        self.model = model
        self._body = self.model.get_decoder()
        self._head = self.model.get_output_embeddings()
        self.vocab_size: int = self._head.out_features
        self._lock = threading.Lock()

    def score(self, input_ids: Sequence[int], first_scored: int) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for i in range(first_scored, len(input_ids))."""
        return self.score_positions(input_ids, first_scored).logprobs

    def score_spans(self, input_ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[list[float]]:
        """Per span ``[start, end)``, log p(input_ids[i] | input_ids[:i]) for i in the span.

        One decoder pass over the whole sequence; the LM head runs only on the rows that
        score a span token, ``chunk_size`` rows at a time (a grouped request's spans are a
        small part of its positions)."""
        ids = self._validate(input_ids, min((s for s, _ in spans), default=len(input_ids)))
        for start, end in spans:
            if not 1 <= start <= end <= len(ids):
                raise ValueError(f"span [{start}, {end}) is outside [1, {len(ids)}]")
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows = torch.cat([torch.arange(s - 1, e - 1) for s, e in spans]) if spans else torch.empty(0, dtype=torch.long)
        rows = rows.to(self.device)
        values: list[float] = []
        with self._lock, torch.inference_mode():
            hidden = self._hidden_states(tokens)
            for begin in range(0, len(rows), self.chunk_size):
                chunk = rows[begin : begin + self.chunk_size]
                logp = self._log_softmax(hidden[chunk])
                values += logp.gather(-1, tokens[chunk + 1, None])[:, 0].tolist()
        out, offset = [], 0
        for start, end in spans:
            out.append(values[offset : offset + end - start])
            offset += end - start
        return out

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
                chosen = scored.gather(-1, tokens[start + 1 : start + 1 + len(scored), None])
                logprobs += chosen[:, 0].tolist()
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
            "dtype": str(self.dtype).removeprefix("torch."),
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
