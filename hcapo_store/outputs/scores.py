"""``export scores``: per-step hindsight logprobs as ``list<float32>`` instead of a blob.

In SQL the per-token logprobs are a float32 blob, opaque to DuckDB, datasette or pandas.
The Parquet file has one row per scored step with its keys (scorer, episode, step) and the
logprobs as a real list column, so ``SELECT episode, list_avg(token_logprobs) FROM
'scores.parquet'`` works in DuckDB without any extension.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from sqlalchemy import text

from hcapo_store.errors import ExportError
from hcapo_store.outputs.files import atomic_write, check_output
from hcapo_store.scoring.scorer import resolve_scorer
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

BATCH = 2048
COLUMNS = (
    "scorer_id",
    "episode",
    "episode_id",
    "episode_key",
    "step_id",
    "step_index",
    "message_index",
    "phase",
    "subtask_id",
    "subtask_reward",
    "reward",
    "mean_logprob",
    "token_count",
    "total_action_tokens",
    "skipped_action_tokens",
    "token_logprobs",
)
SQL = f"""
SELECT {", ".join("v." + c for c in COLUMNS[:-1])}, sc.token_logprobs
FROM step_scores v JOIN scores sc ON sc.step_id = v.step_id AND sc.scorer_id = v.scorer_id
WHERE v.scorer_id = :scorer
ORDER BY v.episode, v.episode_id, v.step_index
"""


def _schema() -> Any:
    import pyarrow as pa

    types = {
        "scorer_id": pa.string(),
        "episode": pa.string(),
        "episode_key": pa.string(),
        "phase": pa.string(),
        "subtask_id": pa.string(),
        "subtask_reward": pa.float64(),
        "reward": pa.float64(),
        "mean_logprob": pa.float64(),
        "token_logprobs": pa.list_(pa.float32()),
    }
    return pa.schema([(c, types.get(c, pa.int64())) for c in COLUMNS])


def _rows(store: Store, scorer_id: str) -> Iterator[dict[str, Any]]:
    with db.read(store.engine) as conn:
        result = conn.execution_options(stream_results=True).execute(text(SQL), {"scorer": scorer_id})
        for row in result:
            values = list(row)
            blob = values[-1]
            values[-1] = np.frombuffer(bytes(blob), dtype="<f4") if blob is not None else None
            yield dict(zip(COLUMNS, values))


def _write(f: IO[bytes], rows: Iterator[dict[str, Any]]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema()
    written = 0
    with pq.ParquetWriter(f, schema) as writer:
        while batch := list(itertools.islice(rows, BATCH)):
            columns = {c: [r[c] for r in batch] for c in COLUMNS}
            arrays = [pa.array(columns[c], type=schema.field(c).type) for c in COLUMNS]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
            written += len(batch)
    return written


@dataclass(frozen=True)
class ScoresExport:
    """What ``export_scores`` wrote; ``as_dict()`` is its former dict."""

    path: Path  # the Parquet file
    scorer_id: str
    scorer: str  # the scorer's label
    steps: int  # rows written: one per scored step

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "scorer_id": self.scorer_id, "scorer": self.scorer, "steps": self.steps}


def export_scores(store: Store, out_path: Path | str, scorer: str | None = None) -> ScoresExport:
    """Write every scored step of ``scorer`` (default: the only one) to a Parquet file."""
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:  # pragma: no cover - pyarrow is a test dependency
        raise ExportError("Parquet export needs pyarrow: pip install 'hcapo-store[parquet]'") from exc
    out = Path(out_path)
    check_output(out, store.files)
    with db.read(store.engine) as conn:
        scorer_id, label = resolve_scorer(conn, scorer)
    count = [0]

    def write(f: IO[bytes]) -> None:
        count[0] = _write(f, _rows(store, scorer_id))

    atomic_write(out, write, inputs=store.files)
    return ScoresExport(out, scorer_id, label, count[0])
