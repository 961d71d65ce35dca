"""How the package starts its worker processes (ingest's parsers, scoring's preparers) and what
the forkserver imports for them before it forks the first.

forkserver, not fork: the parent holds database connections, threads, maybe a CUDA context;
spawn where there is no forkserver (Windows).

Python keeps one forkserver per process, and reads its preload list
(``multiprocessing.set_forkserver_preload``) once, when that server starts: a list set later is
ignored, and a list set by a library replaces its application's. So the library never sets it.
An application that runs our workers names all their imports at once, before the first worker
starts (:func:`preload`); each command of our CLI does. Without it every worker imports what it
needs itself: a prepare worker transformers and torch (~3 CPU-s on a 2-core machine), once, as
its pool is kept for the next runs (scoring/preparing.py).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from multiprocessing.context import BaseContext

# what each kind of worker imports before its first task
INGEST: tuple[str, ...] = ("hcapo_store.ingestion.discovery",)
PREPARE: tuple[str, ...] = ("hcapo_store.scoring.worker_imports",)


_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def context() -> BaseContext:
    """The start method of every worker pool of the package."""
    return multiprocessing.get_context(_METHOD)


def preload(*kinds: Sequence[str]) -> None:
    """For an application (each CLI command that may start workers, a training script): the
    forkserver imports the modules of these kinds (``INGEST``, ``PREPARE``) before it forks any
    worker, so each worker starts with them loaded. Call it before the first worker of the
    process starts; it replaces the process's list, so name every kind the process will run."""
    if _METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(list(dict.fromkeys(m for kind in kinds for m in kind)))


__all__: Sequence[str] = ("INGEST", "PREPARE", "context", "preload")
