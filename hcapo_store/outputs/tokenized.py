"""Token-level training rows of a credit run.

``export_tokenized`` writes one row per episode as the policy saw it (no hindsight block):
``token_ids`` of the conversation with the scorer's tokenizer and chat template (``turns``:
turn by turn as the policy produced it; ``whole``: one chat-template rendering), ``labels``
(-100 outside credited tokens) and per-token ``advantages`` (each credited step's Eq. 8
weight on the policy's own tokens of its action: never a role header or a wrapper the
template inserts). Where the spans come from and how they are checked:
``rendering/alignment.py``. A step whose own tokens are not in the rendering is refused
(``unaligned_steps`` with the reason; counted by kind in the summary), never moved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hcapo_store.credits.log_ratio import VARIANT as LOG_RATIO
from hcapo_store.credits.run_side import read_run_side
from hcapo_store.errors import ExportError
from hcapo_store.outputs.files import atomic_write, check_output
from hcapo_store.outputs.rows import (
    WrittenRows,
    add_signs,
    episode_ids,
    run_provenance,
    run_warnings,
    signal_warning,
    summary_path_for,
    write_json,
    write_jsonl,
    write_parquet,
)
from hcapo_store.outputs.topk import place as place_topk
from hcapo_store.outputs.topk import step_topk
from hcapo_store.rendering.alignment import RENDERINGS, Alignment, EpisodeRenderer, place_values
from hcapo_store.rendering.token_format import IGNORE_INDEX, TOKEN_IDS
from hcapo_store.rendering.tokenizers import content_sha256
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store
from hcapo_store.storage.token_values import step_token_advantages


def _row(
    ep: dict[str, Any],
    ep_id: int | str,
    grpo: float,
    weights: np.ndarray,
    al: Alignment,
    provenance: dict[str, Any],
    signed: bool,
    token_values: dict[int, np.ndarray] | None = None,
) -> dict[str, Any]:
    """``signed`` (paper): every placed step is trained with its advantage, negative or 0 too;
    otherwise only steps with a positive Eq. 8 weight get labels."""
    ids = al.input_ids
    labels = [IGNORE_INDEX] * len(ids)
    adv = [0.0] * len(ids)
    indices, msg_indices, step_w, spans = [], [], [], []
    for k, (index, m) in enumerate(zip(ep["step_indices"], ep["indices"])):
        if index not in al.spans:
            continue
        start, end = al.spans[index]
        w = round(float(weights[k]), 6)
        indices.append(index)
        msg_indices.append(m)
        step_w.append(w)
        spans.append([start, end])
        if w > 0 or signed:
            labels[start:end] = ids[start:end]
            per_token = None if token_values is None else token_values.get(index)
            adv[start:end] = [w] * (end - start) if per_token is None else [round(float(v), 6) for v in per_token]
    return {
        TOKEN_IDS: ids,
        "labels": labels,
        "advantages": adv,
        "episode": ep["name"],
        "_episode_id": ep_id,
        "step_indices": indices,
        "step_message_indices": msg_indices,
        "step_advantages": step_w,
        "step_spans": spans,
        "unaligned_steps": [{"step_index": i, "reason": r} for i, r in sorted(al.refused.items())],
        "_reward": ep["reward"],
        "_grpo_advantage": round(float(grpo), 6),
        "provenance": {**provenance, "flattened": al.flattened},
    }


class _Stats:
    def __init__(self) -> None:
        self.rows = self.steps = self.weighted_steps = self.refused = self.tokens = self.weighted_tokens = 0
        self.no_weight = 0  # all-zero Eq. 8 weights
        self.no_aligned_weight = 0  # weighted steps exist, but none could be placed
        self.reasons: dict[str, int] = {}
        self.signs = {"positive": 0, "negative": 0, "zero": 0}  # placed steps by the sign of their advantage

    def refuse(self, refused: dict[int, str]) -> None:
        self.refused += len(refused)
        for reason in refused.values():
            kind = reason.split(":", 1)[0]
            self.reasons[kind] = self.reasons.get(kind, 0) + 1

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        self.steps += len(row["step_indices"])
        # a paper run's advantages are signed: a negative one is weighted too (it was counted as not)
        self.weighted_steps += sum(1 for w in row["step_advantages"] if w != 0)
        add_signs(self.signs, row["step_advantages"])
        self.tokens += len(row[TOKEN_IDS])
        self.weighted_tokens += sum(1 for label in row["labels"] if label != IGNORE_INDEX)

    def dropped(self) -> dict[str, int]:
        return {
            k: v
            for k, v in (("all_zero_weights", self.no_weight), ("no_weighted_step_placed", self.no_aligned_weight))
            if v
        }


@dataclass(frozen=True)
class TokenizedExport(WrittenRows):
    """What ``export_tokenized`` (``export_dataset(layout="tokenized")``) wrote.

    ``summary()`` is the document in ``summary_path``; ``as_dict()`` (``export dataset
    --tokenized --json``) is the two paths followed by it.
    """

    total_episodes_loaded: int  # credited episodes with reward >= min_reward
    episodes_in_dataset: int  # rows written, one per episode
    aligned_steps: int  # steps placed on their own tokens in the written rows
    weighted_steps: int  # of them, steps with a non-zero advantage (an Eq. 8 weight > 0, a signed paper one)
    step_signs: dict[str, int]  # the placed steps by the sign of their advantage: positive, negative, zero
    signal: dict[str, Any] | None  # the run's hindsight signal (credits/signal.py): is Q_H in the advantages
    unaligned_steps: int  # steps refused (also in episodes left out)
    unaligned_reasons: dict[str, int]  # refusals by kind, sorted by kind
    episodes_without_weighted_tokens: int  # left out: the sum of ``episodes_dropped``
    episodes_dropped: dict[str, int]  # all_zero_weights / no_weighted_step_placed -> episodes (0s omitted)
    tokens: int  # tokens in the written rows
    weighted_tokens: int  # of them, tokens with a label
    config: dict[str, Any]  # what the rows were made with: omega, min_reward, run, rendering, tokenizer…
    provenance: dict[str, Any]  # the run, scorer and hcapo-store version
    warnings: list[str]  # a stale run, a group_by tag the episodes lack, an empty dataset


def export_tokenized(
    store: Store,
    out_path: Path | str,
    run_name: str | None = None,
    *,
    tokenizer: str | Path | None,
    omega: float | None = None,
    min_reward: float | None = None,
    group_by: str | None = None,
    fmt: str = "jsonl",
    use_smoothed: bool | None = None,
    rendering: str = "turns",
    on_progress: Callable[[int, int], None] | None = None,
    top_k: bool = False,
) -> TokenizedExport:
    """Token-level rows (see the module doc) + ``<out name>.summary.json``; returns what it wrote.

    ``tokenizer`` is the directory of the tokenizer the run's scorer used (checked against
    the scorer's fingerprint); None: where it was loaded before, if its files still match. Episodes with no weighted token are left out, as in the
    default export. ``rendering``: ``turns`` (the conversation as the policy produced it, turn
    by turn) or ``whole`` (one chat-template rendering); see ``rendering/alignment.py``.
    """
    if rendering not in RENDERINGS:
        raise ExportError(f"unknown rendering {rendering!r}: use one of {', '.join(RENDERINGS)}")
    if fmt not in ("jsonl", "parquet"):
        raise ExportError(f"unknown format {fmt!r}: use jsonl or parquet")
    out = Path(out_path)
    summary_path = summary_path_for(out)
    for path in (out, summary_path):
        check_output(path, store.files)
    notes: list[str] = []  # which tokenizer was taken, when none was given
    side = read_run_side(
        store,
        run_name,
        omega=omega,
        min_reward=min_reward,
        group_by=group_by,
        use_smoothed=use_smoothed,
        top_k=top_k,
        tokenizer=True,
        tokenizer_dir=tokenizer,
        note=notes.append,
    )
    run, rw, tok, fingerprint = side.run, side.weights, side.tokenizer, side.fingerprint or {}
    warnings = run_warnings(run)
    signal_warning(run, warnings)
    warnings.extend(notes)
    warnings.extend(side.weight_warnings)
    if top_k and not side.has_topk:
        raise ExportError(
            f"--top-k: the scorer of credit run {run.name!r} has no top-k: score with `hcapo-store score --top-k K` "
            "and compute the run over that scorer"
        )
    renderer = EpisodeRenderer(tok)
    stats = _Stats()
    episodes = rw.episodes
    provenance = {
        "credits": run.name,
        "run_hash": run.run_hash,
        "scorer_id": run.scorer_id,
        "tokenizer": fingerprint["name"],
        "tokenizer_files_sha256": fingerprint["files_sha256"],
        "chat_template_sha256": fingerprint["chat_template_sha256"],
        # what the ids depend on, not the files' bytes: a trainer's re-saved copy matches it
        "tokenizer_content_sha256": content_sha256(tok),
        "q": "q_h_smoothed" if rw.use_smoothed else "q_h",
        "omega": float(rw.omega),
        "rendering": rendering,
        "variant": run.variant,
    }
    ids = episode_ids(episodes)
    log_ratio = run.variant == LOG_RATIO
    with db.read(store.engine) as conn:

        def rows() -> Iterator[dict[str, Any]]:
            for i, ep in enumerate(episodes):
                if on_progress is not None:
                    on_progress(i + 1, len(episodes))
                if not rw.signed and not (rw.weights[i] > 0).any():
                    stats.no_weight += 1  # the original leaves all-zero episodes out
                    continue
                # a log-ratio run's per-token advantages, placed only on steps whose own tokens they cover
                per_token = step_token_advantages(conn, run.id, ep["id"]) if log_ratio else None
                al = renderer.align(
                    load_messages(conn, ep["id"]), list(zip(ep["step_indices"], ep["indices"])), rendering
                )
                if per_token is not None:
                    place_values(per_token, al.spans, al.refused)
                targets = None
                if top_k:  # the run's scorer's top-k on the same tokens (outputs/topk.py)
                    targets = place_topk(
                        len(al.input_ids), al.spans, al.refused, step_topk(conn, run.scorer_id, ep["id"])
                    )
                row = _row(ep, ids[i], rw.grpo[i], rw.weights[i], al, provenance, rw.signed, per_token)
                row.update(targets or {})
                stats.refuse(al.refused)  # also in episodes left out for having no weighted token
                if not any(label != IGNORE_INDEX for label in row["labels"]):
                    stats.no_aligned_weight += 1
                    continue
                stats.add(row)
                yield row

        if fmt == "jsonl":
            atomic_write(out, lambda f: write_jsonl(f, rows()), inputs=store.files)
        else:
            atomic_write(
                out,
                lambda f: write_parquet(
                    f, rows(), {**run_provenance(run), "layout": "tokenized"}, schema=_topk_schema if top_k else _schema
                ),
                inputs=store.files,
            )
    if stats.rows == 0:
        warnings.append(
            f"the dataset is empty: credit run {run.name!r} has no episode with reward >= "
            f"{rw.min_reward} and a weighted, aligned step ({len(episodes)} credited episode(s) selected)"
        )
    result = TokenizedExport(
        path=out,
        summary_path=summary_path,
        total_episodes_loaded=len(episodes),
        episodes_in_dataset=stats.rows,
        aligned_steps=stats.steps,
        weighted_steps=stats.weighted_steps,
        step_signs=stats.signs,
        signal=run.signal,
        unaligned_steps=stats.refused,
        unaligned_reasons=dict(sorted(stats.reasons.items())),
        episodes_without_weighted_tokens=stats.no_weight + stats.no_aligned_weight,
        episodes_dropped=stats.dropped(),
        tokens=stats.tokens,
        weighted_tokens=stats.weighted_tokens,
        config={
            **rw.config(),
            "variant": run.variant,
            "credits": run.name,
            "scorer_id": run.scorer_id,
            "credit_params": run.params,
            "format": fmt,
            "layout": "tokenized",
            "rendering": rendering,
            "tokenizer": str(getattr(tok, "name_or_path", None) or tokenizer),
        },
        provenance=run_provenance(run),
        warnings=warnings,
    )
    write_json(summary_path, result.summary(), store.files)
    return result


def _schema(id_type: Any) -> Any:
    import pyarrow as pa

    ints = pa.list_(pa.int64())
    unaligned = pa.list_(pa.struct([("step_index", pa.int64()), ("reason", pa.string())]))
    provenance = pa.struct(
        [
            (k, pa.string())
            for k in (
                "credits",
                "run_hash",
                "scorer_id",
                "tokenizer",
                "tokenizer_files_sha256",
                "chat_template_sha256",
                "tokenizer_content_sha256",
                "q",
                "rendering",
                "variant",
            )
        ]
        + [("omega", pa.float64()), ("flattened", pa.bool_())]
    )
    return pa.schema(
        [
            (TOKEN_IDS, ints),
            ("labels", ints),
            ("advantages", pa.list_(pa.float32())),
            ("episode", pa.string()),
            ("_episode_id", id_type),
            ("step_indices", ints),
            ("step_message_indices", ints),
            ("step_advantages", pa.list_(pa.float64())),
            ("step_spans", pa.list_(ints)),
            ("unaligned_steps", unaligned),
            ("_reward", pa.float64()),
            ("_grpo_advantage", pa.float64()),
            ("provenance", provenance),
        ]
    )


def _topk_schema(id_type: Any) -> Any:
    """``_schema`` with the ``--top-k`` columns (outputs/topk.py)."""
    import pyarrow as pa

    base = _schema(id_type)
    for name, kind in (
        ("topk_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("actual_logprobs", pa.list_(pa.float32())),
    ):
        base = base.append(pa.field(name, kind))
    return base
