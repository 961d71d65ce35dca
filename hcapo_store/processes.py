"""Whether a local process is still running (for leases, workers and files of killed runs)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Is a process with this pid running? A zombie (killed, not yet reaped by its
    parent) answers signal 0 but will never renew a lease: it counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (or the pid just went): signal 0 is all we know
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def remove_files_of_dead(paths: Iterable[Path], owner: re.Pattern[str]) -> None:
    """Remove the files whose name says (``owner``'s first group) a process that is gone wrote
    them: temp files and partial copies a ``kill -9`` left behind. Others are left alone."""
    for path in paths:
        found = owner.search(path.name)
        if found and not pid_alive(int(found.group(1))):
            path.unlink(missing_ok=True)
