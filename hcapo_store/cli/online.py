"""``follow`` and ``batches``: the store inside the training loop."""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from pathlib import Path

import click

from hcapo_store import formatting, worker_processes
from hcapo_store.cli import log_ratio
from hcapo_store.cli.credits import CREDIT_KEYWORDS, credit_options, credit_params
from hcapo_store.cli.log_ratio import log_ratio_options
from hcapo_store.cli.main import EXIT_INTERRUPTED, Ctx, cli, echo_json, pass_ctx
from hcapo_store.cli.params import FiniteFloat, compaction_option, int_range
from hcapo_store.cli.score import scorer_options, scorer_setup

EXIT_WAITING = 3  # --until-idle ended while episodes or batches still waited (named)
REFERENCE = "Reference: README (Online: follow and the trainer hand-off) in the hcapo-store repository."


@cli.command(epilog=REFERENCE)
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@scorer_options
@compaction_option
@credit_options
@log_ratio_options
@click.option(
    "--batch-by",
    default="parent",
    show_default=True,
    metavar="parent|tag:KEY|field:NAME",
    help="What makes a batch (a GRPO group): parent = the directory that holds the episodes "
    "(e.g. rollouts/step_0007/); tag:KEY = the value of an ingest tag; field:NAME = the value of a "
    "field of result.json (or of the JSONL line), e.g. field:group_id.",
)
@click.option("--group-size", type=int_range(1), required=True, help="Episodes in a complete batch.")
@click.option(
    "--batch-timeout",
    type=FiniteFloat(0),
    metavar="SECONDS",
    help="The bound for members that never come (a collector that crashed): publish a batch with "
    "fewer than --group-size episodes once this long has passed since its last one arrived. Without it "
    "such a batch waits (and --until-idle names it).",
)
@click.option(
    "--until-idle",
    type=FiniteFloat(0),
    metavar="SECONDS",
    help="Exit once nothing new arrived and nothing was scored or published for this long: 0 when "
    "everything seen is published, 1 when something failed, 3 when episodes or batches still wait "
    "(each named: no reward yet, a line being written, a batch short of --group-size).",
)
@click.option("--once", is_flag=True, help="Process what is there now, publish what is complete, and exit.")
@click.option(
    "--poll",
    "poll_seconds",
    type=FiniteFloat(0.05, 3600),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Look at the paths at least this often (a stat of each entry); file-system events wake it sooner.",
)
@click.option(
    "--poll-only",
    is_flag=True,
    help="No file-system events, only the periodic look (network file systems send none).",
)
@click.option(
    "--follow-links",
    is_flag=True,
    help="Read symbolic links that lead out of the followed folders (refused by default, each named).",
)
@click.option("--json", "as_json", is_flag=True, help="Print each published batch as one JSON line.")
@pass_ctx
def follow(
    state: Ctx,
    paths,
    batch_by,
    group_size,
    batch_timeout,
    until_idle,
    once,
    poll_seconds,
    poll_only,
    follow_links,
    compaction,
    as_json,
    **kw,
) -> None:
    """Follow a collection as it is written: ingest new and changed episodes, score their
    steps, and publish each complete batch's credits (`hcapo-store batches` lists them).

    Safe to kill and restart (nothing is scored or published twice); SIGTERM or Ctrl-C stops
    after the request in flight. Several `follow` processes on one PostgreSQL database share the work.

    `--variant log-ratio --against no-hindsight|rollout`: each batch's run is a log-ratio run of
    this scorer (the teacher) against the same scorer without the hindsight block (scored in the
    same rounds) or the rollouts' own logprobs (stored from the records, as `score-rollout`).
    """
    import json

    from hcapo_store.online.follow import FollowConfig, Follower
    from hcapo_store.online.follow import follow as run_follow
    from hcapo_store.scoring.job import prepare

    mine = log_ratio.split(kw["variant"], kw)
    variant = kw["variant"]
    if variant == "log-ratio":
        kw["variant"] = "paper"  # HCAPO's params are not read; the log-ratio run's are below
    group_by = kw["group_by"]
    params = credit_params(**{k: kw.pop(k) for k in CREDIT_KEYWORDS})
    cfg, options = scorer_setup(**kw)  # what is left: the scorer options
    from hcapo_store.errors import UsageError

    lr_params = log_ratio.params_of(mine, group_by) if variant == "log-ratio" else None

    try:
        follow_cfg = FollowConfig(
            paths=list(paths),
            group_size=group_size,
            batch_by=batch_by,
            batch_timeout=batch_timeout,
            params=params,
            conversion=dataclasses.replace(cfg.conversion, compaction=compaction),
            follow_links=follow_links,
            log_ratio=lr_params,
            against=mine["against"],
            allow_mixed=mine["allow_mixed"],
        )
    except UsageError as exc:  # an option's value: refused like any other bad option, before any work
        raise click.UsageError(str(exc)) from exc
    # Ingest's workers only: a batch ingests before it scores, so the forkserver starts for
    # ingest, and a server importing transformers and torch first held up every first batch
    # (bench/follow.py: 13.6-16.7 s against 12.3-13.1). The prepare workers import them beside
    # the run's threads, which prepare the batch until a worker has started.
    worker_processes.preload(worker_processes.INGEST)
    store = state.store()
    prep = prepare(store, cfg)
    student = log_ratio.follow_student(store, cfg, prep, follow_cfg)
    follower = Follower(store, prep, follow_cfg, options, student=student)
    from hcapo_store.credits.lookup import signal_text  # each batch's hindsight signal, in its line

    stop = threading.Event()
    from hcapo_store.online import presence

    me = presence.Presence(store, prep.scorer_id)  # `batches` sees a follower at work

    def on_signal(signum, frame) -> None:
        stop.set()
        if signum == signal.SIGTERM and signal.getsignal(signal.SIGINT) is not on_signal:
            # a scoring run holds SIGINT (its graceful stop): SIGTERM takes the same way, not
            # a wait for the run's end
            signal.raise_signal(signal.SIGINT)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    tty = sys.stderr.isatty()
    last_line = [""]

    def on_cycle(report, status) -> None:
        for info in report.published:
            if as_json:
                click.echo(json.dumps(info.as_dict()))
            else:
                failed = ", failed: " + ", ".join(f"{f.name} ({f.reason})" for f in info.failed_episodes)
                failed = failed if info.failed_episodes else ""
                click.echo(
                    f"batch {info.id} {info.key}: {info.episodes} episode(s), credit run "
                    f"{info.credit_run or '(none: every episode failed)'}, lag {info.lag_s:.2f} s{failed}"
                    + (
                        f"; {signal_text(store, info.credit_run) or 'hindsight term: not measured'}"
                        if info.credit_run
                        else ""
                    )
                )
        for failure in status.failures:
            click.echo(f"failed: {failure}", err=True)
        for notice in status.notices:
            click.echo(f"waiting: {notice}", err=True)
        if status.unlisted:
            click.echo(f"... and {status.unlisted} more message(s) this round, not listed", err=True)
        status.failures.clear()
        status.notices.clear()
        status.unlisted = 0
        me.beat(scored=status.scored, failed=status.failed)
        line = status.line()
        if tty:
            click.echo("\r\x1b[2K" + line, nl=False, err=True)
        elif line != last_line[0]:
            click.echo(line, err=True)
        last_line[0] = line

    try:
        result = run_follow(
            follower,
            once=once,
            until_idle=until_idle,
            poll_seconds=poll_seconds,
            stop=stop,
            on_cycle=on_cycle,
            poll_only=poll_only,
        )
    except KeyboardInterrupt:
        stop.set()
        result = None
    finally:
        me.leave()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if tty:
            click.echo("", err=True)
    if result is None or result.stopped == "signal":
        click.echo("follow: stopped; rerun the same command to go on", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if result.stopped == "idle" and result.waiting:
        for item in result.waiting[:50]:
            click.echo(f"still waiting: {item}", err=True)
        if len(result.waiting) > 50:
            click.echo(f"still waiting: ... and {len(result.waiting) - 50} more", err=True)
    if follower.status.failed or follower.status.ingest_failed:
        sys.exit(1)
    if result.stopped == "idle" and result.waiting:
        click.echo(
            f"follow: idle for {until_idle:g} s with {len(result.waiting)} thing(s) still waiting (exit 3); "
            "--batch-timeout publishes short batches",
            err=True,
        )
        sys.exit(EXIT_WAITING)


@cli.command(epilog=REFERENCE)
@click.option("--since", type=int_range(0), metavar="ID", help="Only batches published after this id.")
@click.option("--json", "as_json", is_flag=True, help="Print the batches as a JSON list.")
@pass_ctx
def batches(state: Ctx, since: int | None, as_json: bool) -> None:
    """List the batches `follow` published (the change feed): key, episodes, status, credit run."""
    from hcapo_store.online.batches import list_batches

    rows = list_batches(state.store(create=False), since)
    if as_json:
        echo_json([b.as_dict() for b in rows])
        return
    if not rows:
        from hcapo_store.online.presence import live_followers

        store = state.store(create=False)
        followers = live_followers(store)
        if followers:
            click.echo(
                f"no batches yet: {followers[0].describe()}"
                + (f" (and {len(followers) - 1} more)" if len(followers) > 1 else "")
                + "; a batch is listed once all its episodes are in and scored (--group-size, --batch-timeout)"
            )
        else:
            click.echo("no batches yet: run `hcapo-store follow`")
        return
    click.echo(
        formatting.table(
            [
                "id",
                "key",
                "episodes",
                "scored",
                "failed",
                "status",
                "credit_run",
                "weight_version",
                "ready_at",
                "lag_s",
            ],
            [
                (
                    b.id,
                    b.key,
                    b.episodes,
                    b.scored,
                    b.failed,
                    b.status,
                    b.credit_run,
                    b.weight_version,
                    b.ready_at,
                    b.lag_s,
                )
                for b in rows
            ],
            max_width=None,
        )
    )
