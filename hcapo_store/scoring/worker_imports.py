"""Imported once by the forkserver of the prepare pools (scoring/preparing.py), before it forks
any worker, when the application asks for it (``worker_processes.preload(PREPARE)``: ``score``
does): the modules every worker needs before its first episode.
A worker loads its tokenizer through the class ``AutoTokenizer`` chose in the parent
(``tokenizers.load_as``): transformers' tokenizer base classes, imported here (~1 s of CPU on a
2-core machine), not ``AutoTokenizer``, whose import brings torch (~1.5 s more, ~185 MB). A
module missing here is imported by the worker as before."""

from __future__ import annotations

import contextlib

import hcapo_store.scoring.preparing  # noqa: F401 - the workers' own code

with contextlib.suppress(ImportError):  # without transformers a worker fails as it would anyway
    # the names resolve transformers' lazy modules; the classes are not used here
    from transformers import PreTrainedTokenizerFast  # noqa: F401
    from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: F401
