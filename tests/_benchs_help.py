"""Every bench script's ``--help`` in one process (tests/test_bench_scripts.py): the heavy third-party
imports (torch, transformers, ...) are paid once here, then each script runs in a forked child
exactly as ``python bench/SCRIPT.py --help`` would (``sys.path[0]`` the bench folder,
``__name__ == "__main__"``, its own imports of this package and of its sibling modules, its own
stdout and exit code), so one script's imports or state never help another's.

    python tests/_benchs_help.py bench/a.py bench/b.py ...   # prints {script: [exit code, stdout, stderr]}
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

BENCH_PRELOAD = ("numpy", "torch", "transformers", "sqlalchemy", "click", "httpx")


def _child(script: str, out_fd: int, err_fd: int) -> None:
    import runpy

    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.argv = [script, "--help"]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python bench/SCRIPT.py` sets it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(scripts: list[str]) -> None:
    import importlib

    for name in BENCH_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script that needs it says so itself
    results = {}
    for script in scripts:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(script, out.fileno(), err.fileno())
            _, status = os.waitpid(pid, 0)
            out.seek(0)
            err.seek(0)
            results[script] = [os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()]
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
