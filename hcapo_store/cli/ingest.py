"""``ingest``: add episodes from files."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hcapo_store import worker_processes
from hcapo_store.cli.main import EXIT_INTERRUPTED, Ctx, cli, echo_json, pass_ctx
from hcapo_store.cli.params import compaction_option, conversion_options
from hcapo_store.ingestion.sources import INPUT_FORMATS, ConvertOptions


def _parse_tags(values: tuple[str, ...]) -> dict[str, str]:
    tags = {}
    for v in values:
        if "=" not in v or not v.split("=", 1)[0]:
            raise click.BadParameter(f"{v!r}: expected KEY=VALUE", param_hint="--tag")
        k, val = v.split("=", 1)
        tags[k.strip()] = val.strip()
    return tags


@cli.command(epilog="Reference: docs/INGEST.md in the hcapo-store repository.")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@conversion_options(
    thinking_help="Keep the assistant's thinking as <think>…</think> in its message.",
    cut_help="Cut tool results longer than this (the original's suffix is added); 0 = never.",
)
@click.option(
    "--tag",
    "tags",
    multiple=True,
    metavar="KEY=VALUE",
    help="Label the ingested episodes (repeatable), e.g. --tag task=postgres --tag run=pg-01.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Processes that parse episodes while this one stores them [default: one per core; "
    "1 = parse in this process]. Small ingests always parse here. The stored result is the same.",
)
@click.option(
    "--format",
    "input_format",
    type=click.Choice(INPUT_FORMATS),
    default=None,
    help="Read each FILE given as a JSON array of episodes, not JSONL: tau-bench = τ-bench's "
    "results (task_id, trial, reward, traj; episode id TASK-TRIAL); openai-list = the objects a JSONL "
    "line holds (messages, reward, optional episode_id …).",
)
@compaction_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_ctx
def ingest(
    state: Ctx,
    paths: tuple[Path, ...],
    include_thinking: bool,
    max_tool_result_chars: int,
    tags: tuple[str, ...],
    jobs: int | None,
    input_format: str | None,
    compaction: str,
    as_json: bool,
) -> None:
    """Add episodes: episode directories, trajectory roots (episode_* dirs), JSONL files, or JSON arrays (--format).

    Unchanged episodes are skipped; changed ones become a new version. One bad file never
    stops the batch; the exit status is 1 when any episode failed, 130 when interrupted.
    """
    from hcapo_store.ingestion.pipeline import ingest as run_ingest
    from hcapo_store.ingestion.sources import count_inputs
    from hcapo_store.progress import EpisodeProgress

    worker_processes.preload(worker_processes.INGEST)
    store = state.store()
    options = ConvertOptions(
        include_thinking=include_thinking, max_tool_result_chars=max_tool_result_chars, compaction=compaction
    )
    with EpisodeProgress("ingest", enabled=not as_json) as progress:
        if progress.enabled:
            progress.total = count_inputs(
                list(paths), input_format
            )  # for the rate's ETA; a pipe gets it in its log lines
        report = run_ingest(
            store,
            list(paths),
            options=options,
            tags=_parse_tags(tags),
            on_episode=progress.advance,
            jobs=jobs,
            input_format=input_format,
        )
    if as_json:
        echo_json(report.as_dict())
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
