"""Bench scripts run the way ``python SCRIPT ARGS...`` runs them, from one process that has paid the
heavy third-party imports (torch, transformers, ...) once: each run is a forked child with
``sys.path[0]`` the script's folder, ``__name__ == "__main__"``, its own imports of this package and
of its sibling modules, its own stdout, stderr and exit code, and its exit handlers run, so one
script's imports or state never help another's (tests/test_bench_scripts.py, test_bench_inputs.py).

    python tests/_forked_runs.py bench/a.py bench/b.py ...  # every --help: {script: [code, stdout, stderr]}
    python tests/_forked_runs.py --serve                    # per stdin line ["SCRIPT", ARGS...]: one line [code, stdout, stderr]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

PRELOAD = ("numpy", "torch", "transformers", "sqlalchemy", "click", "httpx")


def _child(argv: list[str], out_fd: int, err_fd: int) -> None:
    import atexit
    import runpy
    import threading

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:  # what the interpreter does at exit: join threads, run exit handlers (pools, temp dirs)
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(argv: list[str]) -> list:
    """``python *argv`` in a forked child: [exit code, stdout, stderr]."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, out.fileno(), err.fileno())
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return [os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()]


def main(args: list[str]) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script that needs it says so itself
    if args == ["--serve"]:
        for line in sys.stdin:
            print(json.dumps(run(json.loads(line))), flush=True)
        return
    print(json.dumps({script: run([script, "--help"]) for script in args}))


if __name__ == "__main__":
    main(sys.argv[1:])


class Forks:
    """The tests' side of ``--serve``: ``run(SCRIPT, ARGS...)`` returns what
    ``subprocess.run([sys.executable, SCRIPT, ARGS...], capture_output=True, text=True)`` would."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        import select

        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a hang guard below ends the runner and its child together
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(list(args)) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            raise subprocess.TimeoutExpired(list(args), timeout)
        line = self.proc.stdout.readline()
        assert line, "the bench runner ended"
        code, out, err = json.loads(line)
        return subprocess.CompletedProcess(list(args), code, out, err)

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None
