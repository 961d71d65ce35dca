"""hcapo-store command line: thin Click commands over the ``hcapo_store`` library.

Each command parses options, calls the library, and prints. Library errors
(``HcapoError``) become one-line messages here, in one place (``_Group.invoke``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

# Only light modules at the top: `--help` must not pay for SQLAlchemy, Alembic, numpy or
# transformers (tests/test_cli.py checks). Commands import what they use.
from hcapo_store import formatting
from hcapo_store.errors import HcapoError
from hcapo_store.storage.location import DEFAULT_DB, ENV_DB

if TYPE_CHECKING:
    from hcapo_store.storage.store import Store

EXIT_INTERRUPTED = 130


class _Group(click.Group):
    """Maps library errors to clean messages (exit 1) and Ctrl-C to exit 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HcapoError as exc:
            raise click.ClickException(str(exc)) from exc
        except click.NoSuchOption as exc:
            if exc.option_name == "--db" and exc.ctx is not None:
                root, _, rest = exc.ctx.command_path.partition(" ")
                # a new error, not a changed one: click declares ``message`` Final
                raise click.NoSuchOption(
                    exc.option_name,
                    possibilities=exc.possibilities,
                    ctx=exc.ctx,
                    message=(
                        f"No such option '--db' here: --db is a global option, given before the command: "
                        f"{root} --db PATH_OR_URL {rest}"
                    ),
                ) from exc
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)


class _Ctx:
    """Holds the --db location; opens the store only for commands that need it."""

    def __init__(self, db: str | None) -> None:
        self.db = db
        self._store: Store | None = None

    def store(self, *, create: bool = True) -> Store:
        if self._store is None:
            from hcapo_store.storage.store import Store

            self._store = Store.open(self.db, create=create)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


pass_ctx = click.make_pass_decorator(_Ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    envvar=ENV_DB,
    metavar="PATH_OR_URL",
    default=None,
    help=f"SQLite file or database URL (env {ENV_DB}; default ./{DEFAULT_DB}).",
)
@click.version_option(package_name="hcapo-store")
@click.pass_context
def cli(ctx: click.Context, db: str | None) -> None:
    """Keep agent trajectories, hindsight logprobs and HCAPO credits in SQL.

    Typical flow: ingest → score → credits compute → sql / export.
    """
    state = _Ctx(db)
    ctx.obj = state
    ctx.call_on_close(state.close)


def _echo_json(data: Any) -> None:
    click.echo(formatting.dumps(data))


def _warn(warnings: list[str]) -> None:
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


# ---------------------------------------------------------------------------
# database


@cli.command()
@pass_ctx
def init(state: _Ctx) -> None:
    """Create a new database (or confirm an existing one is current)."""
    from hcapo_store.storage import db as dbmod

    store = state.store(create=True)
    click.echo(f"{store.display}: schema at revision {dbmod.current_revision(store.engine)} (head)")


@cli.group(cls=_Group)
def db() -> None:
    """Schema version of the database: show it, upgrade it."""


@db.command("current")
@pass_ctx
def db_current(state: _Ctx) -> None:
    """Print the database's schema revision and the head this version needs."""
    from hcapo_store.storage import db as dbmod

    url = dbmod.resolve_url(state.db)
    engine = dbmod.make_engine(url)
    try:
        current = dbmod.current_revision(engine)
    finally:
        engine.dispose()
    head = dbmod.head_revision()
    click.echo(
        f"{dbmod.display_url(url)}: {current or 'empty'} (head {head})"
        + ("" if current == head else " — run `hcapo-store db upgrade`")
    )


@db.command("upgrade")
@click.option("--no-backup", is_flag=True, help="Skip the SQLite backup copy taken before upgrading.")
@pass_ctx
def db_upgrade(state: _Ctx, no_backup: bool) -> None:
    """Upgrade the database schema to this version's head (backs up SQLite files first)."""
    from hcapo_store.storage import db as dbmod

    result = dbmod.upgrade_database(state.db, take_backup=not no_backup)
    if not result.changed:
        click.echo(f"{result.url}: already at head {result.head}")
        return
    if result.backup:
        click.echo(f"backup: {result.backup}")
    click.echo(f"{result.url}: {result.before or 'empty'} → {result.head}")


