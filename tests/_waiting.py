"""Waiting for states, not for time.

``wait_until`` polls a condition (a query, a file, a counter) until it holds. Its timeout,
and every process timeout in the tests (``HANG_GUARD_S``), is a guard against a hang, far
above a run on a machine loaded ten times over (a 30 s test took 300 s+ under stress-ng
plus seven other jobs on 2 cores), never the margin a test relies on; a process that
exits while we wait fails the test at once with its name.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping

HANG_GUARD_S = 1800.0


def wait_until(
    condition: Callable[[], bool],
    what: str,
    *,
    procs: Mapping[str, subprocess.Popen] | None = None,
    poll_s: float = 0.05,
    timeout: float = HANG_GUARD_S,
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for name, proc in (procs or {}).items():
            assert proc.poll() is None, f"{name} exited (status {proc.returncode}) while waiting until {what}"
        assert time.monotonic() < deadline, f"not after {timeout:.0f} s: {what}"
        time.sleep(poll_s)
