"""Exports of a credit run: per-episode ``hindsight_scores.json`` and the Eq. 8 dataset.

Both stream from the database in episode order and write atomically (a temporary file in
the target directory, then ``os.replace``), so a reader never sees a half-written file.

Dataset rows are readable by the original trainer (docs/ORIGINAL.md §3). Parquet
stores ``messages`` as a list of structs {role, content, tool_calls, name, tool_call_id}
(absent keys are null; ``tool_calls[].function.arguments`` stays a JSON string), which
``datasets.load_dataset("parquet", ...)`` loads as a list of dicts without any decoding.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.credits.equations import CreditParams, hcapo_weights
from hcapo_store.credits.runs import RunInfo, get_run
from hcapo_store.errors import ExportError, MissingExtra
from hcapo_store.outputs.files import atomic_write, check_output
from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.storage import db
from hcapo_store.storage.episodes import loader_message
from hcapo_store.storage.store import Store

FETCH_ROWS = 20_000
LAYOUTS = ("steps", "weights-in-messages", "tokenized")
PARQUET_BATCH = 256
PARQUET_METADATA_KEY = "hcapo_store"  # schema metadata: JSON provenance (run, scorer, parameters, version)
_INT = re.compile(r"-?\d+")


def _write_json(path: Path, data: Any, inputs: list[Path]) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=2, ensure_ascii=False).encode()), inputs=inputs)


def episode_id_value(external_id: str | None, name: str) -> int | str:
    """The original's int episode id when the external id is an integer string."""
    ident = external_id if external_id is not None else name
    return int(ident) if _INT.fullmatch(ident) else ident


def _safe_part(part: str) -> str:
    cleaned = re.sub(r"[\\\x00]", "_", part).strip()
    return "_" if cleaned in ("", ".", "..") else cleaned


def _episode_dir(out: Path, name: str, episode_id: int, used: set[Path]) -> Path:
    """``out/pg-01/episode_001``: the unique name's parts as directories, never one written twice."""
    target = out.joinpath(*(_safe_part(p) for p in name.split("/")))
    if target in used:  # two names that sanitise alike
        target = target.with_name(f"{target.name}~id{episode_id}")
    used.add(target)
    return target


# ---- hindsight_scores.json ---------------------------------------------------------------------

HINDSIGHT_SQL = """
SELECT e.id, e.name, e.external_id, e.reward, e.frozen_scores,
       s.step_index, s.message_index, s.subtask_id, s.subtask_reward, s.phase,
       c.mean_logprob, c.token_count, sc.token_count, sc.total_action_tokens,
       sc.skipped_action_tokens, sc.logprob_start_len, c.pi_hind, c.rho, c.q_h, c.q_h_smoothed
FROM credits c
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
LEFT JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = :scorer
WHERE c.run_id = :run
ORDER BY e.id, s.step_index
"""


def _stream(conn: Connection, sql: str, params: dict[str, Any]) -> Iterator[Any]:
    result = conn.execution_options(stream_results=True).execute(text(sql), params)
    for block in result.partitions(FETCH_ROWS):
        yield from block


def _hyperparams(run: RunInfo, store: Store) -> dict[str, Any]:
    p = CreditParams.from_dict(run.params)
    # No re-aggregation: the span the scorer itself was limited to (the original's field).
    mlt = p.max_logprob_tokens
    if mlt is None:
        mlt = scorer_spec(store, run.scorer_id).get("max_logprob_tokens")
    return {
        "t_temp": p.t_temp,
        "gamma": p.gamma,
        "c_min": p.c_min,
        "c_max": p.c_max,
        "alpha": p.alpha,
        "smooth": p.smooth,
        "dense_rewards": p.dense,
        "max_logprob_tokens": mlt,
    }


def _hindsight_step(r: Any) -> dict[str, Any]:
    # Fewer tokens aggregated than scored (max_logprob_tokens): the span starts later.
    dropped = (r[12] or 0) - r[11]
    return {
        "mean_logprob": r[10],
        "action_token_count": r[11],
        "total_action_tokens": r[13],
        "skipped_action_tokens": (r[14] or 0) + dropped,
        "logprob_start_len": (r[15] or 0) + dropped,
        "step_index": r[5],
        "message_index": r[6],
        "subtask_id": r[7],
        "subtask_reward": r[8],
        "phase": r[9],
        "pi_hind": r[16],
        "rho": r[17],
        "q_h": r[18],
        "q_h_smoothed": r[19],
    }