# ---------------------------------------------------------------------------
# ingest / status / sql


def _parse_tags(values: tuple[str, ...]) -> dict[str, str]:
    tags = {}
    for v in values:
        if "=" not in v or not v.split("=", 1)[0]:
            raise click.BadParameter(f"{v!r}: expected KEY=VALUE", param_hint="--tag")
        k, val = v.split("=", 1)
        tags[k.strip()] = val.strip()
    return tags


@cli.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--include-thinking/--no-thinking",
    default=True,
    show_default=True,
    help="Keep the assistant's thinking as <think>…</think> in its message.",
)
@click.option(
    "--max-tool-result-chars",
    type=int,
    default=4000,
    show_default=True,
    help="Cut tool results longer than this (the original's suffix is added); 0 = never.",
)
@click.option(
    "--tag",
    "tags",
    multiple=True,
    metavar="KEY=VALUE",
    help="Label the ingested episodes (repeatable), e.g. --tag task=postgres --tag run=pg-01.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_ctx
def ingest(
    state: _Ctx,
    paths: tuple[Path, ...],
    include_thinking: bool,
    max_tool_result_chars: int,
    tags: tuple[str, ...],
    as_json: bool,
) -> None:
    """Add episodes: episode directories, trajectory roots (episode_* dirs) or JSONL files.

    Unchanged episodes are skipped; changed ones become a new version. One bad file never
    stops the batch; the exit status is 1 when any episode failed, 130 when interrupted.
    """
    from hcapo_store.ingestion.pipeline import ingest as run_ingest
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.progress import EpisodeProgress

    store = state.store()
    options = ConvertOptions(include_thinking=include_thinking, max_tool_result_chars=max_tool_result_chars)
    with EpisodeProgress("ingest", enabled=not as_json) as progress:
        report = run_ingest(store, list(paths), options=options, tags=_parse_tags(tags), on_episode=progress.advance)
    if as_json:
        _echo_json(report.as_dict())
    else:
        for source, error in report.failures:
            click.echo(f"failed: {error}" if source in error else f"failed: {source}: {error}", err=True)
        for name, warning in report.warning_list[:5]:
            click.echo(f"warning: {name}: {warning}", err=True)
        click.echo(report.summary())
    if report.interrupted:
        sys.exit(EXIT_INTERRUPTED)
    if report.failed:
        sys.exit(1)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def status(state: _Ctx, as_json: bool) -> None:
    """Counts of episodes, steps, subtasks; per scorer scored / failed / missing; workers."""
    from hcapo_store.storage.status import status as get_status

    data = get_status(state.store(create=False))
    if as_json:
        _echo_json(data)
        return
    click.echo(f"database     {data['database']}")
    click.echo(f"episodes     {data['episodes']} (+{data['superseded_versions']} superseded versions)")
    phases = ", ".join(f"{k} {v}" for k, v in data["steps_by_phase"].items())
    click.echo(f"steps        {data['steps']}" + (f" ({phases})" if phases else ""))
    click.echo(f"messages     {data['messages']}")
    click.echo(f"subtasks     {data['subtasks']}")
    click.echo(f"credit runs  {data['credit_runs']}")
    if not data["scorers"]:
        click.echo(f"scorers      none yet: scored 0 / failed 0 / missing {data['steps']}")
    for s in data["scorers"]:
        click.echo(
            f"scorer {s['scorer_id'][:12]}  {s['label']}: scored {s['scored']} / "
            f"failed {s['failed']} / missing {s['missing']} (leased {s['leased']})"
        )
    notes = {"dead": " (process gone: killed?)", "stale": " (no heartbeat within its lease: hung, or gone)"}
    for w in data["workers"][:20]:
        click.echo(
            f"worker {w['id']}: {w['state']}{notes.get(w['state'], '')}, {w['leases']} lease(s), "
            f"scored {w['scored']}, failed {w['failed']}, last heartbeat {w['seconds_since_heartbeat']}s ago"
        )


@cli.command()
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--write", is_flag=True, help="Allow statements that modify the database.")
@pass_ctx
def sql(state: _Ctx, query: str, fmt: str, write: bool) -> None:
    """Run one SQL statement against the store (read-only unless --write).

    Tables: episodes, messages, steps, subtasks, tags, scorers, scores, attempts,
    credit_runs, credits. Views: step_scores, step_credits, subtask_credits.
    """
    columns, rows = state.store(create=False).query(query, read_only=not write)
    if not columns:
        click.echo("ok")
    elif fmt == "csv":
        click.echo(formatting.to_csv(columns, rows), nl=False)
    elif fmt == "json":
        click.echo(formatting.to_json(columns, rows))
    else:
        click.echo(formatting.table(columns, rows, full="--format json (or csv)"))
        click.echo(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


# ---------------------------------------------------------------------------
# scoring


@cli.command()
@click.option("--server", metavar="URL", help="Inference server (SGLang /generate, or vLLM with --backend vllm).")
@click.option(
    "--backend",
    type=click.Choice(["sglang", "vllm", "transformers"]),
    default=None,
    help="Default: sglang with --server, transformers with --model and no --server.",
)
@click.option(
    "--model",
    metavar="NAME_OR_DIR",
    help="Model directory (transformers backend) or served model name (HTTP backends).",
)
@click.option("--tokenizer", metavar="DIR", help="Tokenizer directory (default: the model's / the server's).")
@click.option("--api-key", envvar="HCAPO_API_KEY", help="Sent as a Bearer token (env HCAPO_API_KEY).")
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=4,
    show_default=True,
    help="Episodes in flight at once (each sends its steps in order).",
)
@click.option(
    "--max-context",
    type=click.IntRange(2),
    default=32768,
    show_default=True,
    help="Most tokens per request: a longer prompt keeps its start (with the hindsight block), a "
    "truncation marker and the most recent history before the action.",
)
@click.option(
    "--max-logprob-tokens",
    type=int,
    default=2048,
    show_default=True,
    help="Score only the last N action tokens (<= 0: all).",
)
@click.option(
    "--hindsight-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="File with the hindsight block template (default: the original HINDSIGHT_TEMPLATE).",
)
@click.option(
    "--include-thinking/--no-thinking",
    default=True,
    show_default=True,
    help="Score episodes ingested with these conversion options.",
)
@click.option(
    "--max-tool-result-chars",
    type=int,
    default=4000,
    show_default=True,
    help="Score episodes ingested with this tool-result cut (the ingest option of the same name).",
)
@click.option(
    "--episode",
    "episodes",
    multiple=True,
    metavar="NAME",
    help="Only these episodes (repeatable): a name (pg-01/episode_001), its unambiguous end, or an id.",
)
@click.option("--min-reward", type=float, help="Only episodes with reward >= X.")
@click.option("--limit", type=click.IntRange(1), help="Score at most N steps in this run.")
@click.option("--retry-failed", is_flag=True, help="Requeue steps that failed in earlier runs.")
@click.option("--dry-run", is_flag=True, help="Count steps and prompt tokens; send nothing.")
@click.option(
    "--max-attempts",
    type=click.IntRange(1),
    default=4,
    show_default=True,
    help="Attempts per step before it is marked failed.",
)
@click.option(
    "--lease-seconds",
    type=click.FloatRange(1),
    default=120.0,
    show_default=True,
    help="How long a claimed step stays reserved without a heartbeat; then other workers may take it.",
)
@click.option("--worker-id", help="Name of this worker in the queue (default host:pid).")
@click.option(
    "--max-new-tokens",
    type=click.IntRange(0, 1),
    default=0,
    show_default=True,
    help="1 for old SGLang servers that mishandle prefill-only requests.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(0.1),
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="Give up on one HTTP request after this long (retried as a timeout).",
)
@click.option(
    "--grouping",
    type=click.Choice(["grouped", "per-step"]),
    default="grouped",
    show_default=True,
    help="grouped: steps whose prompts are exact prefixes of one another (checked on the ids) share "
    "one request; per-step: one request per step. Same results either way.",
)
@click.option(
    "--truncation",
    type=click.Choice(["sliding", "window"]),
    default="sliding",
    show_default=True,
    help="Prompts over --max-context: sliding keeps the most recent tail per step (the original); "
    "window starts the tail at block boundaries so a window's steps share one request "
    "(a different scorer).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_ctx
def score(
    state: _Ctx,
    server,
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
    episodes,
    min_reward,
    limit,
    retry_failed,
    dry_run,
    max_attempts,
    lease_seconds,
    worker_id,
    max_new_tokens,
    request_timeout,
    grouping,
    truncation,
    as_json,
) -> None:
    """Score every step that has no score yet under this scorer; safe to interrupt and rerun.

    The scorer is everything that determines the logprobs (model, tokenizer, templates,
    limits): the same options resume, different ones start a new scorer.
    """
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.progress import Progress
    from hcapo_store.scoring.explain import why_nothing_to_score
    from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
    from hcapo_store.scoring.job import dry_run as run_dry
    from hcapo_store.scoring.runner import RunOptions
    from hcapo_store.scoring.work_queue import Filters
    from hcapo_store.storage.episodes import resolve_episodes

    cfg = ScoreConfig(
        backend=backend,
        server=server,
        model=model,
        tokenizer=tokenizer,
        api_key=api_key,
        max_context=max_context,
        max_logprob_tokens=max_logprob_tokens,
        conversion=ConvertOptions(include_thinking=include_thinking, max_tool_result_chars=max_tool_result_chars),
        max_new_tokens=max_new_tokens,
        request_timeout=request_timeout,
        truncation=truncation,
    )
    if hindsight_template:
        cfg.hindsight_template = hindsight_template.read_text()
    # Options are checked (e.g. --worker-id) before anything touches the database.
    options = RunOptions(
        concurrency=concurrency,
        max_attempts=max_attempts,
        lease_seconds=lease_seconds,
        limit=limit,
        worker_id=worker_id,
        grouping=grouping,
    )
    store = state.store(create=not dry_run)  # a dry run writes nothing, not even a new file
    from hcapo_store.storage.db import read as db_read

    with db_read(store.engine) as conn:  # before the model loads: a wrong --episode fails at once
        filters = Filters(episodes=resolve_episodes(conn, episodes), min_reward=min_reward)
    options = dataclasses.replace(options, filters=filters)
    prep = prepare(store, cfg)
    if dry_run:
        result = run_dry(store, prep, filters, limit, grouping=grouping)
        reason = None if result.steps else why_nothing_to_score(store, prep.scorer_id, prep.spec["conversion"], filters)
        if as_json:
            _echo_json({**result.__dict__, "reason": reason})
        else:
            click.echo(result.summary() + (f"\n{reason}" if reason else ""))
        return
    with Progress("score", enabled=not as_json, unit="steps") as progress:

        def on_progress(report) -> None:
            if progress.total is None and report.planned:
                progress.total = report.planned
            progress.set(failed=report.failed, prompt_tok_s=f"{report.prompt_tokens / max(progress.elapsed, 1e-9):.0f}")
            progress.advance(n=report.scored + report.failed - progress.done)

        report = run_scoring(store, prep, options, retry_failed=retry_failed, on_progress=on_progress)
    reason = None
    if report.planned == 0 and not (report.scored or report.failed or report.interrupted):
        reason = why_nothing_to_score(store, prep.scorer_id, prep.spec["conversion"], filters)
    if as_json:
        _echo_json({**report.as_dict(), "reason": reason})
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
    if report.failed:
        sys.exit(1)


def _echo_score_errors(report, scorer_id: str) -> None:
    """Failed steps are never silent: the first distinct reasons, and where the rest are."""
    if not report.failed:
        return
    click.echo(f"{report.failed} step(s) failed for good; first distinct error(s):", err=True)
    for line in report.error_lines():
        click.echo(f"  {line}", err=True)
    click.echo(
        f"  all: hcapo-store sql \"SELECT last_error_kind, last_error FROM attempts WHERE status = 'failed' "
        f"AND scorer_id = '{scorer_id}'\"; rerun with --retry-failed once fixed",
        err=True,
    )


@cli.group(cls=_Group)
def scorers() -> None:
    """Scorers: each model/tokenizer/template/limits combination that has scores."""


@scorers.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def scorers_list(state: _Ctx, as_json: bool) -> None:
    """List scorers with their counts (scored / failed / missing) and their spec."""
    from hcapo_store.scoring.identity import scorer_counts, scorer_spec

    store = state.store(create=False)
    rows = scorer_counts(store)
    if as_json:
        _echo_json([{**r, "spec": scorer_spec(store, r["scorer_id"])} for r in rows])
        return
    if not rows:
        click.echo("no scorers yet: run `hcapo-store score`")
        return
    click.echo(
        formatting.table(
            ["scorer", "label", "scored", "failed", "missing", "created"],
            [(r["scorer_id"][:12], r["label"], r["scored"], r["failed"], r["missing"], r["created_at"]) for r in rows],
        )
    )


@cli.command("serve-reference")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Local transformers causal LM directory.",
)
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Tokenizer directory (default: the model directory).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=30000, show_default=True, help="Port to listen on (SGLang's default).")
def serve_reference(model_dir: Path, tokenizer_dir: Path | None, host: str, port: int) -> None:
    """Serve an SGLang-compatible /generate (and a vLLM /v1/completions subset) over a local model.

    Real logprobs from a transformers model on CPU: for tests, the demo, and users without a GPU.
    """
    from hcapo_store.local.refserver import make_server

    server = make_server(model_dir, tokenizer_dir, host=host, port=port)
    click.echo(f"serving {model_dir} at {server.url} (Ctrl-C to stop)", err=True)
    try:
        server.serve_forever()
    finally:
        server.shutdown()


