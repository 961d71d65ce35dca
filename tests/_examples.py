"""Run an example script (``examples/*.py``) inside the test process, as ``python SCRIPT ARGS``
would: ``__main__``, its own ``sys.argv``, stdout and stderr captured, and the exit status the
interpreter would give (``sys.exit("message")`` prints the message and is 1; an uncaught
exception prints its traceback and is 1). The examples' tests read only the status and the
output, so a process would add nothing but ~4.5 s of torch + transformers imports per run."""

from __future__ import annotations

import contextlib
import io
import logging
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Completed:
    """What ``subprocess.run(..., capture_output=True, text=True)`` returns, for one run in process."""

    returncode: int
    stdout: str
    stderr: str


def _stderr_log_handlers() -> list[logging.StreamHandler]:
    """The logging handlers that write to the terminal's stderr (transformers' own, made when it was
    imported): in a process they would write into the captured stderr, so here too. pytest's own
    handlers (log capture) and handlers of files are left as they are."""
    loggers = [
        logging.getLogger(),
        *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)),
    ]
    found = []
    for logger in loggers:
        for h in logger.handlers:
            # exactly StreamHandler: pytest's capture handlers and file handlers are subclasses
            if type(h) is logging.StreamHandler and h.stream is not sys.stdout and h not in found:
                found.append(h)
    return found


def run_example(script: Path, *args: str, monkeypatch: pytest.MonkeyPatch) -> Completed:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with monkeypatch.context() as m:
        m.setattr(sys, "argv", [str(script), *args])
        m.setenv("HF_HUB_OFFLINE", "1")
        for handler in _stderr_log_handlers():
            m.setattr(handler, "stream", err)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as exc:  # as the interpreter turns it into a status
                if exc.code is None:
                    code = 0
                elif isinstance(exc.code, int):
                    code = exc.code
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
            except Exception:  # as the interpreter reports an uncaught exception
                traceback.print_exc(file=sys.stderr)
                code = 1
    return Completed(code, out.getvalue(), err.getvalue())
