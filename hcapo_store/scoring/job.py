"""The ``score`` service: choose the backend and tokenizer, fix the scorer identity,
queue the missing steps, and run the scheduler (or count the work for ``--dry-run``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from hcapo_store.errors import InferenceError, ScoringError
from hcapo_store.ingestion.sources import ConvertOptions
from hcapo_store.masking import mask_url
from hcapo_store.rendering import verify
from hcapo_store.rendering.prompts import (
    DEFAULT_MAX_CONTEXT,
    DEFAULT_MAX_LOGPROB_TOKENS,
    HINDSIGHT_TEMPLATE,
    PROMPT_BUILDER_VERSION,
    PROMPT_LAYOUTS,
    ActionSpan,
    PromptBuilder,
    PromptLayout,
    Truncation,
    check_hindsight_template,
    layout_template,
    template_hash,
)
from hcapo_store.rendering.requests import PromptFailure
from hcapo_store.rendering.template import TemplateRejected, render_by_rule
from hcapo_store.rendering.tokenizers import given_or_loaded, tokenizer_fingerprint
from hcapo_store.scoring import defaults, work_queue
from hcapo_store.scoring.backends.base import Backend
from hcapo_store.scoring.fingerprint import PROBE_MESSAGES, library_versions, rendering_fingerprint
from hcapo_store.scoring.grouping import Grouping, plan_requests
from hcapo_store.scoring.preparing import BuilderRecipe, PreparePool, default_prepare_workers, shared_pool
from hcapo_store.scoring.results import fallback_text
from hcapo_store.scoring.scheduler import RunOptions, Scheduler, ScoreReport
from hcapo_store.scoring.scorer import register, remember_tokenizer, scorer_id, scorer_label
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store

T = TypeVar("T")


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
    # None: DEFAULT_MAX_CONTEXT, or the server's input limit when that is smaller (prepare resolves it)
    max_context: int | None = None
    max_logprob_tokens: int = DEFAULT_MAX_LOGPROB_TOKENS
    hindsight_template: str = HINDSIGHT_TEMPLATE
    conversion: ConvertOptions = field(default_factory=ConvertOptions)
    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    # vLLM's --logprobs-mode the scorer declares (anything but raw_logprobs is a scorer of its own;
    # a server that reports another mode is refused)
    logprobs_mode: str = defaults.LOGPROBS_MODE
    # The in-process model (--backend transformers): cpu, cuda, cuda:N (None: the GPU when there
    # is one) and bfloat16/float16/float32 (None: the checkpoint's own on a GPU, float32 on CPU).
    device: str | None = None
    dtype: str | None = None
    # On a GPU, each forward shape replayed as a CUDA graph (scoring/graphs.py): the same values
    # (checked against the eager forward), so not part of the scorer.
    cuda_graphs: bool = defaults.CUDA_GRAPHS
    request_timeout: float | None = defaults.REQUEST_TIMEOUT_S  # seconds per HTTP request; None: the same
    truncation: Truncation = defaults.TRUNCATION  # or "window"/"turns" (other prompts: part of the scorer)
    action_span: ActionSpan = defaults.ACTION_SPAN  # or "policy": only the policy's own tokens are scored
    hindsight: bool = True  # False: the same prompts without the outcome, π(a|s) (a baseline scorer)
    # "episode": the conversation rendered once per episode, every step scored in place
    # (rendering/episode_layout.py); its own scorer. truncation/action_span/grouping do not apply.
    prompt_layout: PromptLayout = defaults.PROMPT_LAYOUT
    # The policy's weights (online RL): part of the scorer, so one credit run never mixes versions.
    # None: the version the server reports (SGLang's weight_version), if any besides "default".
    weight_version: str | None = None
    # Every server when there are several (``server`` is then the first): episodes spread over
    # them by consistent hashing, moved when one dies (backends/multi.py).
    servers: tuple[str, ...] = ()
    # K most likely ids and logprobs per scored position (scoring/topk.py); 0: none. Part of the scorer.
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.servers and self.server is None:
            self.server = self.servers[0]
        if self.server is not None and self.servers and self.server not in self.servers:
            self.servers = (self.server, *self.servers)
        if self.backend is None:
            self.backend = default_backend(self.server, self.model)


def _http_timeout(cfg: ScoreConfig) -> httpx.Timeout | None:
    if cfg.request_timeout is None:
        return None
    return httpx.Timeout(cfg.request_timeout, connect=min(cfg.request_timeout, 10.0))


def make_backend(cfg: ScoreConfig) -> Backend:
    if len(cfg.servers) > 1:
        if cfg.backend == "transformers":
            raise ScoringError("--backend transformers scores in this process: it takes no --server")
        from hcapo_store.scoring.backends.multi import MultiServerBackend

        backends = [make_backend(dataclasses.replace(cfg, server=url, servers=())) for url in cfg.servers]
        return MultiServerBackend(backends, [mask_url(url) for url in cfg.servers])
    if cfg.backend == "transformers":
        if not cfg.model:
            raise ScoringError("--backend transformers needs --model DIR (a local transformers model)")
        from hcapo_store.scoring.backends.inprocess import InProcessBackend

        return InProcessBackend(cfg.model, device=cfg.device, dtype=cfg.dtype, cuda_graphs=cfg.cuda_graphs)
    if not cfg.server:
        raise ScoringError(f"--backend {cfg.backend} needs --server URL (e.g. http://127.0.0.1:30000)")
    if cfg.backend == "sglang":
        from hcapo_store.scoring.backends.sglang import SGLangBackend

        return SGLangBackend(
            cfg.server,
            model=cfg.model,
            api_key=cfg.api_key,
            max_new_tokens=cfg.max_new_tokens,
            timeout=_http_timeout(cfg),
        )
    if cfg.backend == "vllm":
        from hcapo_store.scoring.backends.vllm import VLLMBackend

        return VLLMBackend(
            cfg.server,
            model=cfg.model,
            api_key=cfg.api_key,
            logprobs_mode=cfg.logprobs_mode,
            timeout=_http_timeout(cfg),
        )
    raise ScoringError(f"unknown backend {cfg.backend!r}: choose sglang, vllm or transformers")


def _reported(backend: Backend) -> dict[str, Any]:
    reported = getattr(backend, "reported", None)
    facts = reported() if reported is not None else None
    return {"server": facts} if facts else {}


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
        "(the same tokenizer the server uses)"
    )


@dataclass
class Prepared:
    scorer_id: str
    spec: dict[str, Any]
    backend: Backend
    builder: PromptBuilder
    tokenizer_dir: str | None = None  # where the tokenizer was loaded from (remembered at registration)
    # the builder's keyword arguments: worker processes that prepare requests make it again (preparing.py)
    builder_options: dict[str, Any] | None = None


async def _start(cfg: ScoreConfig, backend: Backend, *, close: bool = False) -> None:
    try:
        await backend.start()
        if close:  # prepare() only reads the server's facts; run_scoring() starts it again
            await backend.close()
    except InferenceError as exc:
        where = ", ".join(mask_url(s) for s in cfg.servers) or mask_url(cfg.server or cfg.model or "")
        raise ScoringError(f"cannot reach the {cfg.backend} backend at {where}: {exc}; is the server up?") from exc


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run(make())``; inside a running event loop (a notebook), in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(1, thread_name_prefix="hcapo-sync") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def prepare(
    store: Store, cfg: ScoreConfig, backend: Backend | None = None, *, loaded_tokenizer: Any = None
) -> Prepared:
    """Start the backend, load the tokenizer and build the scorer spec (writes nothing:
    ``run_scoring`` registers the scorer, so a dry run leaves the database as it was).
    ``backend``: one built by the caller (e.g. ``LiveModelBackend`` over the policy being
    trained) instead of the one ``cfg`` names. ``loaded_tokenizer``: the tokenizer already
    loaded from ``cfg.tokenizer`` (e.g. kept across a trainer's steps), used as it is instead of
    loading it again; it is read, never changed.

    Works inside a running event loop too (it then runs in a worker thread); from async
    code, ``await prepare_async(store, cfg)`` instead.
    """
    _check_template(cfg)
    backend = backend or make_backend(cfg)
    run_sync(lambda: _start(cfg, backend, close=cfg.backend != "transformers"))
    return _prepared(store, cfg, backend, loaded_tokenizer)


async def prepare_async(store: Store, cfg: ScoreConfig) -> Prepared:
    """``prepare`` for async code (e.g. a notebook cell: ``prep = await prepare_async(store, cfg)``)."""
    _check_template(cfg)
    backend = make_backend(cfg)
    await _start(cfg, backend, close=cfg.backend != "transformers")
    return _prepared(store, cfg, backend)


def _check_template(cfg: ScoreConfig) -> None:
    """A bad hindsight template is refused before any server is contacted."""
    if cfg.prompt_layout not in PROMPT_LAYOUTS:
        raise ScoringError(f"unknown prompt layout {cfg.prompt_layout!r}: use one of {', '.join(PROMPT_LAYOUTS)}")
    try:
        check_hindsight_template(layout_template(cfg.hindsight_template, cfg.prompt_layout), cfg.prompt_layout)
    except ValueError as exc:
        raise ScoringError(f"--hindsight-template: {exc}") from exc


def resolved_max_context(asked: int | None, limit: int | None) -> int:
    """The prompt budget: what was asked, refused before anything is sent when the server takes
    less; when nothing was asked, the default or the server's limit, whichever is smaller (the
    default stays the scorer users resume when their server takes more)."""
    if asked is None:
        return min(DEFAULT_MAX_CONTEXT, limit) if limit else DEFAULT_MAX_CONTEXT
    if limit is not None and asked > limit:
        raise ScoringError(
            f"--max-context {asked} is more than the server accepts ({limit} input tokens): "
            f"pass --max-context {limit} or less, or leave it out to use the server's limit"
        )
    return asked


def _prepared(store: Store, cfg: ScoreConfig, backend: Backend, loaded_tokenizer: Any = None) -> Prepared:
    max_context = resolved_max_context(cfg.max_context, backend.context_length())
    location = _tokenizer_location(cfg, backend)
    # the fingerprint hashes the directory's files beside a given object's template: they must be one tokenizer
    tokenizer = given_or_loaded(location, loaded_tokenizer, ScoringError)
    options: dict[str, Any] = dict(
        hindsight_template=cfg.hindsight_template,
        max_context=max_context,
        max_logprob_tokens=cfg.max_logprob_tokens,
        truncation=cfg.truncation,
        action_span=cfg.action_span if cfg.prompt_layout == "per-step" else "rendered",
        hindsight=cfg.hindsight,
        layout=cfg.prompt_layout,
    )
    builder = PromptBuilder(tokenizer, **options)
    spec: dict[str, Any] = {
        "backend": backend.identity(),
        "tokenizer": tokenizer_fingerprint(tokenizer, location),
        "hindsight_template_sha256": template_hash(builder.hindsight_template),
        "conversion": cfg.conversion.episode_columns(),  # compaction is ingest's: not a scorer's
        "max_context": max_context,
        "max_logprob_tokens": cfg.max_logprob_tokens,
        "prompt_builder_version": PROMPT_BUILDER_VERSION,
        "rendering_sha256": rendering_fingerprint(builder),
        # recorded, not part of the id: the libraries, and what the server reports of itself
        # where it is not part of the backend's identity (SGLang: backends/sglang.py, reported)
        "provenance": {"libraries": library_versions(), **_reported(backend)},
    }
    computes_in = getattr(backend, "computes_in", None)
    if callable(computes_in) and computes_in():  # dtype and device type, even where not in the id
        spec["provenance"]["computes_in"] = computes_in()
    if cfg.prompt_layout != "per-step":  # only when set: the default keeps existing scorer ids
        spec["prompt_layout"] = cfg.prompt_layout
    elif cfg.truncation != "sliding":
        spec["truncation"] = cfg.truncation
    if cfg.action_span != "rendered" and cfg.prompt_layout == "per-step":
        spec["action_span"] = cfg.action_span
    if not cfg.hindsight:  # a baseline: no outcome, so the hindsight template plays no part
        spec["hindsight"] = False
        del spec["hindsight_template_sha256"]
    if cfg.top_k:  # only when asked: other scorers keep their ids
        spec["top_k"] = cfg.top_k
        # each scoring request carries the top-k too (one request per step or episode: scoring/topk.py)
        for each in getattr(backend, "backends", None) or [backend]:
            each.top_k = cfg.top_k
    version = weight_version(cfg.weight_version, backend)
    if version is not None:  # only when there is one: other scorers keep their ids
        spec["weight_version"] = version
    return Prepared(
        scorer_id=scorer_id(spec),
        spec=spec,
        backend=backend,
        builder=builder,
        tokenizer_dir=str(location),
        builder_options=options,
    )


UNVERSIONED = (None, "default")  # SGLang reports "default" until weights are updated with a version


def weight_version(asked: str | None, backend: Backend) -> str | None:
    """The weight version the scores will come from: the one asked for, checked against what
    the backend reports (refused before anything is sent when they differ), else the reported one."""
    report = getattr(backend, "weight_version", None)
    reported = report() if callable(report) else None
    if asked is not None and reported not in UNVERSIONED and str(reported) != asked:
        raise ScoringError(
            f"--weight-version {asked} is not what the {backend.kind} backend serves (weight version "
            f"{reported!r}): score with --weight-version {reported} or update the server's weights first"
        )
    if asked is not None:
        return asked
    return None if reported in UNVERSIONED else str(reported)


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
    # Steps with more history than --max-context (their prompt keeps only part of it), and
    # whether some long session's steps each rendered their whole conversation again (per-step
    # `sliding` / `window` when a bounded render could not stand in for it: time grows with
    # the square of a session's steps).
    truncated_steps: int = 0
    quadratic_in_session: bool = False
    # fast rendering strategies that disagreed with their rule while planning (rendering/verify.py)
    strategy_fallbacks: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        text = (
            f"dry run for scorer {self.scorer_id[:12]} ({self.label}): {self.steps} step(s) in "
            f"{self.episodes} episode(s) to score, {self.requests} request(s) of {self.prompt_tokens} "
            f"prompt tokens ({self.scored_tokens} scored), {self.prompt_failures} prompt failure(s); "
            "nothing was sent"
        )
        text += f"\n{fallback_text(self.strategy_fallbacks)}"
        if self.truncated_steps and self.quadratic_in_session:
            text += (
                f"\nnote: {self.truncated_steps} step(s) have more history than --max-context, and for some "
                "sessions this chat template's prompts could only be made by rendering each step's whole "
                "conversation again, so preparing them takes time that grows with the square of their length: "
                "--truncation turns or --prompt-layout episode grow linearly with any template (other scorers; "
                "docs/SCORING.md)"
            )
        return text


def dry_run(
    store: Store,
    prep: Prepared,
    filters: work_queue.Filters,
    limit: int | None,
    *,
    grouping: Grouping = "grouped",
    on_progress: Callable[[int, int], None] | None = None,
) -> DryRun:
    """Count the steps, requests and prompt tokens a run would send; writes nothing, calls
    nothing. ``on_progress(steps planned, steps in all)`` after each episode."""
    conv = prep.spec["conversion"]
    rows = work_queue.unscored_steps(
        store,
        prep.scorer_id,
        include_thinking=conv["include_thinking"],
        max_tool_result_chars=conv["max_tool_result_chars"],
        filters=filters,
        limit=limit,
    )
    whole_before = prep.builder.whole_history_episodes
    fallbacks_before = verify.fallbacks()
    with db.read(store.engine) as conn:
        by_episode: dict[int, set[int]] = {}
        for ep, idx in rows:
            by_episode.setdefault(ep, set()).add(idx)
        requests = tokens = scored = failures = truncated = planned = 0
        for ep, wanted in by_episode.items():
            episode = load_episode(conn, ep)
            steps = [s for s in episode.steps if s.step_index in wanted]
            for r in plan_requests(prep.builder, episode.messages, episode.outcome, steps, grouping=grouping):
                if isinstance(r, PromptFailure):
                    failures += 1
                else:
                    requests += 1
                    tokens += len(r.input_ids)
                    scored += sum(m.scored_tokens for m in r.members)
                    truncated += sum(1 for m in r.members if m.truncated_prefix_tokens)
            planned += len(steps)
            if on_progress is not None:
                on_progress(planned, len(rows))
    return DryRun(
        prep.scorer_id,
        scorer_label(prep.spec),
        len(rows),
        len(by_episode),
        requests,
        tokens,
        scored,
        failures,
        truncated,
        prep.builder.whole_history_episodes > whole_before,
        verify.since(fallbacks_before),
    )


async def check_vocabulary(prep: Prepared) -> None:
    """Refuse a tokenizer the server does not use, before any step is sent: its highest id
    must be one the model has (otherwise every step fails with the server's HTTP 400), and a
    probe text must come out of the server's own tokenizer as the same ids (a tokenizer of
    another vocabulary whose ids all fit would otherwise score every step, silently wrong)."""
    check = getattr(prep.backend, "check_token_id", None)
    if check is None:  # a backend that cannot tell
        return
    tokenizer = prep.builder.tokenizer
    top = prep.builder.top_token_id
    try:
        reason = await check(top)
    except InferenceError as exc:
        raise ScoringError(f"cannot reach the {prep.backend.kind} backend: {exc}; is the server up?") from exc
    if reason is not None:
        name = prep.spec["tokenizer"]["name"]
        raise ScoringError(
            f"tokenizer {name!r} ({len(tokenizer)} tokens) does not match the model: the backend "
            f"rejects its token id {top} ({reason[:300]}); pass --tokenizer with the served model's "
            "tokenizer"
        )
    await check_server_tokenizer(prep)


def probe_text(tokenizer: Any) -> str:
    """A text to compare two tokenizers on: the fingerprint's probe conversation as this
    tokenizer's chat template renders it (its special tokens, reasoning and tool-call markup,
    non-ASCII letters, runs of spaces), else the conversation's plain text."""
    try:  # apply_chat_template itself: the check runs through no fast strategy
        return render_by_rule(tokenizer, PROBE_MESSAGES, generation=False)
    except TemplateRejected:
        return "\n".join(str(m["content"]) for m in PROBE_MESSAGES)


