"""The ``score`` service: choose the backend and tokenizer, fix the scorer identity,
queue the missing steps, and run the scheduler (or count the work for ``--dry-run``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


from hcapo_store.scoring import work_queue
from hcapo_store.scoring.backends.base import Backend
from hcapo_store.storage.episodes import load_episode
from hcapo_store.errors import InferenceError, ScoringError
from hcapo_store.scoring.prompts import (DEFAULT_MAX_CONTEXT, DEFAULT_MAX_LOGPROB_TOKENS, HINDSIGHT_TEMPLATE,
                                 PROMPT_BUILDER_VERSION, PromptBuilder, PromptFailure, Truncation,
                                 template_hash)
from hcapo_store.scoring.grouping import Grouping, group_prompts
from hcapo_store.scoring.runner import RunOptions, Scheduler, ScoreReport
from hcapo_store.scoring.identity import register, scorer_label
from hcapo_store.ingestion.sources import ConvertOptions
from hcapo_store.storage.store import Store
from hcapo_store.scoring.tokens import load_tokenizer, tokenizer_fingerprint


def default_backend(server: str | None, model: str | None) -> str:
    """In process when only a model directory is given; SGLang whenever there is a server."""
    return "transformers" if model and not server else "sglang"


@dataclass
class ScoreConfig:
    backend: str | None = None  # sglang | transformers | vllm; None: default_backend(server, model)
    server: str | None = None
    model: str | None = None  # served model name (HTTP) or model directory (transformers)
    tokenizer: str | None = None
    api_key: str | None = None
    max_context: int = DEFAULT_MAX_CONTEXT
    max_logprob_tokens: int = DEFAULT_MAX_LOGPROB_TOKENS
    hindsight_template: str = HINDSIGHT_TEMPLATE
    conversion: ConvertOptions = field(default_factory=ConvertOptions)
    max_new_tokens: int = 0
    device: str = "cpu"
    truncation: Truncation = "sliding"  # or "window" (changes the prompts: part of the scorer)

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = default_backend(self.server, self.model)


def make_backend(cfg: ScoreConfig) -> Backend:
    if cfg.backend == "transformers":
        if not cfg.model:
            raise ScoringError("--backend transformers needs --model DIR (a local transformers model)")
        from hcapo_store.scoring.backends.inprocess import InProcessBackend

        return InProcessBackend(cfg.model, device=cfg.device)
    if not cfg.server:
        raise ScoringError(f"--backend {cfg.backend} needs --server URL (e.g. http://127.0.0.1:30000)")
    if cfg.backend == "sglang":
        from hcapo_store.scoring.backends.sglang import SGLangBackend

        return SGLangBackend(cfg.server, model=cfg.model, api_key=cfg.api_key, max_new_tokens=cfg.max_new_tokens)
    if cfg.backend == "vllm":
        from hcapo_store.scoring.backends.vllm import VLLMBackend

        return VLLMBackend(cfg.server, model=cfg.model, api_key=cfg.api_key)
    raise ScoringError(f"unknown backend {cfg.backend!r}: choose sglang, vllm or transformers")


def _tokenizer_location(cfg: ScoreConfig, backend: Backend) -> str:
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.backend == "transformers":
        return str(cfg.model)
    reported = getattr(backend, "tokenizer_path", lambda: None)()
    if reported and Path(reported).is_dir():
        return reported
    raise ScoringError(
        f"the server reports tokenizer {reported!r}, which is not a directory here: pass --tokenizer DIR "
        "(the same tokenizer the server uses)")


@dataclass
class Prepared:
    scorer_id: str
    spec: dict[str, Any]
    backend: Backend
    builder: PromptBuilder


async def _start(cfg: ScoreConfig, backend: Backend, *, close: bool = False) -> None:
    try:
        await backend.start()
        if close:  # prepare() only reads the server's facts; run_scoring() starts it again
            await backend.close()
    except InferenceError as exc:
        where = cfg.server or cfg.model
        raise ScoringError(f"cannot reach the {cfg.backend} backend at {where}: {exc}; is the server up?") from exc


def prepare(store: Store, cfg: ScoreConfig) -> Prepared:
    """Start the backend, load the tokenizer, build the scorer spec and register the scorer."""
    backend = make_backend(cfg)
    asyncio.run(_start(cfg, backend, close=cfg.backend != "transformers"))
    ctx = backend.context_length()
    if ctx is not None and ctx < cfg.max_context:
        raise ScoringError(f"the server's context length is {ctx} < --max-context {cfg.max_context}: "
                           f"pass --max-context {ctx} or less")
    location = _tokenizer_location(cfg, backend)
    try:
        tokenizer = load_tokenizer(location)
    except (OSError, ValueError) as exc:
        raise ScoringError(f"cannot load tokenizer {location}: {exc}") from exc
    builder = PromptBuilder(tokenizer, hindsight_template=cfg.hindsight_template, max_context=cfg.max_context,
                            max_logprob_tokens=cfg.max_logprob_tokens, truncation=cfg.truncation)
    spec = {
        "backend": backend.identity(),
        "tokenizer": tokenizer_fingerprint(tokenizer, location),
        "hindsight_template_sha256": template_hash(cfg.hindsight_template),
        "conversion": cfg.conversion.as_dict(),
        "max_context": cfg.max_context,
        "max_logprob_tokens": cfg.max_logprob_tokens,
        "prompt_builder_version": PROMPT_BUILDER_VERSION,
    }
    if cfg.truncation != "sliding":  # only when set: the default keeps existing scorer ids
        spec["truncation"] = cfg.truncation
    return Prepared(scorer_id=register(store, spec), spec=spec, backend=backend, builder=builder)


@dataclass
class DryRun:
    scorer_id: str
    label: str
    steps: int
    episodes: int
    requests: int
    prompt_tokens: int
    scored_tokens: int
    prompt_failures: int

    def summary(self) -> str:
        return (f"dry run for scorer {self.scorer_id[:12]} ({self.label}): {self.steps} step(s) in "
                f"{self.episodes} episode(s) to score, {self.requests} request(s) of {self.prompt_tokens} "
                f"prompt tokens ({self.scored_tokens} scored), {self.prompt_failures} prompt failure(s); "
                "nothing was sent")


def dry_run(store: Store, prep: Prepared, filters: work_queue.Filters, limit: int | None, *,
            grouping: Grouping = "grouped") -> DryRun:
    """Count the steps, requests and prompt tokens a run would send; writes nothing, calls nothing."""
    conv = prep.spec["conversion"]
    rows = work_queue.unscored_steps(store, prep.scorer_id, include_thinking=conv["include_thinking"],
                                max_tool_result_chars=conv["max_tool_result_chars"], filters=filters, limit=limit)
    with store.engine.connect() as conn:
        by_episode: dict[int, set[int]] = {}
        for ep, idx in rows:
            by_episode.setdefault(ep, set()).add(idx)
        requests = tokens = scored = failures = 0
        for ep, wanted in by_episode.items():
            episode = load_episode(conn, ep)
            prompts = prep.builder.build_episode(episode.messages, episode.outcome,
                                                 [s for s in episode.steps if s.step_index in wanted])
            for r in group_prompts(prompts, grouping=grouping, max_tokens=prep.builder.max_context):
                if isinstance(r, PromptFailure):
                    failures += 1
                else:
                    requests += 1
                    tokens += len(r.input_ids)
                    scored += sum(m.scored_tokens for m in r.members)
    return DryRun(prep.scorer_id, scorer_label(prep.spec), len(rows), len(by_episode), requests, tokens, scored,
                  failures)


def run_scoring(store: Store, prep: Prepared, options: RunOptions, *, retry_failed: bool = False,
                on_progress: Callable[[ScoreReport], None] | None = None) -> ScoreReport:
    """Queue every unscored step of the scorer and score them; returns the run's report."""
    conv = prep.spec["conversion"]
    work_queue.enqueue(store, prep.scorer_id, include_thinking=conv["include_thinking"],
                  max_tool_result_chars=conv["max_tool_result_chars"])
    if retry_failed:
        work_queue.requeue_failed(store, prep.scorer_id, options.filters)
    scheduler = Scheduler(store, prep.scorer_id, prep.backend, prep.builder, options, on_progress=on_progress)

    async def main() -> ScoreReport:
        await prep.backend.start()  # idempotent: reopens an HTTP client closed by prepare()
        try:
            return await scheduler.run()
        finally:
            await prep.backend.close()

    return asyncio.run(main())
