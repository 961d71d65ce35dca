"""``score`` and ``scorers``: hindsight log-probabilities from a model."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from hcapo_store import formatting, worker_processes
from hcapo_store.cli.main import EXIT_INTERRUPTED, Ctx, Group, cli, echo_json, pass_ctx
from hcapo_store.cli.params import Device, FiniteFloat, ServerURL, apply_options, conversion_options, int_range
from hcapo_store.rendering.prompts import DEFAULT_MAX_LOGPROB_TOKENS
from hcapo_store.scoring import defaults

# What makes a scorer and how one process scores: shared by ``score`` and ``follow``.
SCORER_OPTIONS = [
    click.option(
        "--server",
        "servers",
        multiple=True,
        type=ServerURL(),
        metavar="URL",
        help="Inference server (SGLang /generate, or vLLM with --backend vllm). Repeat it for several servers of "
        "one model: each episode goes to one server (consistent hashing), moved to the others if it dies. "
        "Behind an SGLang router, give the router's URL once (its --policy manual keeps an episode on one worker).",
    ),
    click.option(
        "--backend",
        type=click.Choice(["sglang", "vllm", "transformers"]),
        default=None,
        help="Default: sglang with --server, transformers with --model and no --server.",
    ),
    click.option(
        "--device",
        type=Device(),
        metavar="cuda|cuda:N|cpu",
        help="Where --backend transformers runs the model. Default: the GPU when there is one, else the CPU.",
    ),
    click.option(
        "--dtype",
        type=click.Choice(defaults.DTYPES),
        help="What --backend transformers computes in. Default: the checkpoint's own on a GPU, float32 on the "
        "CPU. With the device type, part of the scorer: scores of two dtypes are two scorers.",
    ),
    click.option(
        "--cuda-graphs/--no-cuda-graphs",
        default=defaults.CUDA_GRAPHS,
        show_default=True,
        help="On a GPU (--backend transformers), replay each forward shape as a CUDA graph: one launch per "
        "forward, the same values (checked against the eager forward). Off: every forward eager, no graph "
        "memory pool.",
    ),
    click.option(
        "--model",
        metavar="NAME_OR_DIR",
        help="Model directory (transformers backend) or served model name (HTTP backends).",
    ),
    click.option("--tokenizer", metavar="DIR", help="Tokenizer directory (default: the model's / the server's)."),
    click.option("--api-key", envvar="HCAPO_API_KEY", help="Sent as a Bearer token (env HCAPO_API_KEY)."),
    click.option(
        "--concurrency",
        type=int_range(1, 1024),
        default=defaults.CONCURRENCY,
        show_default=True,
        help="Episodes in flight at once (each sends its steps in order).",
    ),
    click.option(
        "--prepare-workers",
        type=int_range(0, 256),
        default=None,
        help=f"Worker processes that load, render and tokenize the claimed episodes (0: threads of this "
        f"process, under its one GIL). Default: {defaults.PREPARE_PROCESSES} when --backend transformers "
        f"computes on a GPU, or against a server for a run of {defaults.PREPARE_PROCESSES_FROM_STEPS} steps or "
        "more on two CPUs or more (threads prepare while they start); else threads. The same requests, the same "
        "stored numbers.",
    ),
    click.option(
        "--max-context",
        type=int_range(2, 2**24),
        default=None,
        help="Most tokens per request: a longer prompt keeps its start (with the hindsight block), a "
        "truncation marker and the most recent history before the action. Default: 32768, or the "
        "server's input limit when that is smaller; a larger value than the server takes is refused.",
    ),
    click.option(
        "--max-logprob-tokens",
        type=int_range(),
        default=DEFAULT_MAX_LOGPROB_TOKENS,
        show_default=True,
        help="Score only the last N action tokens (<= 0: all).",
    ),
    click.option(
        "--hindsight-template",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="File with the hindsight block template (default: the original HINDSIGHT_TEMPLATE).",
    ),
    conversion_options(
        thinking_help="Score episodes ingested with these conversion options.",
        cut_help="Score episodes ingested with this tool-result cut (the ingest option of the same name).",
    ),
    click.option(
        "--max-attempts",
        type=int_range(1, 1000),
        default=defaults.MAX_ATTEMPTS,
        show_default=True,
        help="Attempts per step before it is marked failed.",
    ),
    click.option(
        "--lease-seconds",
        type=FiniteFloat(1, 7 * 86400),
        default=defaults.LEASE_SECONDS,
        show_default=True,
        help="How long a claimed step stays reserved without a heartbeat; then other workers may take it.",
    ),
    click.option("--worker-id", help="Name of this worker in the queue (default host:pid)."),
    click.option(
        "--max-new-tokens",
        type=click.IntRange(0, 1),
        default=defaults.MAX_NEW_TOKENS,
        show_default=True,
        help="1 for old SGLang servers that mishandle prefill-only requests.",
    ),
    click.option(
        "--request-timeout",
        type=FiniteFloat(0.1, 86400),
        default=defaults.REQUEST_TIMEOUT_S,
        show_default=True,
        metavar="SECONDS",
        help="Give up on one HTTP request after this long (retried as a timeout).",
    ),
    click.option(
        "--grouping",
        type=click.Choice(["grouped", "per-step"]),
        default=defaults.GROUPING,
        show_default=True,
        help="grouped: steps whose prompts are exact prefixes of one another (checked on the ids) share "
        "one request; per-step: one request per step. Same results either way.",
    ),
    click.option(
        "--truncation",
        type=click.Choice(["sliding", "window", "turns"]),
        default=defaults.TRUNCATION,
        show_default=True,
        help="Prompts over --max-context: sliding keeps the most recent tail per step (the original); "
        "window starts the tail at block boundaries so a window's steps share one request; turns "
        "renders the head and the most recent whole turns that fit. All three cost time linear in a "
        "long session's length (sliding and window: on bounded renders, checked against whole ones; "
        "window and turns are other scorers; docs/SCORING.md).",
    ),
    click.option(
        "--action-span",
        type=click.Choice(["rendered", "policy"]),
        default=defaults.ACTION_SPAN,
        show_default=True,
        help="Tokens whose logprobs make a step's mean: rendered = everything the chat template renders "
        "for the turn (the original's); policy = only the policy's own tokens and its end-of-turn token, "
        "never a header or a wrapper the template inserts (Qwen3's empty think block). A different scorer.",
    ),
    click.option(
        "--prompt-layout",
        type=click.Choice(["per-step", "episode"]),
        default=defaults.PROMPT_LAYOUT,
        show_default=True,
        help="per-step: a prompt per step, its hindsight block naming the step's subtask (the original). "
        "episode: one hindsight block per episode (the outcome) and the conversation rendered once, every "
        "step's own tokens scored where they stand in it, in windows when it exceeds --max-context: about "
        "1-2x the conversation's tokens instead of 26-51x. A different scorer (docs/SCORING.md).",
    ),
    click.option(
        "--no-hindsight",
        is_flag=True,
        help="Score the same prompts without the outcome block: the policy's π(a|s), a baseline scorer of its "
        "own for `diagnose --baseline` (never an estimator).",
    ),
    click.option(
        "--logprobs-mode",
        type=click.Choice(defaults.SCORABLE_LOGPROBS_MODES),
        default=defaults.LOGPROBS_MODE,
        show_default=True,
        help="The --logprobs-mode the vLLM server runs (--backend vllm; since vLLM #47680 prompt_logprobs follow "
        "it). A server that reports another mode is refused; a mode other than raw_logprobs is a scorer of its own.",
    ),
    click.option(
        "--weight-version",
        metavar="V",
        help="The policy's weight version the scores come from (online RL: e.g. the training step). Part of "
        "the scorer, so one credit run never mixes versions; refused when the server reports another "
        "(SGLang's weight_version). Default: the version the server reports, if any.",
    ),
]


scorer_options = apply_options(SCORER_OPTIONS)


def scorer_setup(
    *,
    servers,
    backend,
    model,
    tokenizer,
    api_key,
    concurrency,
    max_context,
    max_logprob_tokens,
    hindsight_template,
    include_thinking,
    max_tool_result_chars,
    max_attempts,
    lease_seconds,
    worker_id,
    max_new_tokens,
    request_timeout,
    grouping,
    truncation,
    action_span,
    prompt_layout,
    no_hindsight,
    weight_version,
    device=None,
    dtype=None,
    cuda_graphs=defaults.CUDA_GRAPHS,
    logprobs_mode=defaults.LOGPROBS_MODE,
    limit=None,
    prepare_workers=None,
) -> tuple[Any, Any]:
    """The ``ScoreConfig`` and ``RunOptions`` of the scorer options (checked before any I/O)."""
    from hcapo_store.scoring.job import default_backend

    if (device or dtype or not cuda_graphs) and (
        backend or default_backend(servers[0] if servers else None, model)
    ) != "transformers":
        raise click.UsageError(
            "--device, --dtype and --no-cuda-graphs choose how --backend transformers runs: a server decides its own"
        )
    if logprobs_mode != defaults.LOGPROBS_MODE and backend != "vllm":
        raise click.UsageError("--logprobs-mode is the vLLM server's (--backend vllm): other backends have none")
    if prompt_layout == "episode":
        context = click.get_current_context()
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("truncation", "action_span", "grouping")
            if context.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)
        ]
        if given:
            raise click.UsageError(
                f"{', '.join(given)} do(es) not apply to --prompt-layout episode: it scores each step's own "
                "tokens in one rendering of the conversation, in windows of --max-context; leave them out"
            )
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.scoring.job import ScoreConfig
    from hcapo_store.scoring.scheduler import RunOptions

    cfg = ScoreConfig(
        backend=backend,
        server=servers[0] if servers else None,
        servers=tuple(servers) if len(servers) > 1 else (),
        model=model,
        tokenizer=tokenizer,
        api_key=api_key,
        max_context=max_context,
        max_logprob_tokens=max_logprob_tokens,
        conversion=ConvertOptions(include_thinking=include_thinking, max_tool_result_chars=max_tool_result_chars),
        max_new_tokens=max_new_tokens,
        request_timeout=request_timeout,
        truncation=truncation,
        action_span=action_span,
        prompt_layout=prompt_layout,
        hindsight=not no_hindsight,
        weight_version=weight_version,
        device=device,
        dtype=dtype,
        cuda_graphs=cuda_graphs,
        logprobs_mode=logprobs_mode,
    )
    if hindsight_template and no_hindsight:
        raise click.UsageError("--hindsight-template and --no-hindsight contradict each other: pick one")
    if hindsight_template:
        try:
            cfg.hindsight_template = hindsight_template.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.BadParameter(
                f"{hindsight_template} is not UTF-8 text (byte {exc.start}): save the template as UTF-8",
                param_hint="--hindsight-template",
            ) from exc
    options = RunOptions(
        concurrency=concurrency,
        max_attempts=max_attempts,
        lease_seconds=lease_seconds,
        limit=limit,
        worker_id=worker_id,
        grouping=grouping,
        prepare_workers=prepare_workers,
    )
    return cfg, options


@cli.command(epilog="Reference: docs/SCORING.md in the hcapo-store repository.")
@scorer_options
@click.option(
    "--episode",
    "episodes",
    multiple=True,
    metavar="NAME",
    help="Only these episodes (repeatable): a name (pg-01/episode_001), its unambiguous end, or an id.",
)
@click.option("--min-reward", type=FiniteFloat(), help="Only episodes with reward >= X.")
@click.option("--limit", type=int_range(1), help="Score at most N steps in this run.")
@click.option("--retry-failed", is_flag=True, help="Requeue steps that failed in earlier runs.")
@click.option("--dry-run", is_flag=True, help="Count steps and prompt tokens; send nothing.")
@click.option(
    "--top-k",
    type=int_range(1),
    help="Also store the K most likely ids and logprobs at every scored position (a scorer of its own; "
    "SGLang, vLLM within its --max-logprobs, or in process; docs/FAMILY.md).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_ctx
def score(
    state: Ctx,
    episodes,
    top_k,
    min_reward,
    limit,
    retry_failed,
    dry_run,
    as_json,
    **scorer_kw,
) -> None:
    """Score every step that has no score yet under this scorer; safe to interrupt and rerun.

    The scorer is everything that determines the logprobs (model, tokenizer, templates,
    limits): the same options resume, different ones start a new scorer.
    """
    from hcapo_store.progress import Progress
    from hcapo_store.scoring.explain import why_nothing_to_score
    from hcapo_store.scoring.job import dry_run as run_dry
    from hcapo_store.scoring.job import prepare, run_scoring
    from hcapo_store.scoring.work_queue import Filters
    from hcapo_store.storage.episodes import resolve_episodes

    worker_processes.preload(worker_processes.PREPARE)
    # Options are checked (e.g. --worker-id) before anything touches the database.
    cfg, options = scorer_setup(**scorer_kw, limit=limit)
    if top_k:
        from hcapo_store.scoring.topk import check_top_k

        check_top_k(top_k, str(cfg.backend), cfg.prompt_layout)  # refused before any server or model is touched
        cfg.top_k = top_k
    grouping = options.grouping
    store = state.store(create=not dry_run)  # a dry run writes nothing, not even a new file
    from hcapo_store.storage.db import read as db_read

    with db_read(store.engine) as conn:  # before the model loads: a wrong --episode fails at once
        filters = Filters(episodes=resolve_episodes(conn, episodes), min_reward=min_reward)
    options = dataclasses.replace(options, filters=filters)
    prep = prepare(store, cfg)
    if top_k:
        from hcapo_store.scoring.job import run_sync
        from hcapo_store.scoring.topk import probe

        run_sync(lambda: probe(prep, top_k))  # a K above a vLLM server's --max-logprobs: refused here
    if dry_run:
        with Progress("dry run", enabled=not as_json, unit="steps") as progress:
            result = run_dry(store, prep, filters, limit, grouping=grouping, on_progress=progress.reach)
        reason = None if result.steps else why_nothing_to_score(store, prep.scorer_id, prep.spec["conversion"], filters)
        if as_json:
            echo_json({**result.__dict__, "reason": reason})
        else:
            click.echo(result.summary() + (f"\n{reason}" if reason else ""))
        return
    with Progress("score", enabled=not as_json, unit="steps") as progress:

        def on_progress(report) -> None:
            if progress.total is None and report.planned:
                progress.total = report.planned
            progress.set(failed=report.failed, prompt_tok_s=f"{report.prompt_tokens / max(progress.elapsed, 1e-9):.0f}")
            progress.reach(report.scored + report.failed)

        report = run_scoring(store, prep, options, retry_failed=retry_failed, on_progress=on_progress)
    extra = {}
    if top_k and not (report.interrupted or report.server_down):
        from hcapo_store.scoring.topk import score_topk

        topk = score_topk(store, prep, top_k, filters=filters)  # steps scored earlier without their top-k
        topk.stored += report.scored  # the scoring requests carried the top-k of every step they scored
        extra["top_k"] = topk.as_dict()
        if not as_json:
            click.echo(f"top-{top_k}: stored for {topk.stored} step(s), {topk.failed_count} failed")
        for where, why in topk.failed.items():
            click.echo(f"  top-k failed: {where}: {why}", err=True)
    reason = None
    if report.planned == 0 and not (report.scored or report.failed or report.interrupted):
        reason = why_nothing_to_score(store, prep.scorer_id, prep.spec["conversion"], filters)
    if as_json:
        echo_json({**report.as_dict(), "reason": reason, **extra})
    else:
        click.echo(f"scorer {prep.scorer_id[:12]}: {report.summary()}")
        if reason:
            click.echo(f"nothing to score: {reason}")
        _echo_score_errors(report, prep.scorer_id)
    if report.interrupted:
        sys.exit(EXIT_INTERRUPTED)
    if report.server_down:
        click.echo(
            f"error: {report.server_down}; the remaining steps stay pending: rerun `score` once the server is back",
            err=True,
        )
        sys.exit(1)
    if report.failed or extra.get("top_k", {}).get("failed"):
        sys.exit(1)


def _echo_score_errors(report, scorer_id: str) -> None:
    """Failed steps are never silent: the first distinct reasons, and where the rest are."""
    if not report.failed:
        return
    click.echo(f"{report.failed} step(s) failed for good; first distinct error(s):", err=True)
    for line in report.error_lines():
        click.echo(f"  {line}", err=True)
    query = (
        f"  all: hcapo-store sql \"SELECT last_error_kind, last_error FROM attempts WHERE status = 'failed' "
        f"AND scorer_id = '{scorer_id}'\""
    )
    if any(_refused_as_asked(kind) for kind, _ in report.first_errors):
        # The same request would be refused again: retrying cannot help, another scorer can.
        click.echo(
            f"{query}\n  the server refused these requests as they are (e.g. a prompt longer than it takes): "
            "--retry-failed would send the same requests again; score them with another scorer, "
            "e.g. a smaller --max-context",
            err=True,
        )
    elif any(kind == "context" for kind, _ in report.first_errors):
        # The same settings build the same prompts: only another --max-context changes them.
        click.echo(
            f"{query}\n  --retry-failed would build the same prompts: see the --max-context named above", err=True
        )
    else:
        click.echo(f"{query}; rerun with --retry-failed once fixed", err=True)


def _refused_as_asked(kind: str) -> bool:
    """A client error other than a timeout or rate limit: the request itself is what the server refuses."""
    return kind.startswith("http_4") and kind not in ("http_408", "http_429")


@cli.group(cls=Group, epilog="Reference: docs/SCORING.md in the hcapo-store repository.")
def scorers() -> None:
    """Scorers: each model/tokenizer/template/limits combination that has scores."""


@scorers.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def scorers_list(state: Ctx, as_json: bool) -> None:
    """List scorers with their counts (scored / failed / missing) and their spec."""
    from hcapo_store.scoring.scorer import computes_in, scorer_counts, scorer_spec

    store = state.store(create=False)
    rows = scorer_counts(store)
    if as_json:
        echo_json([{**r, "spec": scorer_spec(store, r["scorer_id"])} for r in rows])
        return
    if not rows:
        click.echo("no scorers yet: run `hcapo-store score`")
        return
    # The floor columns when some scorer has them; prefilled only when a server reported a cache
    # hit (otherwise it equals sent). --json always has every figure.
    floor = any(r["conversation_tokens"] for r in rows)
    cached = any(r["cached_tokens"] for r in rows)
    # what each model computes in (dtype@device), once some scorer's is other than float32 on the CPU
    precision = {r["scorer_id"]: computes_in(scorer_spec(store, r["scorer_id"])) for r in rows}
    dtype = any(p not in ("", "float32@cpu") for p in precision.values())
    columns = ["scorer", "label"] + (["dtype"] if dtype else []) + ["scored", "failed", "missing"]
    columns += (["floor", "sent"] if floor else []) + (["prefilled"] if cached else []) + ["created"]
    table = []
    for r in rows:
        line = [r["scorer_id"][:12], r["label"]] + ([precision[r["scorer_id"]]] if dtype else [])
        line += [r["scored"], r["failed"], r["missing"]]
        if floor:
            line += [r["conversation_tokens"] or "", _ratio(r["sent_per_floor"])]
        if cached:
            line.append(_ratio(r["prefilled_per_floor"]))
        table.append([*line, r["created_at"]])
    # whole labels in a pipe; a terminal squeezes them to what tells them apart
    click.echo(formatting.table(columns, table, max_width=None))
    if floor:
        note = "floor: conversation tokens of the fully scored episodes (each token once); sent: tokens sent, " + (
            "prefilled: sent minus the server's cached tokens, " if cached else ""
        )
        note += "as multiples of the floor"
        width = formatting.terminal_width()
        click.echo(click.wrap_text(note, width) if width else note)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"
