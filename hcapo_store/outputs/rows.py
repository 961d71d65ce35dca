"""What the exports share: selecting a run's credited episodes, grouping them, provenance,
and writing rows as JSON, JSONL or Parquet (no export layout of its own)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.credits.equations import hcapo_weights
from hcapo_store.credits.lookup import RunInfo
from hcapo_store.errors import ExportError, MissingExtra
from hcapo_store.ingestion import fields as episode_fields
from hcapo_store.outputs.files import atomic_write

# Runs whose stored advantages are signed and fixed at compute time (every episode kept).
SIGNED_VARIANTS = ("paper", "log-ratio")

_INT = re.compile(r"-?\d+")

FETCH_ROWS = 20_000

PARQUET_BATCH = 256

PARQUET_METADATA_KEY = "hcapo_store"  # schema metadata: JSON provenance (run, scorer, parameters, version)


def write_json(path: Path, data: Any, inputs: list[Path]) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=2, ensure_ascii=False).encode()), inputs=inputs)


def episode_id_value(external_id: str | None, name: str) -> int | str:
    """The original's int episode id when the external id is an integer string."""
    ident = external_id if external_id is not None else name
    return int(ident) if _INT.fullmatch(ident) else ident


def stream(conn: Connection, sql: str, params: dict[str, Any]) -> Iterator[Any]:
    result = conn.execution_options(stream_results=True).execute(text(sql), params)
    for block in result.partitions(FETCH_ROWS):
        yield from block


SELECT_SQL = """
SELECT e.id, e.name, e.external_id, e.reward, s.message_index, c.{q}, c.advantage, c.a_macro
FROM credits c
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
WHERE c.run_id = :run AND e.reward >= :min_reward
ORDER BY e.name, e.id, s.step_index
"""


def selected_episodes(conn: Connection, run: RunInfo, min_reward: float, use_smoothed: bool) -> list[dict[str, Any]]:
    sql = SELECT_SQL.format(q="q_h_smoothed" if use_smoothed else "q_h")
    episodes: list[dict[str, Any]] = []
    rows = stream(conn, sql, {"run": run.id, "min_reward": min_reward})
    for ep_id, group in itertools.groupby(rows, key=lambda r: r[0]):
        g = list(group)
        episodes.append(
            {
                "id": ep_id,
                "name": g[0][1],
                "external_id": g[0][2],
                "reward": g[0][3],
                "indices": [r[4] for r in g],
                "q": np.asarray([r[5] for r in g], dtype=np.float64),
                "advantage": np.asarray([np.nan if r[6] is None else r[6] for r in g], dtype=np.float64),
                "a_macro": np.nan if g[0][7] is None else float(g[0][7]),
            }
        )
    return episodes


# Every episode: the paper keeps them all (and a SQL bound both databases accept).
NO_MIN_REWARD = -1e308


@dataclass
class RunWeights:
    """The per-step weights an export writes, and where they came from."""

    episodes: list[dict[str, Any]]
    grpo: np.ndarray  # the macro term A_i per episode
    weights: list[np.ndarray]  # per step, per episode
    signed: bool  # paper: signed advantages, every episode kept; original: Eq. 8 weights >= 0
    source: str  # "stored" (the run's advantages) or "computed" (Eq. 8 with this export's options)
    omega: float
    min_reward: float | None
    group_by: str | None
    use_smoothed: bool

    def config(self) -> dict[str, Any]:
        return {
            "omega": self.omega,
            "min_reward": self.min_reward,
            "use_smoothed": self.use_smoothed,
            "group_by": self.group_by,
            "advantages": self.source,
        }


