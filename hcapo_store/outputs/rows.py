"""What the exports share: episode ids, warnings and counts, provenance, and writing rows as
JSON, JSONL or Parquet (no export layout of its own; the run's weights and episodes are
``credits/weights.py``'s)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any

from hcapo_store.credits.lookup import RunInfo
from hcapo_store.errors import MissingExtra
from hcapo_store.outputs.files import atomic_write

_INT = re.compile(r"-?\d+")

PARQUET_BATCH = 256

PARQUET_METADATA_KEY = "hcapo_store"  # schema metadata: JSON provenance (run, scorer, parameters, version)


def write_json(path: Path, data: Any, inputs: list[Path]) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=2, ensure_ascii=False).encode()), inputs=inputs)


def episode_id_value(external_id: str | None, name: str) -> int | str:
    """The original's int episode id when the external id is an integer string."""
    ident = external_id if external_id is not None else name
    return int(ident) if _INT.fullmatch(ident) else ident


def run_warnings(run: RunInfo) -> list[str]:
    return [run.stale] if run.stale else []


def add_signs(signs: dict[str, int], weights: Any) -> None:
    """Count a row's step advantages by sign into ``signs`` (positive / negative / zero)."""
    for x in weights:
        signs["positive" if x > 0 else "negative" if x < 0 else "zero"] += 1


def signal_warning(run: RunInfo, warnings: list[str]) -> None:
    """An export of a run whose hindsight term is zero on every step says so (credits/signal.py)."""
    signal = run.credit_signal
    if signal is not None and signal.zero and signal.steps:
        fix = (
            "episodes of one step each have no other step to compare: give them their earlier turns"
            if signal.scores_unused and signal.hindsight_nonzero_steps
            else "recompute with --no-dense-rewards or --variant paper"
        )
        warnings.append(
            f"credit run {run.name!r}: {signal.text()}: HCAPO's hindsight term is not in these advantages ({fix})"
        )


def episode_ids(episodes: list[dict[str, Any]]) -> list[int | str]:
    """Ints when every id is an integer string, else all strings (one column type)."""
    ids = [episode_id_value(e["external_id"], e["name"]) for e in episodes]
    return ids if all(isinstance(i, int) for i in ids) else [str(i) for i in ids]


def summary_path_for(out: Path) -> Path:
    """One summary per output file: ``train.jsonl`` → ``train.jsonl.summary.json`` (the
    JSONL and Parquet exports of one stem no longer share one)."""
    return out.with_name(f"{out.name}.summary.json")


def run_provenance(run: RunInfo) -> dict[str, Any]:
    """Where the rows come from; in the summary and in the Parquet schema metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("hcapo-store")
    except PackageNotFoundError:  # pragma: no cover - a source tree without an install
        ours = "unknown"
    return {
        "credit_run": run.name,
        "run_hash": run.run_hash,
        "run_created_at": run.created_at,
        "scorer_id": run.scorer_id,
        "scorer_label": run.scorer_label,
        "credit_params": run.params,
        "hcapo_store_version": ours,
    }


def write_jsonl(f: IO[bytes], rows: Iterator[dict[str, Any]]) -> None:
    for row in rows:
        f.write(json.dumps(row, ensure_ascii=False).encode())
        f.write(b"\n")


def dataset_parquet_schema(id_type: Any, weighted: bool = False) -> Any:
    import pyarrow as pa

    call = pa.struct(
        [
            ("id", pa.string()),
            ("type", pa.string()),
            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ]
    )
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_calls", pa.list_(call)),
            ("name", pa.string()),
            ("tool_call_id", pa.string()),
        ]
        + ([("weight", pa.float64())] if weighted else [])
    )
    return pa.schema(
        [
            ("messages", pa.list_(message)),
            ("step_advantages", pa.list_(pa.float64())),
            ("step_message_indices", pa.list_(pa.int64())),
            ("_episode_id", id_type),
            ("_reward", pa.float64()),
            ("_grpo_advantage", pa.float64()),
            ("_num_steps", pa.int64()),
        ]
    )


def write_parquet(
    f: IO[bytes],
    rows: Iterator[dict[str, Any]],
    provenance: dict[str, Any],
    weighted: bool = False,
    schema: Callable[[Any], Any] | None = None,
) -> None:
    """Rows in batches; ``schema(id_type)`` (default: the Eq. 8 rows') fixes the columns;
    ``provenance`` goes into the schema metadata."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingExtra("pyarrow", "parquet", "export --format parquet") from exc
    metadata = {PARQUET_METADATA_KEY: json.dumps(provenance, ensure_ascii=False)}
    schema_for = schema or (lambda id_type: dataset_parquet_schema(id_type, weighted))
    writer = None
    for batch in batched(rows, PARQUET_BATCH):
        if writer is None:
            id_type = pa.int64() if isinstance(batch[0]["_episode_id"], int) else pa.string()
            writer = pq.ParquetWriter(f, schema_for(id_type).with_metadata(metadata))
        writer.write_table(pa.Table.from_pylist(batch, schema=writer.schema))
    if writer is None:
        writer = pq.ParquetWriter(f, schema_for(pa.int64()).with_metadata(metadata))
    writer.close()


def batched(rows: Iterator[dict[str, Any]], n: int) -> Iterator[list[dict[str, Any]]]:
    while batch := list(itertools.islice(rows, n)):
        yield batch


def with_message_weights(rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Eq. 8 rows with ``"weight"`` on each credited assistant message (others have none)."""
    for row in rows:
        weights = dict(zip(row["step_message_indices"], row["step_advantages"]))
        row["messages"] = [{**m, "weight": weights[i]} if i in weights else m for i, m in enumerate(row["messages"])]
        yield row


@dataclass(frozen=True)
class WrittenRows:
    """What a dataset export wrote: its rows and, beside them, a summary. Subclasses add the
    summary's fields after these two."""

    path: Path  # the rows (JSONL or Parquet)
    summary_path: Path  # ``<path>.summary.json``

    def summary(self) -> dict[str, Any]:
        # every field after the two paths, in declaration order: the summary file's layout
        return {f.name: getattr(self, f.name) for f in fields(self)[2:]}

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "summary_path": str(self.summary_path), **self.summary()}
