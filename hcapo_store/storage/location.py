"""Where the database is: the default file, the environment variable, URL spelling.

Kept free of SQLAlchemy so that the CLI can build its options (and ``--help``) without
importing the database stack.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DB = "hcapo.db"
ENV_DB = "HCAPO_STORE_DB"


def resolve_url(db: str | os.PathLike[str] | None) -> str:
    """A path becomes a SQLite URL; ``postgresql://`` gets the psycopg 3 driver."""
    db = str(db or os.environ.get(ENV_DB) or DEFAULT_DB)
    if "://" not in db:
        return "sqlite:///" + str(Path(db).expanduser().resolve())
    if db.startswith("postgresql://") or db.startswith("postgres://"):
        return "postgresql+psycopg://" + db.split("://", 1)[1]
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
