"""The exception hierarchy of hcapo-store.

Library code raises these; the CLI maps them to messages and exit codes in one place
(``cli.py``). Foreign exceptions (SQLAlchemy, httpx, json) are translated where they
enter the library, with ``raise ... from exc``.
"""

from __future__ import annotations

from typing import Any


class HcapoError(Exception):
    """Base class of every error hcapo-store raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole, whatever the subclass's __init__ takes: an error raised in a worker
        # process (ingest parses there) reaches the parent with its message and attributes.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[HcapoError], args: tuple[Any, ...], state: dict[str, Any]) -> HcapoError:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class MissingExtra(HcapoError):
    """An optional dependency (torch, pyarrow, ...) is not installed; names the extra to install."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        self.module, self.extra = module, extra
        super().__init__(f"{purpose} needs {module}, which is not installed: pip install 'hcapo-store[{extra}]'")


class StoreError(HcapoError):
    """The database cannot be opened or used."""


class StoreGone(StoreError):
    """The database is not there any more (``Store.identity``): the SQLite file deleted, the
    PostgreSQL database dropped, or its server not answering. The message says which."""


class SchemaOutOfDate(StoreError):
    """The database is behind the code's schema head; the user must upgrade it."""

    def __init__(self, url: str, current: str | None, head: str) -> None:
        self.url, self.current, self.head = url, current, head
        super().__init__(
            f"Database {url} is at schema revision {current or 'none'}, this version of "
            f"hcapo-store needs {head}: run `hcapo-store --db {url} db upgrade` "
            "(it backs the file up first)."
        )


class SchemaTooNew(StoreError):
    """The database was written by a newer hcapo-store."""


class DatabaseLocked(StoreError):
    """Another process held the database's write lock longer than the busy timeout."""


class DatabaseFull(StoreError):
    """The disk (or the database's size limit) is full; the transaction was rolled back."""


class NotAStore(StoreError):
    """The file is a database, but not an hcapo-store one; it is left untouched."""


class UsageError(HcapoError):
    """An option or argument the database cannot hold (too long, a NUL character); nothing was done."""


class IngestError(HcapoError):
    """One episode could not be read; carries the file (and line) at fault."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        self.path, self.line = path, line
        where = path or ""
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {message}" if where else message)


class EpisodeLookupError(HcapoError):
    """An episode given by name or id matches no episode, or several (the message lists them)."""


class SkipEpisode(HcapoError):
    """The input is valid but not ingestable yet (e.g. no reward); not a failure."""


class ScoringError(HcapoError):
    """Scoring cannot start or continue (bad options, unknown scorer, server mismatch)."""


class InferenceError(HcapoError):
    """A request to an inference backend failed.

    ``kind`` is a short machine-readable label stored with the failed attempt
    (``http_503``, ``timeout``, ``connect``, ``abort``, ``bad_response``, ``mismatch`` …);
    ``retryable`` says whether the same request may succeed later.
    """

    def __init__(self, kind: str, message: str, *, retryable: bool, retry_after: float | None = None) -> None:
        self.kind, self.retryable, self.retry_after = kind, retryable, retry_after
        super().__init__(f"{kind}: {message}")


class BatchNotReady(HcapoError):
    """``wait_for_batch`` timed out: the batch of that key or training step was not published."""


class CreditError(HcapoError):
    """A credit run cannot be computed or found."""


class InvalidCreditParams(CreditError, ValueError):
    """A hyperparameter outside its valid range (still a ValueError for library callers)."""


class ExportError(HcapoError):
    """An export cannot be written."""


class TrainingDataError(HcapoError, ValueError):
    """Training rows that a trainer must not use as they are (another tokenizer, wrong columns)."""


class HandoffError(HcapoError, ValueError):
    """A credit run's advantages cannot be placed on a trainer's token ids (names the step)."""
