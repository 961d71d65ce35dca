"""Imported once by the forkserver of the prepare pools (scoring/preparing.py), before it forks
any worker, when the application asks for it (``worker_processes.preload(PREPARE)``: ``score``
does): the modules every worker needs before its first episode.
``load_tokenizer`` imports transformers' tokenizer classes, and torch under them, on first use
(~3 s of CPU on a 2-core machine); imported here, each worker starts with them loaded and pays
only the tokenizer's own files (~0.8 s). A module missing here is imported by the worker as
before."""

from __future__ import annotations

import contextlib

import hcapo_store.scoring.preparing  # noqa: F401 - the workers' own code

with contextlib.suppress(ImportError):  # without transformers a worker fails as it would anyway
    # the names resolve transformers' lazy modules (torch under them); the classes are not used here
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
