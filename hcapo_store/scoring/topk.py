"""``score --top-k K``: the K most likely ids and their logprobs at every scored position.

The scoring request itself carries them: ``prepare`` sets the backend's ``top_k`` and every
request (one per step, a group's, or the episode layout's one per episode) asks for the
logprobs and the top-k together; the scheduler checks one row of K per scored token and the
writer stores them in ``topk_scores`` (``storage/topk.py``: int32 ids + float16 logprobs) in
the transaction of their score. K is part of the scorer (``"top_k"`` in its spec), so a top-k
run is a scorer of its own and its steps' top-k come from exactly the model, template and span
its logprobs do.

Backends: the in-process model (the same forward: ``torch.topk`` of the log-softmax of the rows
its logprobs are taken from), vLLM (``prompt_logprobs: K``: each position's entries by their
rank, beside the sampled token's own entry, which gives the stored logprob) and SGLang
(``top_logprobs_num: K`` with ``return_logprob``: ``input_top_logprobs`` beside
``input_token_logprobs``). vLLM caps K at its ``--max-logprobs`` (default 20): ``probe`` asks
once before anything is scored and refuses with the server's cap named.

``score_topk`` is for steps a scorer stored without their top-k (an earlier version sent a
second request per step): it builds each such step's request again (per-step layout) and asks
for the top-k alone.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text

from hcapo_store.errors import InferenceError, ScoringError
from hcapo_store.rendering.requests import PromptFailure, StepPrompt
from hcapo_store.scoring.job import Prepared, run_sync
from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store
from hcapo_store.storage.topk import TopK

TOPK_BACKENDS = ("transformers", "vllm", "sglang")
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


def check_top_k(k: int, backend_kind: str, layout: str = "per-step") -> None:
    """Refuses a K or a backend before anything is sent (either prompt layout: the top-k come
    with the scoring request, whatever it covers)."""
    if not 1 <= k <= MAX_TOP_K:
        raise ScoringError(f"--top-k must be in [1, {MAX_TOP_K}], got {k}")
    if backend_kind not in TOPK_BACKENDS:
        raise ScoringError(
            f"--top-k is not supported by the {backend_kind} backend: "
            "score top-k with --backend sglang or vllm --server URL, or --backend transformers --model DIR"
        )


async def probe(prep: Prepared, k: int) -> None:
    """vLLM: one two-token request with ``prompt_logprobs: k`` before any scoring, so a K above
    the server's ``--max-logprobs`` is refused up front with the cap named."""
    if getattr(prep.backend, "kind", None) != "vllm":
        return
    backend: Any = prep.backend
    opened = backend.client is None
    if opened:
        await backend.start()
    try:
        await backend.client.post_json("/v1/completions", _vllm_payload(backend, [0, 0], 1, k))
    except InferenceError as exc:
        cap = re.search(r"greater than max allowed: (\d+)", str(exc))
        if cap:
            raise ScoringError(
                f"--top-k {k} is above the vLLM server's --max-logprobs {cap.group(1)}: ask for at most "
                f"{cap.group(1)}, or restart vLLM with --max-logprobs {k}"
            ) from exc
        raise ScoringError(f"--top-k {k}: the vLLM server refused prompt_logprobs {k}: {exc}") from exc
    finally:
        if opened:
            await backend.close()


def _vllm_payload(backend: Any, ids: list[int], first_scored: int, k: int) -> dict[str, Any]:
    from hcapo_store.scoring.backends.vllm import build_payload

    return build_payload(
        StepPrompt(0, ids, first_scored, len(ids) - first_scored, 0, 0, False), model=backend.model, prompt_logprobs=k
    )


def vllm_top(prompt: StepPrompt, body: Any, k: int) -> list[list[tuple[int, float]]]:
    """Each scored position's K most likely (id, logprob) from a vLLM ``prompt_logprobs: K``
    answer (an entry holds the top K by rank plus the sampled token when it is not among them)."""
    from hcapo_store.scoring.backends.vllm import parse_response, vllm_ranked

    parse_response(prompt, body)  # the same checks as the logprobs' own request (ids, counts, values)
    return vllm_ranked(prompt, body, k)


def sglang_top(prompt: StepPrompt, body: Any, k: int) -> list[list[tuple[int, float]]]:
    """Each scored position's K most likely (id, logprob) from SGLang's ``input_top_logprobs``
    (aligned with ``input_token_logprobs``: entry 0 null, then one list of K
    ``[logprob, id, text]`` triples per scored position)."""
    from hcapo_store.scoring.backends.sglang import parse_response, sglang_entries

    parse_response(prompt, body)  # the same checks as the logprobs' own request
    return sglang_entries(prompt, body, k)


async def _top(prep: Prepared, prompt: StepPrompt, k: int) -> list[list[tuple[int, float]]]:
    if getattr(prep.backend, "kind", None) == "sglang":
        from hcapo_store.scoring.backends.sglang import build_payload

        sglang: Any = prep.backend
        if sglang.client is None:
            await sglang.start()
        payload = {**build_payload(prompt, max_new_tokens=sglang.max_new_tokens), "top_logprobs_num": k}
        return sglang_top(prompt, await sglang.client.post_json("/generate", payload), k)
    if getattr(prep.backend, "kind", None) == "vllm":
        backend: Any = prep.backend
        if backend.client is None:
            await backend.start()
        body = await backend.client.post_json(
            "/v1/completions", _vllm_payload(backend, list(prompt.input_ids), prompt.first_scored, k)
        )
        return vllm_top(prompt, body, k)
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
    check_top_k(k, str(getattr(prep.backend, "kind", "?")), prep.builder.layout)
    if prep.spec.get("top_k") != k:
        raise ScoringError(
            f"--top-k {k}: scorer {prep.scorer_id[:12]} was prepared with top_k {prep.spec.get('top_k')}"
        )
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
        if prep.builder.layout == "episode":  # one rendering for every step: not rebuilt per step here
            for index in sorted(wanted):
                _fail(
                    report,
                    episode.name,
                    index,
                    "scored without its top-k; the episode layout's top-k comes "
                    "with its scoring request only: score these steps again under a new scorer",
                )
            continue
        steps = [s for s in episode.steps if s.step_index in wanted]
        rows = []
        for prompt in prep.builder.build_episode(episode.messages, episode.outcome, steps):
            step_id, n = wanted[prompt.step_index]
            if isinstance(prompt, PromptFailure):
                _fail(report, episode.name, prompt.step_index, f"{prompt.reason}: {prompt.message}")
                continue
            try:
                top = await _top(prep, prompt, k)
            except InferenceError as exc:
                _fail(report, episode.name, prompt.step_index, str(exc))
                continue
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
    if getattr(prep.backend, "kind", None) in ("vllm", "sglang"):
        await prep.backend.close()
    return report


def _fail(report: TopkReport, episode: str, index: int, why: str) -> None:
    report.failed_count += 1
    if len(report.failed) < 20:
        report.failed[f"{episode} step {index}"] = why
