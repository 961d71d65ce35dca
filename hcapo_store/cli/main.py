"""The root command group, the shared context and the one place library errors become messages.

Commands live in the sibling modules, one per stage; each parses options, calls the
library and prints. Library errors (``HcapoError``) become one-line messages in
``Group.invoke``.
"""

from __future__ import annotations

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


class Group(click.Group):
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


class Ctx:
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


pass_ctx = click.make_pass_decorator(Ctx)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
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

    Typical flow: ingest → score → credits compute → sql / export. Each command's
    reference is a page of docs/ in the repository (its --help names it).
    """
    state = Ctx(db)
    ctx.obj = state
    ctx.call_on_close(state.close)


def echo_json(data: Any) -> None:
    click.echo(formatting.dumps(data))


def warn(warnings: list[str]) -> None:
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
