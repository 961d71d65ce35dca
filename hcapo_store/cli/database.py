"""Commands on the database itself: init, db current / upgrade, status, sql."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator

import click

from hcapo_store import formatting
from hcapo_store.cli.main import Ctx, Group, cli, echo_json, pass_ctx
from hcapo_store.cli.params import FiniteFloat

TABLE_ROWS = 10_000  # rows `sql` shows as a table; csv and json write every row


@cli.command(epilog="Reference: docs/DATABASE.md in the hcapo-store repository.")
@pass_ctx
def init(state: Ctx) -> None:
    """Create a new database (or confirm an existing one is current)."""
    from hcapo_store.storage import db as dbmod

    store = state.store(create=True)
    click.echo(f"{store.display}: schema at revision {dbmod.current_revision(store.engine)} (head)")


@cli.group(cls=Group, epilog="Reference: docs/DATABASE.md in the hcapo-store repository.")
def db() -> None:
    """Schema version of the database: show it, upgrade it."""


@db.command("current")
@pass_ctx
def db_current(state: Ctx) -> None:
    """Print the database's schema revision and the head this version needs."""
    from hcapo_store.storage import db as dbmod

    url = dbmod.resolve_url(state.db)
    dbmod.preflight(url, create=False)
    engine = dbmod.make_engine(url)
    try:
        dbmod.refuse_foreign(engine)
        current = dbmod.current_revision(engine)
    finally:
        engine.dispose()
    head = dbmod.head_revision()
    click.echo(
        f"{dbmod.display_url(url)}: {current or 'empty'} (head {head})"
        + ("" if current == head else " — run `hcapo-store db upgrade`")
    )


@db.command("reader-role", epilog="Reference: docs/PROMISES.md in the hcapo-store repository.")
@click.option("--name", default="hcapo_store_reader", show_default=True, help="The role's name.")
@click.option(
    "--password-env",
    metavar="VAR",
    help="Give the role the password in this environment variable (else it logs in as the server allows: "
    "trust, peer or .pgpass).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def db_reader_role(state: Ctx, name: str, password_env: str | None, as_json: bool) -> None:
    """PostgreSQL: create a login role that can only read the store; `sql` then runs as it.

    The role gets SELECT on the store's tables (and on the tables later upgrades add), read-only
    transactions and a statement time limit; nothing else. `sql` connects as it by itself when it
    is named hcapo_store_reader (with HCAPO_STORE_READER_PASSWORD as its password when the server
    asks for one), or through HCAPO_STORE_READER_URL.
    """
    import os

    from hcapo_store.storage.reader import create_reader_role

    password = None
    if password_env is not None:
        password = os.environ.get(password_env)
        if not password:
            raise click.UsageError(f"--password-env {password_env}: that environment variable is not set")
    store = state.store(create=False)
    role = create_reader_role(store.engine, store.url, name, password)
    if as_json:
        echo_json({"name": role.name, "created": role.created, "tables": role.tables, "url": role.url})
        return
    click.echo(
        f"{'created' if role.created else 'updated'} role {role.name}: SELECT on the store's {role.tables} "
        f"tables and nothing else; `hcapo-store sql` runs as it ({role.url})"
    )


@db.command("upgrade")
@click.option("--no-backup", is_flag=True, help="Skip the SQLite backup copy taken before upgrading.")
@pass_ctx
def db_upgrade(state: Ctx, no_backup: bool) -> None:
    """Upgrade the database schema to this version's head (backs up SQLite files first)."""
    from hcapo_store.storage import db as dbmod

    result = dbmod.upgrade_database(state.db, take_backup=not no_backup)
    if not result.changed:
        click.echo(f"{result.url}: already at head {result.head}")
        return
    if result.backup:
        click.echo(f"backup: {result.backup}")
    click.echo(f"{result.url}: {result.before or 'empty'} → {result.head}")


@cli.command(epilog="Reference: docs/DATABASE.md in the hcapo-store repository.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def status(state: Ctx, as_json: bool) -> None:
    """Counts of episodes, steps, subtasks; per scorer scored / failed / missing; workers."""
    from hcapo_store.status_report import status as get_status

    data = get_status(state.store(create=False))
    if as_json:
        echo_json(data.as_dict())
        return
    click.echo(f"database     {data.database}")
    click.echo(f"episodes     {data.episodes} (+{data.superseded_versions} superseded versions)")
    phases = ", ".join(f"{k} {v}" for k, v in data.steps_by_phase.items())
    click.echo(f"steps        {data.steps}" + (f" ({phases})" if phases else ""))
    click.echo(f"messages     {data.messages}")
    click.echo(f"subtasks     {data.subtasks}")
    click.echo(f"credit runs  {data.credit_runs}")
    if not data.scorers:
        click.echo(f"scorers      none yet: scored 0 / failed 0 / missing {data.steps}")
    for s in data.scorers:
        click.echo(
            f"scorer {s['scorer_id'][:12]}  {s['label']}: scored {s['scored']} / "
            f"failed {s['failed']} / missing {s['missing']} (leased {s['leased']})"
        )
    notes = {"dead": " (process gone: killed?)", "stale": " (no heartbeat within its lease: hung, or gone)"}
    for w in data.workers[:20]:
        click.echo(
            f"worker {w.id}: {w.state}{notes.get(w.state, '')}, {w.leases} lease(s), "
            f"scored {w.scored}, failed {w.failed}, last heartbeat {w.seconds_since_heartbeat}s ago"
        )


@cli.command(epilog="Reference: docs/OUTPUTS.md and docs/PROMISES.md in the hcapo-store repository.")
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="The same as --format json (as every data command).")
@click.option("--write", is_flag=True, help="Allow statements that modify the database.")
@click.option(
    "--timeout",
    type=FiniteFloat(0, 86400),
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="Stop the statement after this long (on the server for PostgreSQL); 0: no limit. Ctrl-C stops it too.",
)
@pass_ctx
def sql(state: Ctx, query: str, fmt: str, as_json: bool, write: bool, timeout: float) -> None:
    """Run one SQL statement against the store (read-only unless --write).

    Tables: episodes, messages, steps, subtasks, tags, scorers, scores, attempts,
    credit_runs, credits. Views: step_scores, step_credits, subtask_credits.
    """
    if as_json and fmt not in ("table", "json"):
        raise click.UsageError(f"--json and --format {fmt} ask for two formats: pick one")
    fmt = "json" if as_json else fmt

    def write_out(columns: list[str], rows: Iterator[tuple]) -> None:
        # Each row goes to the output as it is fetched: a result of any size costs a few rows'
        # memory (the table shows its first TABLE_ROWS and counts the rest).
        if not columns:
            click.echo("ok")
        elif fmt == "csv":
            for piece in formatting.csv_lines(columns, rows, terminal=sys.stdout.isatty()):
                click.echo(piece, nl=False)
        elif fmt == "json":
            for piece in formatting.json_lines(columns, rows):
                click.echo(piece, nl=False)
        else:
            shown = list(itertools.islice(rows, TABLE_ROWS))
            rest = sum(1 for _ in rows)
            click.echo(formatting.table(columns, shown, full="--format json (or csv)"))
            n = len(shown) + rest
            more = f"; the first {len(shown)} shown: --format csv or json writes them all" if rest else ""
            click.echo(f"({n} row{'s' if n != 1 else ''}{more})")

    state.store(create=False).stream(query, write_out, read_only=not write, timeout=timeout, as_reader=True)
