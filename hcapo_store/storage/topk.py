"""Top-k distributions per scored position, stored compactly (``topk_scores``, migration 0009).

A step's K most likely ids and their logprobs at each of its ``n`` scored positions are two
blobs: the ids as little-endian int32 and the logprobs as little-endian float16, both
position-major (n × K). At K = 20 that is 120 bytes per token (80 + 40) plus the row, against
~600 KB for a full 152k-vocabulary float32 row (docs/FAMILY.md, BENCHMARKS.md). float16 keeps
about three significant digits of a logprob: enough for a distillation target, which the
stored float32 logprob of the sampled token stays the exact one of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ID_DTYPE = "<i4"
LOGPROB_DTYPE = "<f2"


@dataclass
class TopK:
    """One step's top-k: ``ids`` int32 (n, K), ``logprobs`` float32 (n, K), most likely first."""

    ids: np.ndarray
    logprobs: np.ndarray

    @property
    def k(self) -> int:
        return int(self.ids.shape[1]) if self.ids.ndim == 2 else 0

    @property
    def token_count(self) -> int:
        return int(self.ids.shape[0])

    def encode(self) -> tuple[bytes, bytes]:
        return (
            np.ascontiguousarray(self.ids, dtype=ID_DTYPE).tobytes(),
            np.ascontiguousarray(self.logprobs, dtype=LOGPROB_DTYPE).tobytes(),
        )

    @staticmethod
    def decode(ids: bytes, logprobs: bytes, token_count: int, k: int) -> TopK:
        i = np.frombuffer(ids, dtype=ID_DTYPE).reshape(token_count, k)
        v = np.frombuffer(logprobs, dtype=LOGPROB_DTYPE).astype(np.float32).reshape(token_count, k)
        return TopK(i, v)

    @staticmethod
    def of(rows: Sequence[Sequence[tuple[int, float]]], k: int) -> TopK:
        """From a backend's per-position ``[(id, logprob), ...]`` lists (each K long)."""
        ids = np.asarray([[int(t) for t, _ in row] for row in rows], dtype=np.int32).reshape(len(rows), k)
        values = np.asarray([[float(v) for _, v in row] for row in rows], dtype=np.float32).reshape(len(rows), k)
        return TopK(ids, values)