async def check_server_tokenizer(prep: Prepared) -> None:
    """The probe text through the server's own tokenization (``/tokenize``, or SGLang's
    ``/generate`` with text) must give the ids our tokenizer gives it. A server that cannot
    tokenize (no tokenizer loaded) is left to the highest-id check."""
    read = getattr(prep.backend, "server_tokens", None)
    if read is None:
        return
    loads_from = getattr(prep.backend, "loads_tokenizer_from", None)  # in process: its model directory
    if loads_from is not None and prep.tokenizer_dir is not None and loads_from(prep.tokenizer_dir):
        return  # the very tokenizer it would compare against: no second load
    text = probe_text(prep.builder.tokenizer)
    try:
        got = await read(text)
    except InferenceError as exc:
        raise ScoringError(f"cannot reach the {prep.backend.kind} backend: {exc}; is the server up?") from exc
    if got is None:
        return
    theirs, special = got
    ours = list(prep.builder.tokenizer(text, add_special_tokens=special)["input_ids"])
    if ours == theirs:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    name = prep.spec["tokenizer"]["name"]
    served = getattr(prep.backend, "tokenizer_path", lambda: None)() or "its model's tokenizer"
    where = getattr(prep.backend, "display_url", None) or prep.backend.kind
    raise ScoringError(
        f"tokenizer {name!r} is not the one the {prep.backend.kind} server at {where} uses ({served!r}): "
        f"a probe text is {len(ours)} ids with ours and {len(theirs)} with the server's, first different at "
        f"id {at} ({_id_at(ours, at)} vs {_id_at(theirs, at)}); nothing was sent to score: pass --tokenizer "
        "with the served model's tokenizer"
    )


