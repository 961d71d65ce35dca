"""Output files: written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through ``write(fileobj)`` into a temp file beside ``path``, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