@cli.command()
@click.option(
    "--dir",
    "workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".hcapo-demo"),
    show_default=True,
    help="Where the demo model (and episodes, outside a checkout) are built.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.pass_context
def demo(ctx: click.Context, workdir: Path, as_json: bool) -> None:
    """Run the main job end to end on a tiny local model: ingest, score, credits.

    Builds a tiny random model and tokenizer (no download, no GPU), ingests the example
    episodes, scores every step through the reference server over HTTP, computes the
    default credits, and prints the scored steps per subtask. Uses --db if given, else
    DIR/demo.db.
    """
    from hcapo_store.local.demo import demo_summary, manual_commands, run_demo

    state: _Ctx = ctx.obj
    if state.db is None:
        state.db = str(workdir / "demo.db")
    store = state.store()
    result = run_demo(
        store, workdir, on_step=(lambda _: None) if as_json else (lambda m: click.echo(f"• {m}", err=True))
    )
    commands = manual_commands(result, store.display)
    if as_json:
        _echo_json({**demo_summary(result), "commands": commands})
        return
    click.echo(f"ingest: {result.ingest.summary()}")
    click.echo(f"score:  {result.score.summary()}")
    click.echo(f"\nscored steps per subtask (scorer {result.scorer_id[:12]}):")
    click.echo(formatting.table(*result.subtasks))
    if result.credits:
        click.echo("\ncredits per subtask (run 'default'):")
        click.echo(formatting.table(*result.credits))
    click.echo(
        f"\ndatabase: {store.display} — try: hcapo-store --db {store.display} sql "
        "\"SELECT subtask_id, avg(q_h_smoothed) FROM step_credits WHERE run = 'default' GROUP BY 1\""
    )
    click.echo(f"\ntiny model (weights and tokenizer): {result.model_dir}")
    click.echo("score by hand against it (two shells):")
    for command in commands:
        click.echo(f"  {command}")


# ---------------------------------------------------------------------------
# credits, exports, report


@cli.group(cls=_Group, short_help="Credit runs (Eq. 5-7): no model calls.")
def credits() -> None:
    """Credit runs (Eq. 5-7) computed from stored logprobs, without the model."""


@credits.command("compute")
@click.option("--name", help="A label for the run (default: 'default' for the default parameters).")
@click.option("--scorer", help="Scorer id, unique id prefix or label (default: the only scorer).")
@click.option(
    "--t-temp",
    type=float,
    default=5.0,
    show_default=True,
    help="Temperature T of the hindsight ratio: pi_hind = exp(mean logprob / T).",
)
@click.option(
    "--gamma",
    type=float,
    default=0.95,
    show_default=True,
    help="Discount γ: a step's reward is discounted by γ per step to its subtask's end.",
)
@click.option(
    "--c-min",
    type=float,
    default=0.8,
    show_default=True,
    help="Lower clip c_min of the ratio ρ = pi_hind / episode mean.",
)
@click.option("--c-max", type=float, default=1.2, show_default=True, help="Upper clip c_max of the ratio ρ.")
@click.option(
    "--alpha", type=float, default=0.5, show_default=True, help="Backward smoothing weight α of q_h into q_h_smoothed."
)
@click.option("--no-smooth", is_flag=True, help="No backward smoothing (q_h_smoothed = q_h).")
@click.option("--no-dense-rewards", is_flag=True, help="Sparse: episode reward discounted to the episode end.")
@click.option("--max-logprob-tokens", type=int, help="Re-aggregate only the last N stored token logprobs.")
@click.option("--recompute", is_flag=True, help="Recompute an existing run (e.g. after more steps were scored).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def credits_compute(
    state: _Ctx,
    name,
    scorer,
    t_temp,
    gamma,
    c_min,
    c_max,
    alpha,
    no_smooth,
    no_dense_rewards,
    max_logprob_tokens,
    recompute,
    as_json,
) -> None:
    """Compute pi_hind, rho, q_h, q_h_smoothed for every completely scored episode.

    Same scorer + same hyperparameters is the same run (returned, not recomputed).
    Episodes with missing or failed steps are listed as incomplete and get no credits.
    """
    from hcapo_store.credits.equations import CreditParams
    from hcapo_store.credits.runs import compute_credits

    # Invalid values are refused by CreditParams itself (one line, with the valid range).
    params = CreditParams(
        t_temp=t_temp,
        gamma=gamma,
        c_min=c_min,
        c_max=c_max,
        alpha=alpha,
        smooth=not no_smooth,
        dense=not no_dense_rewards,
        max_logprob_tokens=max_logprob_tokens,
    )
    result = compute_credits(state.store(create=False), params, name=name, scorer=scorer, replace=recompute)
    _echo_json(result.as_dict()) if as_json else click.echo(result.message)


@credits.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def credits_list(state: _Ctx, as_json: bool) -> None:
    """List credit runs: name, scorer, hyperparameters, episodes, steps, incomplete."""
    from hcapo_store.credits.runs import list_runs

    runs = list_runs(state.store(create=False))
    if as_json:
        _echo_json([r.as_dict() for r in runs])
        return
    if not runs:
        click.echo("no credit runs yet: run `hcapo-store credits compute`")
        return
    click.echo(
        formatting.table(
            ["name", "scorer", "params", "episodes", "steps", "incomplete", "stale", "created"],
            [
                (
                    r.name,
                    r.scorer_label,
                    formatting.params_text(r.params),
                    r.episodes,
                    r.steps,
                    r.incomplete_episodes,
                    "STALE" if r.stale else "",
                    r.created_at,
                )
                for r in runs
            ],
            max_width=None,
        )
    )
    _warn([r.stale for r in runs if r.stale])


@credits.command("show")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def credits_show(state: _Ctx, name: str | None, as_json: bool) -> None:
    """Show one run: hyperparameters, counts, and a per-subtask summary."""
    from hcapo_store.credits.runs import show_run

    data = show_run(state.store(create=False), name)
    if as_json:
        _echo_json(data)
        return
    for key, value in data.items():
        if key == "stale":
            click.echo(f"{key:<20} {value or 'no'}")
        elif key != "subtasks":
            click.echo(f"{key:<20} {formatting.params_text(value) if isinstance(value, dict) else value}")
    rows = data.get("subtasks") or []
    if rows:
        click.echo("")
        click.echo(formatting.records_table(rows))


@credits.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--top", type=int, default=10, show_default=True, help="How many most-moved steps to list.")
@click.option("--all", "all_steps", is_flag=True, help="With --json: every common step's deltas.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def credits_diff(state: _Ctx, a: str, b: str, top: int, all_steps: bool, as_json: bool) -> None:
    """Compare two runs step by step: deltas of rho and q_h_smoothed (B - A)."""
    from hcapo_store.credits.runs import diff_runs, iter_step_deltas

    store = state.store(create=False)
    if as_json and all_steps:
        _echo_json(list(iter_step_deltas(store, a, b)))
        return
    data = diff_runs(store, a, b, top=top)
    if as_json:
        _echo_json(data)
        return
    for key, value in data.items():
        if isinstance(value, dict) and all(isinstance(v, (int, float, type(None))) for v in value.values()):
            click.echo(f"{key:<20} " + "  ".join(f"{k}={formatting.cell(v)}" for k, v in value.items()))
        elif not isinstance(value, (list, dict)):
            click.echo(f"{key:<20} {value}")
    moved = data.get("top_moved") or []
    if moved:
        click.echo("\nsteps that moved most:")
        click.echo(formatting.records_table(moved))


@cli.group(cls=_Group)
def export() -> None:
    """Write training data and per-episode files from a credit run."""


@export.command("hindsight-json")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--credits", "run", help="Credit run name (default: the only run).")
@pass_ctx
def export_hindsight(state: _Ctx, out_dir: Path, run: str | None) -> None:
    """Write OUT_DIR/<episode>/hindsight_scores.json in the original script's schema."""
    from hcapo_store.outputs.export import export_hindsight_json

    result = export_hindsight_json(state.store(create=False), out_dir, run)
    _warn(result["warnings"])
    click.echo(
        f"wrote {result['episodes']} hindsight_scores.json file(s) under {result['out_dir']} "
        f"(credit run {result['run']!r})"
    )
    if not result["episodes"]:
        sys.exit(1)


@export.command("dataset")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--credits", "run", help="Credit run name (default: the only run).")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option("--omega", type=float, default=1.0, show_default=True, help="Weight of the micro (step) advantage.")
@click.option("--min-reward", type=float, default=0.2, show_default=True, help="Only episodes with reward >= X.")
@click.option("--group-by", metavar="TAG", help="GRPO advantage per value of this tag (e.g. task).")
@click.option("--no-smooth", is_flag=True, help="Use q_h instead of q_h_smoothed.")
@click.option(
    "--tokenized", is_flag=True, help="Token-level rows: input_ids, labels, per-token advantages (needs --tokenizer)."
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False),
    metavar="DIR",
    help="With --tokenized: the scorer's tokenizer directory.",
)
@click.option("--weights-in-messages", is_flag=True, help='A "weight" on each credited assistant message.')
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_ctx
def export_dataset_cmd(
    state: _Ctx,
    out: Path,
    run,
    fmt,
    omega,
    min_reward,
    group_by,
    no_smooth,
    tokenized,
    tokenizer,
    weights_in_messages,
    as_json,
) -> None:
    """Write Eq. 8 training rows (hcapo_train.jsonl or Parquet) and a summary JSON beside them."""
    from hcapo_store.outputs.export import export_dataset

    if tokenized and weights_in_messages:
        raise click.UsageError("--tokenized and --weights-in-messages are two different layouts: pick one")
    layout = "tokenized" if tokenized else "weights-in-messages" if weights_in_messages else "steps"
    summary = export_dataset(
        state.store(create=False),
        out,
        run,
        omega=omega,
        min_reward=min_reward,
        group_by=group_by,
        fmt=fmt,
        use_smoothed=not no_smooth,
        layout=layout,
        tokenizer=tokenizer,
    )
    _warn(summary["warnings"])
    if as_json:
        _echo_json(summary)
    elif tokenized:
        click.echo(
            f"wrote {out}: {summary['episodes_in_dataset']} episode(s), {summary['weighted_steps']} "
            f"weighted step(s), {summary['unaligned_steps']} step(s) refused (could not be aligned)"
        )
    else:
        click.echo(
            f"wrote {out}: {summary.get('episodes_in_dataset')} episode(s), "
            f"{summary.get('total_steps')} step(s) ({summary.get('nonzero_steps')} non-zero); "
            f"summary {summary['summary_path']}"
        )
    if not summary["episodes_in_dataset"]:
        sys.exit(1)


@export.command("scores")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--scorer", help="Scorer id, unique id prefix or label (default: the only scorer).")
@click.option("--format", "fmt", type=click.Choice(["parquet"]), default="parquet", show_default=True)
@pass_ctx
def export_scores_cmd(state: _Ctx, out: Path, scorer: str | None, fmt: str) -> None:
    """Write every scored step with its per-token logprobs as list<float32> (Parquet)."""
    from hcapo_store.outputs.scores import export_scores

    result = export_scores(state.store(create=False), out, scorer)
    click.echo(f"wrote {result['path']}: {result['steps']} scored step(s) of scorer {result['scorer']}")


@cli.command("datasette-metadata")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--database", help="datasette's name of the database (default: the --db file's stem).")
@pass_ctx
def datasette_metadata_cmd(state: _Ctx, out: Path, database: str | None) -> None:
    """Write datasette metadata: column descriptions and the example queries (datasette --metadata OUT)."""
    import json

    from hcapo_store.analysis.datasette import datasette_metadata
    from hcapo_store.outputs.files import atomic_write

    location = (state.db or DEFAULT_DB).removeprefix("sqlite:///")
    name = database or ("hcapo" if "://" in location else Path(location).stem)  # datasette names a file by its stem
    doc = json.dumps(datasette_metadata(name), indent=2).encode()
    atomic_write(out, lambda f: f.write(doc))
    click.echo(f"wrote {out} (database {name!r}): datasette {name}.db --metadata {out}")