def _id_at(ids: list[int], i: int) -> str:
    return str(ids[i]) if i < len(ids) else "the end"


def run_scoring(
    store: Store,
    prep: Prepared,
    options: RunOptions,
    *,
    retry_failed: bool = False,
    on_progress: Callable[[ScoreReport], None] | None = None,
) -> ScoreReport:
    """Queue every unscored step of the scorer (of the episodes ``options.filters`` selects) and
    score them; returns the run's report.

    Works inside a running event loop too (it then runs in a worker thread and blocks that
    loop until done); from async code, ``await run_scoring_async(...)`` instead.
    """
    return run_sync(lambda: run_scoring_async(store, prep, options, retry_failed=retry_failed, on_progress=on_progress))


def _prepare_pool(store: Store, prep: Prepared, options: RunOptions, pending: int) -> PreparePool | None:
    """The worker processes that prepare this run's requests (``options.prepare_workers``; None:
    ``default_prepare_workers``, by the ``pending`` steps to score), or None: threads of this process."""
    workers = options.prepare_workers
    if workers is None:
        workers = default_prepare_workers(prep.backend, pending)
    if workers < 1 or prep.tokenizer_dir is None or prep.builder_options is None:
        return None
    return shared_pool(store.url, BuilderRecipe.of(prep.tokenizer_dir, prep.builder_options, prep.builder), workers)


