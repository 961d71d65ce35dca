"""Where the database is: the default file, the environment variable, URL spelling.

Kept free of SQLAlchemy so that the CLI can build its options (and ``--help``) without
importing the database stack.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DB = "hcapo.db"
ENV_DB = "HCAPO_STORE_DB"


# The URL schemes a store may live under (SQLAlchemy's spelling; postgres:// is PostgreSQL too).
SCHEMES = ("sqlite", "postgresql", "postgres", "postgresql+psycopg")
FORMS = "a SQLite file path, sqlite:////ABSOLUTE/PATH or postgresql://USER@HOST[:PORT]/DATABASE"


def resolve_url(db: str | os.PathLike[str] | None) -> str:
    """A path becomes a SQLite URL; ``postgresql://`` gets the psycopg 3 driver. None: the
    environment's or the default file; an empty value or an unknown scheme is refused
    (``UsageError``) before anything is opened."""
    from hcapo_store.errors import UsageError

    if db is not None and not str(db).strip():
        raise UsageError(f"--db is empty: pass {FORMS} (or leave --db out for ./{DEFAULT_DB} or ${ENV_DB})")
    db = str(db or os.environ.get(ENV_DB) or DEFAULT_DB)
    if "://" not in db:
        return "sqlite:///" + str(Path(db).expanduser().resolve())
    scheme, _, rest = db.partition("://")
    if scheme.lower() not in SCHEMES:
        raise UsageError(f"--db {display_url(db)}: the scheme {scheme!r} is not supported; pass {FORMS}")
    if scheme.lower() == "sqlite" and rest.lstrip("/") in ("", ":memory:") and rest != "/:memory:":
        raise UsageError(f"--db {db}: the URL names no file; pass {FORMS}")
    if scheme.lower() in ("postgresql", "postgres"):
        return "postgresql+psycopg://" + rest
    return db


def display_url(url: str) -> str:
    """What to show users: the file path for SQLite, the URL without password otherwise."""
    if url.startswith("sqlite:///"):
        return url[len("sqlite:///") :]
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        from hcapo_store.masking import mask_url

        return mask_url(url)
