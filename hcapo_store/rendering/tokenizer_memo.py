"""``AutoTokenizer``'s choice of class for a tokenizer directory, kept across processes.

Importing ``AutoTokenizer`` imports torch: ~2.5 s of CPU at the start of every ``score``,
``follow`` or ``ingest`` that loads a tokenizer and never runs a model (bench/tokenizer_load.py).
A process that loads ``AutoTokenizer``'s way (``tokenizers.load_by_rule``) records the class it
chose and the digest of what it loaded (``tokenizers.load_digest``) here; a later process
whose tokenizer files, ``config.json`` (``AutoTokenizer`` reads its model type) and tokenizer
libraries are the same loads through that class instead, held to the recorded digest at every
load (``tokenizers.load_as``: the ``tokenizer_class`` strategy, rendering/verify.py). A missing,
unreadable or foreign record is a miss; a miss, a failed load or another digest is the rule
again, which records anew.

One small JSON file per key, named by the key's hash, in :func:`memo_dir`. A record says only
which class to try: it never stands in for a check, so a stale or edited one costs a rule load.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_ENV = "HCAPO_CACHE_DIR"

# What decides AutoTokenizer's class and what the class builds, beside the files themselves:
# transformers and tokenizers, and the optional libraries its slow/fast choices look for.
_LIBRARIES = ("transformers", "tokenizers", "sentencepiece", "tiktoken", "protobuf", "mistral-common")

FilesState = tuple[str, tuple[tuple[str, int, int], ...]]


def memo_dir() -> Path:
    """Where records live: ``$HCAPO_CACHE_DIR/tokenizer-classes``, else under
    ``$XDG_CACHE_HOME/hcapo-store``, else ``~/.cache/hcapo-store``."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "hcapo-store") if xdg else str(Path.home() / ".cache" / "hcapo-store")
    return Path(base).expanduser() / "tokenizer-classes"


@functools.cache
def _versions() -> tuple[tuple[str, str | None], ...]:
    """The installed versions of ``_LIBRARIES`` (None: not installed), read from their metadata
    without importing them (~8 ms, once per process)."""
    found: list[tuple[str, str | None]] = []
    for name in _LIBRARIES:
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            found.append((name, None))
    return tuple(found)


def key(files: FilesState) -> dict[str, Any]:
    """What a record is valid for: the tokenizer files' state (``tokenizers.files_state``), the
    directory's ``config.json`` (size, mtime), the libraries' versions and Python's."""
    try:
        st = (Path(files[0]) / "config.json").stat()
        config: list[int] | None = [st.st_size, st.st_mtime_ns]
    except OSError:
        config = None
    return {
        "directory": files[0],
        "files": [list(entry) for entry in files[1]],
        "config_json": config,
        "libraries": [list(entry) for entry in _versions()],
        "python": list(sys.version_info[:2]),
    }


def _path(k: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()
    return memo_dir() / f"{name}.json"


def read(files: FilesState) -> tuple[str, str, str] | None:
    """The (module, class name, digest) recorded for ``files`` as they are now, or None."""
    k = key(files)
    path = _path(k)
    try:
        record = json.loads(path.read_bytes())
        fields = (record["module"], record["qualname"], record["digest"])
        if record["key"] != k or not all(isinstance(f, str) for f in fields):
            raise ValueError("not a record of this key")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("tokenizer class record %s not used: %s", path, exc)
        return None
    return fields


def write(files: FilesState, module: str, qualname: str, digest: str) -> None:
    """Record the rule's load of ``files`` (unchanged records are not rewritten). A cache that
    cannot be written is not an error: the next process loads by the rule again."""
    k = key(files)
    path = _path(k)
    record = {"key": k, "module": module, "qualname": qualname, "digest": digest}
    data = json.dumps(record, sort_keys=True, indent=1).encode()
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: several processes may record the same key at once
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.debug("tokenizer class record %s not written: %s", path, exc)