@cli.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--credits", "run", help="Credit run name (default: the only run).")
@click.option(
    "--episodes",
    "episode_pages",
    is_flag=True,
    help="Also write one page per episode (OUT's stem + _episodes/) and link them.",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False),
    metavar="DIR",
    help="With --episodes: the scorer's tokenizer, for per-token heat maps.",
)
@pass_ctx
def report(state: _Ctx, out: Path, run: str | None, episode_pages: bool, tokenizer: str | None) -> None:
    """Write one self-contained HTML page: histograms, Q_H by subtask, coverage, failures."""
    from hcapo_store.outputs.report import write_report

    result = write_report(state.store(create=False), out, run, episode_pages=episode_pages, tokenizer=tokenizer)
    _warn(result["warnings"])
    click.echo(f"wrote {result['path']} ({result['bytes']} bytes, credit run {result['run']!r})")


@cli.command()
@click.argument("episode")
@click.option("--credits", "run", help="Credit run name (default: the only run, if any).")
@click.option(
    "--html",
    "out_html",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the episode's HTML page (transcript tinted by credit) here.",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False),
    metavar="DIR",
    help="With --html: the scorer's tokenizer, for per-token heat maps.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the steps as JSON.")
@pass_ctx
def show(
    state: _Ctx, episode: str, run: str | None, out_html: Path | None, tokenizer: str | None, as_json: bool
) -> None:
    """Print one episode's steps: subtask, reward, tokens, mean logprob, pi_hind, rho, q_h."""
    from hcapo_store.outputs.episode_view import episode_page, episode_table, episode_view
    from hcapo_store.outputs.files import atomic_write

    view = episode_view(state.store(create=False), episode, run, tokenizer=tokenizer if out_html else None)
    rows = episode_table(view)
    if as_json:
        _echo_json({"episode": view.episode.name, "run": view.run.name if view.run else None, "steps": rows})
    else:
        where = f"credit run {view.run.name!r}" if view.run else "no credit run"
        click.echo(f"episode {view.episode.name}: reward {view.episode.outcome.reward}, {len(rows)} step(s), {where}")
        if rows:
            click.echo(formatting.records_table(rows))
    if out_html:
        page = episode_page(view).encode()
        atomic_write(out_html, lambda f: f.write(page))
        click.echo(f"wrote {out_html}", err=as_json)


if __name__ == "__main__":
    cli()