def _hindsight_doc(rows: list[Any], hyper: dict[str, Any]) -> dict[str, Any]:
    first = rows[0]
    steps = [_hindsight_step(r) for r in rows]
    rewards = [s["subtask_reward"] for s in steps if s["subtask_reward"] is not None]
    return {
        "episode_id": episode_id_value(first[2], first[1]),
        "reward": first[3],
        "frozen_scores": json.loads(first[4] or "{}"),
        "dense_rewards_used": hyper["dense_rewards"],  # truthful, unlike the original (quirk Q13)
        "num_steps": len(steps),
        "num_subtasks_covered": len({s["subtask_id"] or s["phase"] for s in steps}),
        # null when no step has a reward (e.g. a null plan_score), agreeing with the steps' nulls
        "subtask_reward_range": [min(rewards), max(rewards)] if rewards else None,
        "steps": steps,
        "pi_hind_mean": sum(s["pi_hind"] for s in steps) / len(steps),
        "hyperparams": hyper,
    }


def export_hindsight_json(store: Store, out_dir: Path | str, run_name: str | None = None) -> dict[str, Any]:
    """``out_dir/<episode name>/hindsight_scores.json`` for every episode the run credits
    (``out_dir/pg-01/episode_001/…``: the name's parts are directories)."""
    run = get_run(store, run_name)
    hyper = _hyperparams(run, store)
    out = Path(out_dir)
    check_output(out, store.files)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a directory: pick another output directory")
    written = 0
    used: set[Path] = set()
    with db.read(store.engine) as conn:
        rows = _stream(conn, HINDSIGHT_SQL, {"run": run.id, "scorer": run.scorer_id})
        for ep_id, group in itertools.groupby(rows, key=lambda r: r[0]):
            ep_rows = list(group)
            target = _episode_dir(out, ep_rows[0][1], ep_id, used)
            _write_json(target / "hindsight_scores.json", _hindsight_doc(ep_rows, hyper), store.files)
            written += 1
    return {"run": run.name, "out_dir": str(out), "episodes": written, "warnings": _run_warnings(run)}


# ---- Eq. 8 dataset --------------------------------------------------------------------------------

SELECT_SQL = """
SELECT e.id, e.name, e.external_id, e.reward, s.message_index, c.{q}
FROM credits c
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
WHERE c.run_id = :run AND e.reward >= :min_reward
ORDER BY e.name, e.id, s.step_index
"""

MESSAGES_SQL = """
SELECT m.episode_id, m.message_index, m.role, m.content, m.tool_calls, m.name, m.tool_call_id
FROM messages m
JOIN episodes e ON e.id = m.episode_id
WHERE e.reward >= :min_reward
  AND e.id IN (SELECT s.episode_id FROM credits c JOIN steps s ON s.id = c.step_id WHERE c.run_id = :run)
ORDER BY e.name, e.id, m.message_index
"""


def _selected(conn: Connection, run: RunInfo, min_reward: float, use_smoothed: bool) -> list[dict[str, Any]]:
    sql = SELECT_SQL.format(q="q_h_smoothed" if use_smoothed else "q_h")
    episodes: list[dict[str, Any]] = []
    rows = _stream(conn, sql, {"run": run.id, "min_reward": min_reward})
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
            }
        )
    return episodes


def _groups(
    conn: Connection, episodes: list[dict[str, Any]], group_by: str | None, warnings: list[str]
) -> list[Any] | None:
    if group_by is None:
        return None
    tags: dict[int, str] = dict(
        conn.execute(text("SELECT episode_id, value FROM tags WHERE key = :k"), {"k": group_by}).all()
    )
    groups = [tags.get(e["id"]) for e in episodes]
    untagged = groups.count(None)
    if episodes and untagged == len(episodes):
        known = [r[0] for r in conn.execute(text("SELECT DISTINCT key FROM tags ORDER BY key"))]
        warnings.append(
            f"--group-by {group_by}: no exported episode has this tag, so all form one group "
            f"(tags: {', '.join(known) or 'none'})"
        )
    elif untagged:
        warnings.append(
            f"--group-by {group_by}: {untagged} of {len(episodes)} episode(s) lack this tag "
            "and form one group of their own"
        )
    return groups


