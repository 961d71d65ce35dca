"""Files from the database: ``export``, ``datasette-metadata``, ``report``, ``show``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hcapo_store import formatting
from hcapo_store.cli.main import Ctx, Group, cli, echo_json, pass_ctx, warn
from hcapo_store.cli.params import FiniteFloat
from hcapo_store.storage.location import DEFAULT_DB


@cli.group(cls=Group, epilog="Reference: docs/OUTPUTS.md in the hcapo-store repository.")
def export() -> None:
    """Write training data and per-episode files from a credit run."""


@export.command("hindsight-json")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--credits", "run", help="Credit run name (default: the only run).")
@pass_ctx
def export_hindsight(state: Ctx, out_dir: Path, run: str | None) -> None:
    """Write OUT_DIR/<episode>/hindsight_scores.json in the original script's schema."""
    from hcapo_store.outputs.export import export_hindsight_json

    result = export_hindsight_json(state.store(create=False), out_dir, run)
    warn(result.warnings)
    click.echo(
        f"wrote {result.episodes} hindsight_scores.json file(s) under {result.out_dir} (credit run {result.run!r})"
    )
    if not result.episodes:
        sys.exit(1)


@export.command(
    "dataset",
    short_help="Write training rows weighted by HCAPO (Eq. 8), as JSONL or Parquet.",
    epilog="Reference: docs/OUTPUTS.md in the hcapo-store repository.",
)
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--credits", "run", help="Credit run name (default: the only run).")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option(
    "--omega",
    type=FiniteFloat(),
    help="Weight of the micro (step) advantage. Default: the credit run's (1.0 unless computed with another).",
)
@click.option(
    "--min-reward",
    type=FiniteFloat(),
    help="Only episodes with reward >= X. Default: the credit run's (0.2); a paper run keeps every episode.",
)
@click.option(
    "--group-by",
    metavar="TAG|tag:KEY|field:NAME",
    help="GRPO advantage per value of this tag (e.g. task) or of a field of result.json / the JSONL line "
    "(field:task_id). Default: the run's.",
)
@click.option("--no-smooth", is_flag=True, help="Use q_h instead of q_h_smoothed.")
@click.option(
    "--tokenized",
    is_flag=True,
    help="Token-level rows: token_ids (not input_ids, so a trainer unaware of the advantages stops), labels "
    "(-100 outside credited tokens) and per-token advantages, with the scorer's tokenizer.",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False),
    metavar="DIR",
    help="With --tokenized: the scorer's tokenizer directory (default: where `score` "
    "loaded it, when its files still match).",
)
@click.option(
    "--rendering",
    type=click.Choice(["turns", "whole"]),
    default="turns",
    show_default=True,
    help="With --tokenized: the conversation turn by turn as the policy produced it (what multi-turn "
    "RL trainers hold), or one chat-template rendering of the whole conversation (what SFT trainers do).",
)
@click.option("--weights-in-messages", is_flag=True, help='A "weight" on each credited assistant message.')
@click.option(
    "--top-k",
    "top_k",
    is_flag=True,
    help="With --tokenized: the run's scorer's top-k per token (topk_token_ids, topk_logprobs, actual_logprobs; "
    "score --top-k K first), TRL's top-k distillation shape.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_ctx
def export_dataset_cmd(
    state: Ctx,
    out: Path,
    run,
    fmt,
    omega,
    min_reward,
    group_by,
    no_smooth,
    tokenized,
    tokenizer,
    rendering,
    weights_in_messages,
    top_k,
    as_json,
) -> None:
    """Write Eq. 8 training rows (hcapo_train.jsonl or Parquet) and a summary JSON beside them."""
    from hcapo_store.outputs.export import DatasetExport, export_dataset
    from hcapo_store.progress import Progress

    if tokenized and weights_in_messages:
        raise click.UsageError("--tokenized and --weights-in-messages are two different layouts: pick one")
    layout = "tokenized" if tokenized else "weights-in-messages" if weights_in_messages else "steps"
    if top_k and not tokenized:
        raise click.UsageError("--top-k goes with --tokenized (per-token targets on token_ids)")
    with Progress("export", enabled=not as_json, unit="episodes") as progress:
        summary = export_dataset(
            state.store(create=False),
            out,
            run,
            omega=omega,
            min_reward=min_reward,
            group_by=group_by,
            fmt=fmt,
            use_smoothed=False if no_smooth else None,
            layout=layout,
            tokenizer=tokenizer,
            rendering=rendering,
            on_progress=progress.reach,
            top_k=top_k,
        )
    warn(summary.warnings)
    if as_json:
        echo_json(summary.as_dict())
    elif isinstance(summary, DatasetExport):
        click.echo(
            f"wrote {out}: {summary.episodes_in_dataset} episode(s), "
            f"{summary.total_steps} step(s) ({_signs(summary.step_signs)}); "
            f"summary {summary.summary_path}"
        )
    else:  # the tokenized layout
        click.echo(
            f"wrote {out}: {summary.episodes_in_dataset} episode(s), {summary.aligned_steps} step(s) "
            f"({_signs(summary.step_signs)}), {summary.unaligned_steps} step(s) refused"
            + (
                " (" + ", ".join(f"{n} {kind}" for kind, n in summary.unaligned_reasons.items()) + ")"
                if summary.unaligned_reasons
                else ""
            )
        )
    if not summary.episodes_in_dataset:
        sys.exit(1)


def _signs(signs: dict[str, int]) -> str:
    """``3 positive, 1 negative, 0 zero``: the written steps by the sign of their advantage."""
    return ", ".join(f"{signs[k]} {k}" for k in ("positive", "negative", "zero"))


@export.command("scores")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--scorer", help="Scorer id, unique id prefix or label (default: the only scorer).")
@click.option("--format", "fmt", type=click.Choice(["parquet"]), default="parquet", show_default=True)
@click.option("--top-k", "top_k", is_flag=True, help="The scorer's top-k per position instead (score --top-k K).")
@pass_ctx
def export_scores_cmd(state: Ctx, out: Path, scorer: str | None, fmt: str, top_k: bool) -> None:
    """Write every scored step with its per-token logprobs as list<float32> (Parquet)."""
    from hcapo_store.outputs.scores import export_scores

    if top_k:
        from hcapo_store.outputs.topk import export_topk_scores

        done = export_topk_scores(state.store(create=False), out, scorer)
        click.echo(
            f"wrote {done.path}: top-{'/'.join(map(str, done.k))} of {done.steps} step(s) of scorer {done.scorer}"
        )
        return

    result = export_scores(state.store(create=False), out, scorer)
    click.echo(f"wrote {result.path}: {result.steps} scored step(s) of scorer {result.scorer}")


@cli.command("datasette-metadata", epilog="Reference: docs/OUTPUTS.md in the hcapo-store repository.")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--database", help="datasette's name of the database (default: the --db file's stem).")
@pass_ctx
def datasette_metadata_cmd(state: Ctx, out: Path, database: str | None) -> None:
    """Write datasette metadata: column descriptions and the example queries (datasette --metadata OUT)."""
    import json

    from hcapo_store.analysis.datasette import datasette_metadata
    from hcapo_store.outputs.files import atomic_write

    location = (state.db or DEFAULT_DB).removeprefix("sqlite:///")
    name = database or ("hcapo" if "://" in location else Path(location).stem)  # datasette names a file by its stem
    doc = json.dumps(datasette_metadata(name).as_dict(), indent=2).encode()
    atomic_write(out, lambda f: f.write(doc), inputs=[] if "://" in location else [location])
    click.echo(f"wrote {out} (database {name!r}): datasette {name}.db --metadata {out}")


