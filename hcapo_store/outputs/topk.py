"""Top-k distributions out of the store (``topk_scores``, ``score --top-k``; docs/FAMILY.md).

``export scores --top-k`` writes one Parquet row per step with its top-k: ``topk_token_ids``
``list<list<int32>>`` and ``topk_logprobs`` ``list<list<float32>>`` (token_count × K, most
likely first). ``export dataset --tokenized --top-k`` puts them on the rows' ``token_ids``
(``place``): per token of a step's own span, the teacher's K ids and logprobs of the position
that predicts it, ``null`` elsewhere — TRL's top-k distillation shape per row (its server
distillation and SDPO trainers take ``topk_token_ids`` / ``topk_logprobs`` of shape (B, T, K),
filled with 0 / -inf where the teacher has no value, and ``actual_logprobs`` (B, T): the
teacher's logprob of the sampled token).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.errors import ExportError
from hcapo_store.outputs.files import atomic_write, check_output
from hcapo_store.scoring.scorer import resolve_scorer
from hcapo_store.storage import db
from hcapo_store.storage.store import Store
from hcapo_store.storage.topk import TopK

BATCH = 1024
SQL = """
SELECT e.name, e.id, s.id, s.step_index, t.k, t.token_count, t.ids, t.logprobs, sc.token_logprobs
FROM topk_scores t
JOIN steps s ON s.id = t.step_id
JOIN episodes e ON e.id = s.episode_id
JOIN scores sc ON sc.step_id = t.step_id AND sc.scorer_id = t.scorer_id
WHERE t.scorer_id = :scorer AND e.is_current IS TRUE
ORDER BY e.name, e.id, s.step_index
"""
COLUMNS = ("scorer_id", "episode", "episode_id", "step_id", "step_index", "k", "token_count")


@dataclass(frozen=True)
class TopkExport:
    path: Path
    scorer_id: str
    scorer: str
    steps: int
    k: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "scorer_id": self.scorer_id,
            "scorer": self.scorer,
            "steps": self.steps,
            "k": self.k,
        }


def _schema() -> Any:
    import pyarrow as pa

    types = {"scorer_id": pa.string(), "episode": pa.string()}
    return pa.schema(
        [(c, types.get(c, pa.int64())) for c in COLUMNS]
        + [
            ("token_logprobs", pa.list_(pa.float32())),
            ("topk_token_ids", pa.list_(pa.list_(pa.int32()))),
            ("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
        ]
    )


def export_topk_scores(store: Store, out_path: Path | str, scorer: str | None = None) -> TopkExport:
    """Every step of ``scorer`` with a stored top-k, as Parquet (the module doc)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a test dependency
        raise ExportError("Parquet export needs pyarrow: pip install 'hcapo-store[parquet]'") from exc
    out = Path(out_path)
    check_output(out, store.files)
    with db.read(store.engine) as conn:
        scorer_id, label = resolve_scorer(conn, scorer)
        if conn.execute(text("SELECT COUNT(*) FROM topk_scores WHERE scorer_id = :s"), {"s": scorer_id}).scalar() == 0:
            raise ExportError(
                f"scorer {label} has no top-k: score with `hcapo-store score --top-k K` (a scorer of its own)"
            )
    seen_k: set[int] = set()
    count = [0]

    def rows() -> Iterator[dict[str, Any]]:
        with db.read(store.engine) as conn:
            for name, ep, step, index, k, n, ids, lps, blob in conn.execute(text(SQL), {"scorer": scorer_id}):
                top = TopK.decode(bytes(ids), bytes(lps), n, k)
                seen_k.add(int(k))
                yield {
                    "scorer_id": scorer_id,
                    "episode": name,
                    "episode_id": ep,
                    "step_id": step,
                    "step_index": index,
                    "k": k,
                    "token_count": n,
                    "token_logprobs": np.frombuffer(bytes(blob), dtype="<f4"),
                    "topk_token_ids": list(top.ids),
                    "topk_logprobs": list(top.logprobs),
                }

    def write(f: IO[bytes]) -> None:
        schema = _schema()
        names = [field.name for field in schema]
        with pq.ParquetWriter(f, schema) as writer:
            it = rows()
            while batch := list(itertools.islice(it, BATCH)):
                arrays = [pa.array([r[c] for r in batch], type=schema.field(c).type) for c in names]
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
                count[0] += len(batch)

    atomic_write(out, write, inputs=store.files)
    return TopkExport(out, scorer_id, label, count[0], sorted(seen_k))


def step_topk(conn: Connection, scorer_id: str, episode_id: int) -> dict[int, tuple[TopK, np.ndarray]]:
    """Step index → (its top-k, its stored logprobs of the sampled tokens) under ``scorer_id``."""
    rows = conn.execute(
        text(
            "SELECT s.step_index, t.k, t.token_count, t.ids, t.logprobs, sc.token_logprobs FROM topk_scores t "
            "JOIN steps s ON s.id = t.step_id JOIN scores sc ON sc.step_id = t.step_id AND sc.scorer_id = t.scorer_id "
            "WHERE t.scorer_id = :s AND s.episode_id = :e"
        ),
        {"s": scorer_id, "e": episode_id},
    )
    return {
        int(i): (TopK.decode(bytes(ids), bytes(lps), n, k), np.frombuffer(bytes(blob), dtype="<f4"))
        for i, k, n, ids, lps, blob in rows
    }


def place(
    length: int, spans: dict[int, tuple[int, int]], refused: dict[int, str], topk: dict[int, tuple[TopK, np.ndarray]]
) -> dict[str, list[Any]]:
    """The row's ``topk_token_ids``, ``topk_logprobs`` (a K-list per token, None where the
    teacher has none) and ``actual_logprobs`` (None there too). A step whose top-k covers other
    tokens than its span moves, in place, from ``spans`` to ``refused``; one without top-k
    stays in ``spans`` with None values."""
    ids: list[Any] = [None] * length
    lps: list[Any] = [None] * length
    actual: list[Any] = [None] * length
    for index, (start, end) in list(spans.items()):
        if index not in topk:
            continue
        top, sampled = topk[index]
        if top.token_count != end - start:
            del spans[index]
            refused[index] = (
                f"token_span: the scorer's top-k covers {top.token_count} token(s) of this step, its own tokens "
                f"here are {end - start} (score with --action-span policy and no --max-logprob-tokens)"
            )
            continue
        ids[start:end] = top.ids.tolist()
        lps[start:end] = [[round(float(v), 4) for v in row] for row in top.logprobs]
        actual[start:end] = [round(float(v), 6) for v in sampled]
    return {"topk_token_ids": ids, "topk_logprobs": lps, "actual_logprobs": actual}