def run_weights(
    conn: Connection,
    run: RunInfo,
    warnings: list[str],
    *,
    omega: float | None = None,
    min_reward: float | None = None,
    group_by: str | None = None,
    use_smoothed: bool | None = None,
) -> RunWeights:
    """The run's stored advantages when the options are the run's own (None = the run's);
    Eq. 8 computed here, as before revision 0003, for other options or an older run.

    A paper run's advantages are fixed when it is computed (they are signed and use the
    group's statistics), so other options are refused, not silently recomputed the
    original's way."""
    p = run.credit_params
    if run.variant in SIGNED_VARIANTS:
        asked = {"--omega": (omega, p.omega), "--group-by": (group_by, p.group_by), "--no-smooth": (use_smoothed, True)}
        clash = [f"{flag} {given!r}" for flag, (given, own) in asked.items() if given is not None and given != own]
        if min_reward is not None:
            clash.append(f"--min-reward {min_reward!r}")
        if clash:
            raise ExportError(
                f"credit run {run.name!r} is a {run.variant} run: its signed advantages were fixed by `credits compute` "
                f"(omega {p.omega:g}, group-by {p.group_by or 'none'}, every episode kept); "
                f"drop {', '.join(clash)} or compute another run with `credits compute --variant paper ...`"
            )
        episodes = selected_episodes(conn, run, NO_MIN_REWARD, True)
        return RunWeights(
            episodes,
            np.asarray([e["a_macro"] for e in episodes], dtype=np.float64),
            [e["advantage"] for e in episodes],
            True,
            "stored",
            p.omega,
            None,
            p.group_by,
            True,
        )
    omega = p.omega if omega is None else omega
    min_reward = p.min_reward if min_reward is None else min_reward
    group_by = p.group_by if group_by is None else group_by
    use_smoothed = True if use_smoothed is None else use_smoothed
    episodes = selected_episodes(conn, run, min_reward, use_smoothed)
    own = (omega, min_reward, group_by, use_smoothed) == (p.omega, p.min_reward, p.group_by, True)
    if own and run.stored_advantages and all(not np.isnan(e["advantage"]).any() for e in episodes):
        grpo = np.asarray([e["a_macro"] for e in episodes], dtype=np.float64)
        weights = [e["advantage"] for e in episodes]
        return RunWeights(episodes, grpo, weights, False, "stored", omega, min_reward, group_by, use_smoothed)
    eq8 = hcapo_weights(
        np.asarray([e["reward"] for e in episodes], dtype=np.float64),
        [e["q"] for e in episodes],
        omega,
        episode_groups(conn, episodes, group_by, warnings),
    )
    return RunWeights(episodes, eq8.grpo, eq8.weights, False, "computed", omega, min_reward, group_by, use_smoothed)


def add_step_indices(conn: Connection, episodes: list[dict[str, Any]], run: RunInfo) -> None:
    """Adds each episode's credited step indices (in the order of ``indices``)."""
    rows = conn.execute(
        text(
            "SELECT s.episode_id, s.step_index FROM credits c JOIN steps s ON s.id = c.step_id "
            "WHERE c.run_id = :run ORDER BY s.episode_id, s.step_index"
        ),
        {"run": run.id},
    )
    by_ep: dict[int, list[int]] = {}
    for ep_id, index in rows:
        by_ep.setdefault(ep_id, []).append(index)
    for ep in episodes:
        ep["step_indices"] = by_ep[ep["id"]]


def episode_groups(
    conn: Connection, episodes: list[dict[str, Any]], group_by: str | None, warnings: list[str]
) -> list[Any] | None:
    if group_by is None:
        return None
    groups = episode_fields.group_values(conn, [e["id"] for e in episodes], group_by)
    untagged = groups.count(None)
    what = episode_fields.kind(group_by)
    if episodes and untagged == len(episodes):
        warnings.append(
            f"--group-by {group_by}: no exported episode has this {what}, so all form one group "
            f"({episode_fields.known_keys(conn, group_by)})"
        )
    elif untagged:
        warnings.append(
            f"--group-by {group_by}: {untagged} of {len(episodes)} episode(s) lack this {what} "
            "and form one group of their own"
        )
    return groups


def run_warnings(run: RunInfo) -> list[str]:
    return [run.stale] if run.stale else []


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