async def run_scoring_async(
    store: Store,
    prep: Prepared,
    options: RunOptions,
    *,
    retry_failed: bool = False,
    on_progress: Callable[[ScoreReport], None] | None = None,
) -> ScoreReport:
    """``run_scoring`` for async code: ``report = await run_scoring_async(store, prep, options)``."""
    conv = prep.spec["conversion"]
    # steps to score, counted up to what decides the default's worker processes (0: nothing new)
    limit = defaults.PREPARE_PROCESSES_FROM_STEPS
    pending = len(work_queue.unscored_steps(store, prep.scorer_id, **conv, filters=options.filters, limit=limit))
    await prep.backend.start()  # idempotent: reopens an HTTP client closed by prepare()
    pool = _prepare_pool(store, prep, options, pending)
    scheduler = Scheduler(
        store, prep.scorer_id, prep.backend, prep.builder, options, on_progress=on_progress, pool=pool
    )
    try:
        if retry_failed or pending:
            await check_vocabulary(prep)  # before anything is written
        register(store, prep.spec)
        if prep.tokenizer_dir is not None:
            remember_tokenizer(store, prep.spec["tokenizer"]["files_sha256"], prep.tokenizer_dir)
        work_queue.enqueue(store, prep.scorer_id, **conv, filters=options.filters)  # the run's episodes only
        if retry_failed:
            work_queue.requeue_failed(store, prep.scorer_id, options.filters)
        return await scheduler.run()
    finally:
        await prep.backend.close()