def _run_warnings(run: RunInfo) -> list[str]:
    return [run.stale] if run.stale else []


def _episode_ids(episodes: list[dict[str, Any]]) -> list[int | str]:
    """Ints when every id is an integer string, else all strings (one column type)."""
    ids = [episode_id_value(e["external_id"], e["name"]) for e in episodes]
    return ids if all(isinstance(i, int) for i in ids) else [str(i) for i in ids]


def _rows(
    conn: Connection,
    run: RunInfo,
    episodes: list[dict[str, Any]],
    weights: list[np.ndarray],
    grpo: np.ndarray,
    min_reward: float,
) -> Iterator[dict[str, Any]]:
    ids = _episode_ids(episodes)
    by_id = {e["id"]: i for i, e in enumerate(episodes)}
    msgs = _stream(conn, MESSAGES_SQL, {"run": run.id, "min_reward": min_reward})
    for ep_id, group in itertools.groupby(msgs, key=lambda r: r[0]):
        i = by_id[ep_id]
        w = weights[i]
        if not (w > 0).any():  # the original drops rows whose weights are all 0
            continue
        messages = [loader_message(*r[2:]) for r in group]
        ep = episodes[i]
        for idx in ep["indices"]:
            if not 0 <= idx < len(messages) or messages[idx]["role"] != "assistant":
                raise ExportError(
                    f"episode {ep['name']}: step message_index {idx} is not an assistant "
                    f"message of its {len(messages)} messages; the store is inconsistent"
                )
        yield {
            "messages": messages,
            "step_advantages": [round(x, 6) for x in w.tolist()],
            "step_message_indices": list(ep["indices"]),
            "_episode_id": ids[i],
            "_reward": ep["reward"],
            "_grpo_advantage": round(float(grpo[i]), 6),
            "_num_steps": len(w),
        }


class _Stats:
    def __init__(self) -> None:
        self.rows = self.steps = self.nonzero = 0
        self.total = self.nonzero_total = 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        w = row["step_advantages"]
        self.rows += 1
        self.steps += len(w)
        nz = [x for x in w if x > 0]
        self.nonzero += len(nz)
        self.total += sum(w)
        self.nonzero_total += sum(nz)
        self.min = min(w) if self.min is None else min(self.min, min(w))
        self.max = max(w) if self.max is None else max(self.max, max(w))
        return row

    def as_dict(self) -> dict[str, Any]:
        return {
            "min": self.min or 0.0,
            "max": self.max or 0.0,
            "mean": self.total / self.steps if self.steps else 0.0,
            "nonzero_mean": self.nonzero_total / self.nonzero if self.nonzero else 0.0,
        }


