"""``score --top-k K``: the K most likely ids and their logprobs at every scored position.

After a scorer's logprobs are stored, each scored step's request is built again with the
scorer's own prompt builder (the same ids, the same scored span) and sent for its top-k;
the result is checked against the stored score (one row per scored token) and stored in
``topk_scores`` (``storage/topk.py``: int32 ids + float16 logprobs). K is part of the scorer
(``"top_k"`` in its spec), so a top-k run is a scorer of its own and its steps' top-k come
from exactly the model, template and span its logprobs do.

Backends: the in-process model (``score_positions(top_k=K)``: ``torch.topk`` of the
log-softmax of the same rows its logprobs gather from). The HTTP servers' top-k options
(SGLang ``top_logprobs_num``, vLLM ``prompt_logprobs`` K within its ``--max-logprobs``) are
not wired yet: ``score --top-k`` with ``--server`` is refused up front (docs/FAMILY.md).
The per-step layout only (the episode layout scores every step in one rendering).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text

from hcapo_store.errors import ScoringError
from hcapo_store.rendering.requests import PromptFailure, StepPrompt
from hcapo_store.scoring.job import Prepared, run_sync
from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store
from hcapo_store.storage.topk import TopK

MAX_TOP_K = 1024  # a bound on what one row may hold (K = 256 is the largest the family uses)

TODO_SQL = """
SELECT s.episode_id, s.step_index, sc.step_id, sc.token_count
FROM scores sc
JOIN steps s ON s.id = sc.step_id
JOIN episodes e ON e.id = s.episode_id
LEFT JOIN topk_scores t ON t.step_id = sc.step_id AND t.scorer_id = sc.scorer_id
WHERE sc.scorer_id = :scorer AND t.step_id IS NULL AND e.is_current IS TRUE{scope}
ORDER BY s.episode_id, s.step_index
"""


@dataclass
class TopkReport:
    k: int
    stored: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # "episode step N" -> why (the first 20)
    failed_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.k, "stored": self.stored, "failed": self.failed_count, "failures": self.failed}


def check_top_k(k: int, backend_kind: str) -> None:
    """Refuses a K or a backend before anything is sent."""
    if not 1 <= k <= MAX_TOP_K:
        raise ScoringError(f"--top-k must be in [1, {MAX_TOP_K}], got {k}")
    if backend_kind != "transformers":
        raise ScoringError(
            f"--top-k is not supported by the {backend_kind} backend yet (SGLang top_logprobs_num and vLLM "
            "prompt_logprobs are not wired): score top-k with --backend transformers --model DIR"
        )


async def _top(prep: Prepared, prompt: StepPrompt, k: int) -> list[list[tuple[int, float]]]:
    scorer = getattr(prep.backend, "scorer", None)
    if scorer is None:
        await prep.backend.start()
        scorer = getattr(prep.backend, "scorer", None)
    if scorer is None or not hasattr(scorer, "score_positions"):
        raise ScoringError(f"--top-k: the {getattr(prep.backend, 'kind', '?')} backend has no top-k")
    scores = await asyncio.to_thread(scorer.score_positions, prompt.input_ids, prompt.first_scored, top_k=k)
    return list(scores.top or [])


def score_topk(
    store: Store,
    prep: Prepared,
    k: int,
    *,
    filters: Filters | None = None,
    on_progress: Callable[[TopkReport], None] | None = None,
) -> TopkReport:
    """The top-k of every step the scorer scored (of the episodes ``filters`` selects) that has none yet."""
    return run_sync(lambda: score_topk_async(store, prep, k, filters=filters, on_progress=on_progress))


async def score_topk_async(
    store: Store,
    prep: Prepared,
    k: int,
    *,
    filters: Filters | None = None,
    on_progress: Callable[[TopkReport], None] | None = None,
) -> TopkReport:
    check_top_k(k, str(getattr(prep.backend, "kind", "?")))
    if prep.spec.get("top_k") != k:
        raise ScoringError(
            f"--top-k {k}: scorer {prep.scorer_id[:12]} was prepared with top_k {prep.spec.get('top_k')}"
        )
    if prep.builder.layout == "episode":
        raise ScoringError("--top-k takes the per-step layout (--prompt-layout per-step)")
    bind: dict[str, Any] = {"scorer": prep.scorer_id}
    scope = (filters or Filters()).sql(bind)
    with db.read(store.engine) as conn:
        todo = conn.execute(text(TODO_SQL.format(scope=scope)), bind).all()
    by_episode: dict[int, dict[int, tuple[int, int]]] = {}
    for ep, index, step_id, n in todo:
        by_episode.setdefault(int(ep), {})[int(index)] = (int(step_id), int(n))
    report = TopkReport(k)
    for ep_id, wanted in by_episode.items():
        with db.read(store.engine) as conn:
            episode = load_episode(conn, ep_id)
        steps = [s for s in episode.steps if s.step_index in wanted]
        rows = []
        for prompt in prep.builder.build_episode(episode.messages, episode.outcome, steps):
            step_id, n = wanted[prompt.step_index]
            if isinstance(prompt, PromptFailure):
                _fail(report, episode.name, prompt.step_index, f"{prompt.reason}: {prompt.message}")
                continue
            top = await _top(prep, prompt, k)
            if len(top) != n or any(len(row) != k for row in top):
                _fail(report, episode.name, prompt.step_index, f"{len(top)} top-k rows for the {n} stored logprobs")
                continue
            ids, values = TopK.of(top, k).encode()
            rows.append({"step": step_id, "scorer": prep.scorer_id, "k": k, "n": n, "ids": ids, "lp": values})
        if rows:
            with db.write(store.engine) as conn:
                conn.execute(
                    text(
                        "INSERT INTO topk_scores (step_id, scorer_id, k, token_count, ids, logprobs) "
                        "VALUES (:step, :scorer, :k, :n, :ids, :lp)"
                    ),
                    rows,
                )
            report.stored += len(rows)
        if on_progress is not None:
            on_progress(report)
    return report


def _fail(report: TopkReport, episode: str, index: int, why: str) -> None:
    report.failed_count += 1
    if len(report.failed) < 20:
        report.failed[f"{episode} step {index}"] = why
