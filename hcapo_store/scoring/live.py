"""HCAPO's own setting: the policy being trained scores its own rollouts, in process.

    from hcapo_store.scoring.live import score_live
    report = score_live(store, model, tokenizer="/models/Qwen3-8B", weight_version="step-12",
                        episodes=names_of_this_batch)

The scores go to the scorer of (this model name, this weight version, the prompt options), so
a credit run over it (``compute_credits(store, scorer=report.scorer_id)``) holds one version
only. Nothing is sent anywhere; the model is used where it is (its device, its dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hcapo_store.rendering.prompts import PromptLayout
from hcapo_store.scoring import defaults
from hcapo_store.scoring.backends.inprocess import LiveModelBackend
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions, ScoreReport
from hcapo_store.scoring.scorer import scorer_label
from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage import db
from hcapo_store.storage.episodes import resolve_episodes
from hcapo_store.storage.store import Store


@dataclass
class LiveReport:
    scorer_id: str
    label: str
    weight_version: str
    report: ScoreReport


def score_live(
    store: Store,
    model: Any,
    *,
    tokenizer: str,
    weight_version: str,
    episodes: Sequence[str] | None = None,
    max_context: int | None = None,
    max_logprob_tokens: int | None = None,
    action_span: str = "rendered",
    name: str | None = None,
    prompt_layout: PromptLayout = defaults.PROMPT_LAYOUT,
    concurrency: int = defaults.CONCURRENCY,
    hindsight: bool = True,
    prepare_workers: int | None = None,
    cuda_graphs: bool = defaults.CUDA_GRAPHS,
    loaded_tokenizer: Any = None,
) -> LiveReport:
    """Score the missing steps of ``episodes`` (names; None: all) with ``model`` at
    ``weight_version``. ``tokenizer``: the model's tokenizer directory. ``concurrency``
    episodes are in flight: the next ones are rendered and prepared while the model runs the
    current forward (one model thread; short requests share a forward on a GPU).
    ``hindsight=False``: the same prompts without the outcome (``score --no-hindsight``), e.g.
    the student of a log-ratio run.
    ``prepare_workers``: processes that render and tokenize them (None: two when the model is
    on a GPU, so its kernel launches do not wait on this process's GIL; threads on a CPU; 0:
    threads). Their pool is kept for the next call with the same store and tokenizer.
    ``cuda_graphs``: on a GPU, each forward shape is replayed as a CUDA graph kept with the model
    for the next calls (scoring/graphs.py; the same values, its memory pool held until
    ``graphs.release(model)``).
    ``loaded_tokenizer``: the tokenizer already loaded from ``tokenizer`` (a trainer keeps one
    across its steps: ``rendering.tokenizers.KeptTokenizer``), used as it is instead of loading
    it again (read, never changed)."""
    if episodes is not None and not episodes:
        raise ValueError("episodes is empty: pass the batch's episode names, or None for every episode")
    backend = LiveModelBackend(model, weight_version=weight_version, name=name, cuda_graphs=cuda_graphs)
    extra: dict[str, Any] = {}
    if max_logprob_tokens is not None:
        extra["max_logprob_tokens"] = max_logprob_tokens
    cfg = ScoreConfig(
        backend=LiveModelBackend.kind,
        tokenizer=tokenizer,
        max_context=max_context,
        action_span=action_span,  # type: ignore[arg-type]
        weight_version=str(weight_version),
        prompt_layout=prompt_layout,
        hindsight=hindsight,
        **extra,
    )
    prep = prepare(store, cfg, backend, loaded_tokenizer=loaded_tokenizer)
    keys: tuple[str, ...] = ()
    if episodes is not None:
        with db.read(store.engine) as conn:
            keys = resolve_episodes(conn, list(episodes))
    options = RunOptions(
        concurrency=concurrency,
        filters=Filters(episodes=keys) if episodes is not None else Filters(),
        prepare_workers=prepare_workers,
    )
    report = run_scoring(store, prep, options)
    return LiveReport(prep.scorer_id, scorer_label(prep.spec), str(weight_version), report)