def export_dataset(
    store: Store,
    out_path: Path | str,
    run_name: str | None = None,
    *,
    omega: float = 1.0,
    min_reward: float = 0.2,
    group_by: str | None = None,
    fmt: str = "jsonl",
    use_smoothed: bool = True,
    layout: str = "steps",
    tokenizer: str | Path | None = None,
) -> dict[str, Any]:
    """Eq. 8 rows (one per episode) + ``<out name>.summary.json``; returns the summary.

    ``layout``: ``steps`` (the original's rows), ``weights-in-messages`` (the same rows with a
    ``"weight"`` on each credited assistant message) or ``tokenized`` (token-level rows, see
    ``hcapo_store.outputs.tokenized``; needs ``tokenizer``, the scorer's tokenizer directory).
    ``summary["warnings"]`` says what the caller should know: a stale run, a ``group_by``
    tag the episodes lack, an empty dataset.
    """
    if fmt not in ("jsonl", "parquet"):
        raise ExportError(f"unknown format {fmt!r}: use jsonl or parquet")
    if layout not in LAYOUTS:
        raise ExportError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if layout == "tokenized":
        from hcapo_store.outputs.tokenized import export_tokenized

        if tokenizer is None:
            raise ExportError("the tokenized export needs the scorer's tokenizer directory (--tokenizer DIR)")
        return export_tokenized(
            store,
            out_path,
            run_name,
            tokenizer=tokenizer,
            omega=omega,
            min_reward=min_reward,
            group_by=group_by,
            fmt=fmt,
            use_smoothed=use_smoothed,
        )
    run = get_run(store, run_name)
    out = Path(out_path)
    summary_path = summary_path_for(out)
    for path in (out, summary_path):
        check_output(path, store.files)
    warnings = _run_warnings(run)
    provenance = _provenance(run)
    stats = _Stats()
    with db.read(store.engine) as conn:
        episodes = _selected(conn, run, min_reward, use_smoothed)
        eq8 = hcapo_weights(
            np.asarray([e["reward"] for e in episodes], dtype=np.float64),
            [e["q"] for e in episodes],
            omega,
            _groups(conn, episodes, group_by, warnings),
        )
        rows: Iterator[dict[str, Any]] = (
            stats.add(r) for r in _rows(conn, run, episodes, eq8.weights, eq8.grpo, min_reward)
        )
        if layout == "weights-in-messages":
            from hcapo_store.outputs.tokenized import with_message_weights

            rows = with_message_weights(rows)
        if fmt == "jsonl":
            atomic_write(out, lambda f: _write_jsonl(f, rows), inputs=store.files)
        else:
            config = {
                "omega": omega,
                "min_reward": min_reward,
                "use_smoothed": use_smoothed,
                "group_by": group_by,
                "layout": layout,
            }
            atomic_write(
                out,
                lambda f: _write_parquet(f, rows, {**provenance, "config": config}, weighted=layout != "steps"),
                inputs=store.files,
            )
    if stats.rows == 0:
        warnings.append(
            f"the dataset is empty: credit run {run.name!r} has no episode with reward >= "
            f"{min_reward} and a non-zero weight ({len(episodes)} credited episode(s) selected)"
        )
    summary = {
        "total_episodes_loaded": len(episodes),
        "episodes_in_dataset": stats.rows,
        "total_steps": stats.steps,
        "nonzero_steps": stats.nonzero,
        "advantage_stats": stats.as_dict(),
        "config": {
            "omega": omega,
            "min_reward": min_reward,
            "use_smoothed": use_smoothed,
            "group_by": group_by,
            "credits": run.name,
            "scorer_id": run.scorer_id,
            "credit_params": run.params,
            "format": fmt,
            "layout": layout,
        },
        "provenance": provenance,
        "warnings": warnings,
    }
    _write_json(summary_path, summary, store.files)
    return {"path": str(out), "summary_path": str(summary_path), **summary}


def summary_path_for(out: Path) -> Path:
    """One summary per output file: ``train.jsonl`` → ``train.jsonl.summary.json`` (the
    JSONL and Parquet exports of one stem no longer share one)."""
    return out.with_name(f"{out.name}.summary.json")


def _provenance(run: RunInfo) -> dict[str, Any]:
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


def _write_jsonl(f: IO[bytes], rows: Iterator[dict[str, Any]]) -> None:
    for row in rows:
        f.write(json.dumps(row, ensure_ascii=False).encode())
        f.write(b"\n")


def _parquet_schema(id_type: Any, weighted: bool = False) -> Any:
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


def _write_parquet(
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
    schema_for = schema or (lambda id_type: _parquet_schema(id_type, weighted))
    writer = None
    for batch in _batched(rows, PARQUET_BATCH):
        if writer is None:
            id_type = pa.int64() if isinstance(batch[0]["_episode_id"], int) else pa.string()
            writer = pq.ParquetWriter(f, schema_for(id_type).with_metadata(metadata))
        writer.write_table(pa.Table.from_pylist(batch, schema=writer.schema))
    if writer is None:
        writer = pq.ParquetWriter(f, schema_for(pa.int64()).with_metadata(metadata))
    writer.close()


def _batched(rows: Iterator[dict[str, Any]], n: int) -> Iterator[list[dict[str, Any]]]:
    while batch := list(itertools.islice(rows, n)):
        yield batch
