"""The one place that reads the wall clock.

Leases are judged by a single clock: epoch seconds as floats. On PostgreSQL the
scheduler reads the database server's clock instead (see ``dialect.py``) so that
several machines agree.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone


def now() -> float:
    """Seconds since the epoch (UTC)."""
    return time.time()


def utcnow() -> datetime:
    return datetime.now(timezone.utc)
