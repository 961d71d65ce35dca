"""Exports of a credit run: per-episode ``hindsight_scores.json`` and the Eq. 8 dataset.

Both stream from the database in episode order and write atomically (a temporary file in
the target directory, then ``os.replace``), so a reader never sees a half-written file.

Dataset rows are readable by the original trainer (docs/ORIGINAL.md §3). Parquet
stores ``messages`` as a list of structs {role, content, tool_calls, name, tool_call_id}
(absent keys are null; ``tool_calls[].function.arguments`` stays a JSON string), which
``datasets.load_dataset("parquet", ...)`` loads as a list of dicts without any decoding.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from hcapo_store.credits.equations import CreditParams
from hcapo_store.credits.lookup import RunInfo, get_run
from hcapo_store.credits.run_side import read_run_side
from hcapo_store.credits.weights import NO_MIN_REWARD, RunWeights, stream
from hcapo_store.errors import ExportError
from hcapo_store.outputs.files import atomic_write, check_output
from hcapo_store.outputs.rows import (
    WrittenRows,
    add_signs,
    episode_id_value,
    episode_ids,
    run_provenance,
    run_warnings,
    signal_warning,
    summary_path_for,
    write_json,
    write_jsonl,
    write_parquet,
)
from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.storage import db
from hcapo_store.storage.episodes import loader_message
from hcapo_store.storage.store import Store

if TYPE_CHECKING:  # the tokenized layout's module loads only when that layout is asked for
    from hcapo_store.outputs.tokenized import TokenizedExport

LAYOUTS = ("steps", "weights-in-messages", "tokenized")


HINDSIGHT_FILE = "hindsight_scores.json"
NAME_BYTES = 200  # below every common file system's 255-byte name limit, room for a ~idN suffix


def _safe_part(part: str) -> str:
    cleaned = re.sub(r"[\\\x00]", "_", part).strip()
    if cleaned in ("", ".", ".."):
        return "_"
    if cleaned == HINDSIGHT_FILE:  # a directory named like the file another episode writes
        return cleaned + "~"
    raw = cleaned.encode("utf-8", "surrogatepass")
    if len(raw) > NAME_BYTES:  # too long for a file name: cut, kept unique by a digest of the whole
        digest = hashlib.sha256(raw).hexdigest()[:12]
        cleaned = raw[: NAME_BYTES - 13].decode("utf-8", "ignore") + "~" + digest
    return cleaned


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


@dataclass(frozen=True)
class HindsightExport:
    """What ``export_hindsight_json`` wrote; ``as_dict()`` is its former dict."""

    run: str  # the credit run's name
    out_dir: Path
    episodes: int  # hindsight_scores.json files written, one per credited episode
    warnings: list[str]  # e.g. the run is stale

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "out_dir": str(self.out_dir), "episodes": self.episodes, "warnings": self.warnings}


def export_hindsight_json(store: Store, out_dir: Path | str, run_name: str | None = None) -> HindsightExport:
    """``out_dir/<episode name>/hindsight_scores.json`` for every episode the run credits
    (``out_dir/pg-01/episode_001/…``: the name's parts are directories)."""
    run = get_run(store, run_name)
    hyper = _hyperparams(run, store)
    out = Path(out_dir)
    check_output(out, store.files, directory=True)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a directory: pick another output directory")
    written = 0
    used: set[Path] = set()
    with db.read(store.engine) as conn:
        rows = stream(conn, HINDSIGHT_SQL, {"run": run.id, "scorer": run.scorer_id})
        for ep_id, group in itertools.groupby(rows, key=lambda r: r[0]):
            ep_rows = list(group)
            target = _episode_dir(out, ep_rows[0][1], ep_id, used)
            write_json(target / HINDSIGHT_FILE, _hindsight_doc(ep_rows, hyper), store.files)
            written += 1
    return HindsightExport(run.name, out, written, run_warnings(run))


# ---- Eq. 8 dataset --------------------------------------------------------------------------------


MESSAGES_SQL = """
SELECT m.episode_id, m.message_index, m.role, m.content, m.tool_calls, m.name, m.tool_call_id
FROM messages m
JOIN episodes e ON e.id = m.episode_id
WHERE e.reward >= :min_reward
  AND e.id IN (SELECT s.episode_id FROM credits c JOIN steps s ON s.id = c.step_id WHERE c.run_id = :run)
ORDER BY e.name, e.id, m.message_index
"""


def _rows(
    conn: Connection,
    run: RunInfo,
    rw: RunWeights,
    stats: _Stats,
    on_progress: Callable[[int, int], None] | None = None,
) -> Iterator[dict[str, Any]]:
    episodes, weights, grpo = rw.episodes, rw.weights, rw.grpo
    ids = episode_ids(episodes)
    by_id = {e["id"]: i for i, e in enumerate(episodes)}
    bound = NO_MIN_REWARD if rw.min_reward is None else rw.min_reward
    msgs = stream(conn, MESSAGES_SQL, {"run": run.id, "min_reward": bound})
    for done, (ep_id, group) in enumerate(itertools.groupby(msgs, key=lambda r: r[0]), 1):
        if on_progress is not None:
            on_progress(done, len(episodes))
        i = by_id[ep_id]
        w = weights[i]
        if not rw.signed and not (w > 0).any():  # the original drops rows whose weights are all 0
            stats.dropped_all_zero += 1
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
        self.rows = self.steps = self.nonzero = self.dropped_all_zero = 0
        self.signs = {"positive": 0, "negative": 0, "zero": 0}  # steps by the sign of their advantage
        self.total = self.nonzero_total = 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        w = row["step_advantages"]
        self.rows += 1
        self.steps += len(w)
        nz = [x for x in w if x != 0]  # a paper run's advantages are signed: negative ones are weighted too
        self.nonzero += len(nz)
        add_signs(self.signs, w)
        self.total += sum(w)
        self.nonzero_total += sum(nz)
        self.min = min(w) if self.min is None else min(self.min, min(w))
        self.max = max(w) if self.max is None else max(self.max, max(w))
        return row

    def dropped_reasons(self) -> dict[str, dict[str, Any]]:
        """Selected episodes the file leaves out, by reason (the original drops them silently)."""
        if not self.dropped_all_zero:
            return {}
        return {
            "all_zero_weights": {
                "episodes": self.dropped_all_zero,
                "reason": "every step's Eq. 8 weight is 0 (max(A_i + omega * micro, 0) = 0: a below-average "
                "episode whose steps' hindsight terms do not lift it above 0), so the row would train on nothing",
            }
        }

    def advantage_stats(self) -> dict[str, float]:
        return {
            "min": self.min or 0.0,
            "max": self.max or 0.0,
            "mean": self.total / self.steps if self.steps else 0.0,
            "nonzero_mean": self.nonzero_total / self.nonzero if self.nonzero else 0.0,
        }


@dataclass(frozen=True)
class DatasetExport(WrittenRows):
    """What ``export_dataset`` wrote in the ``steps`` and ``weights-in-messages`` layouts.

    ``summary()`` is the document in ``summary_path``; ``as_dict()`` (``export dataset
    --json``) is the two paths followed by it.
    """

    total_episodes_loaded: int  # credited episodes with reward >= min_reward
    episodes_in_dataset: int  # rows written, one per episode
    episodes_dropped: dict[str, dict[str, Any]]  # reason -> {"episodes": n, "reason": why}
    total_steps: int  # steps in the written rows
    nonzero_steps: int  # of them, steps with a non-zero advantage (an Eq. 8 weight > 0, a signed paper one)
    step_signs: dict[str, int]  # the written steps by the sign of their advantage: positive, negative, zero
    signal: dict[str, Any] | None  # the run's hindsight signal (credits/signal.py): is Q_H in the advantages
    advantage_stats: dict[str, float]  # min, max, mean, nonzero_mean of the written weights
    config: dict[str, Any]  # what the weights were computed with: omega, min_reward, run, format, layout…
    provenance: dict[str, Any]  # the run, scorer and hcapo-store version
    warnings: list[str]  # a stale run, a group_by tag the episodes lack, an empty dataset


def export_dataset(
    store: Store,
    out_path: Path | str,
    run_name: str | None = None,
    *,
    omega: float | None = None,
    min_reward: float | None = None,
    group_by: str | None = None,
    fmt: str = "jsonl",
    use_smoothed: bool | None = None,
    layout: str = "steps",
    tokenizer: str | Path | None = None,
    rendering: str = "turns",
    on_progress: Callable[[int, int], None] | None = None,
    top_k: bool = False,
) -> DatasetExport | TokenizedExport:
    """Eq. 8 rows (one per episode) + ``<out name>.summary.json``; returns what it wrote
    (a ``TokenizedExport`` for the ``tokenized`` layout, else a ``DatasetExport``).

    ``layout``: ``steps`` (the original's rows), ``weights-in-messages`` (the same rows with a
    ``"weight"`` on each credited assistant message) or ``tokenized`` (token-level rows, see
    ``hcapo_store.outputs.tokenized``; needs ``tokenizer``, the scorer's tokenizer directory).
    ``omega``, ``min_reward``, ``group_by``, ``use_smoothed``: None = the credit run's own,
    whose stored advantages are then written as they are (``credits/weights.py``'s ``run_weights``).
    ``warnings`` says what the caller should know: a stale run, a ``group_by``
    tag the episodes lack, an empty dataset. ``on_progress(done, total)``: after each episode.
    ``top_k`` (tokenized only): the run's scorer's top-k per token (``outputs/topk.py``).
    """
    if fmt not in ("jsonl", "parquet"):
        raise ExportError(f"unknown format {fmt!r}: use jsonl or parquet")
    if layout not in LAYOUTS:
        raise ExportError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if layout == "tokenized":
        from hcapo_store.outputs.tokenized import export_tokenized

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
            rendering=rendering,
            on_progress=on_progress,
            top_k=top_k,
        )
    if top_k:
        raise ExportError("top_k (--top-k) goes with the tokenized layout (--tokenized)")
    out = Path(out_path)
    summary_path = summary_path_for(out)
    for path in (out, summary_path):
        check_output(path, store.files)
    side = read_run_side(
        store, run_name, omega=omega, min_reward=min_reward, group_by=group_by, use_smoothed=use_smoothed
    )
    run, rw = side.run, side.weights
    with db.read(store.engine) as conn:  # the episodes' messages, streamed as the rows are written
        warnings = run_warnings(run)
        signal_warning(run, warnings)
        warnings.extend(side.weight_warnings)
        provenance = run_provenance(run)
        stats = _Stats()
        episodes = rw.episodes
        rows: Iterator[dict[str, Any]] = (stats.add(r) for r in _rows(conn, run, rw, stats, on_progress))
        if layout == "weights-in-messages":
            from hcapo_store.outputs.rows import with_message_weights

            rows = with_message_weights(rows)
        if fmt == "jsonl":
            atomic_write(out, lambda f: write_jsonl(f, rows), inputs=store.files)
        else:
            config = {**rw.config(), "layout": layout}
            atomic_write(
                out,
                lambda f: write_parquet(f, rows, {**provenance, "config": config}, weighted=layout != "steps"),
                inputs=store.files,
            )
    if stats.rows == 0:
        warnings.append(
            f"the dataset is empty: credit run {run.name!r} has no episode with reward >= "
            f"{rw.min_reward} and a non-zero weight ({len(episodes)} credited episode(s) selected)"
        )
    result = DatasetExport(
        path=out,
        summary_path=summary_path,
        total_episodes_loaded=len(episodes),
        episodes_in_dataset=stats.rows,
        episodes_dropped=stats.dropped_reasons(),
        total_steps=stats.steps,
        nonzero_steps=stats.nonzero,
        step_signs=stats.signs,
        signal=run.signal,
        advantage_stats=stats.advantage_stats(),
        config={
            **rw.config(),
            "variant": run.variant,
            "credits": run.name,
            "scorer_id": run.scorer_id,
            "credit_params": run.params,
            "format": fmt,
            "layout": layout,
        },
        provenance=provenance,
        warnings=warnings,
    )
    write_json(summary_path, result.summary(), store.files)
    return result