@cli.command(epilog="Reference: docs/OUTPUTS.md in the hcapo-store repository.")
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
def report(state: Ctx, out: Path, run: str | None, episode_pages: bool, tokenizer: str | None) -> None:
    """Write one self-contained HTML page: histograms, Q_H by subtask, coverage, failures."""
    from hcapo_store.outputs.report import write_report

    result = write_report(state.store(create=False), out, run, episode_pages=episode_pages, tokenizer=tokenizer)
    warn(result.warnings)
    click.echo(f"wrote {result.path} ({result.bytes} bytes, credit run {result.run!r})")


@cli.command(epilog="Reference: docs/OUTPUTS.md in the hcapo-store repository.")
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
    state: Ctx, episode: str, run: str | None, out_html: Path | None, tokenizer: str | None, as_json: bool
) -> None:
    """Print one episode's steps: subtask, reward, tokens, mean logprob, pi_hind, rho, q_h, advantage."""
    from hcapo_store.outputs.episode_view import episode_page, episode_table, episode_view
    from hcapo_store.outputs.files import atomic_write

    view = episode_view(state.store(create=False), episode, run, tokenizer=tokenizer if out_html else None)
    rows = episode_table(view, preview=not as_json)
    if as_json:
        echo_json({"episode": view.episode.name, "run": view.run.name if view.run else None, "steps": rows})
    else:
        where = f"credit run {view.run.name!r}" if view.run else "no credit run"
        click.echo(
            f"episode {formatting.for_terminal(view.episode.name)}: reward {view.episode.outcome.reward}, {len(rows)} step(s), {where}"
        )
        if rows:
            click.echo(formatting.records_table(rows))
    if out_html:
        page = episode_page(view).encode()
        atomic_write(out_html, lambda f: f.write(page))
        click.echo(f"wrote {out_html}", err=as_json)
