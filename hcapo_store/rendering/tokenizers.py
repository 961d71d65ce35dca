"""Offline tokenizer loading and the fingerprint that goes into the scorer identity."""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hcapo_store.rendering import tokenizer_memo

# Files that change how text becomes ids or how messages become text.
TOKENIZER_FILES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "merges.txt",
    "special_tokens_map.json",
    "spiece.model",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
)


def resolve_tokenizer_dir(path_or_name: str | Path) -> Path:
    """A local directory as given, or the locally cached snapshot of a hub name (never downloads)."""
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path_or_name), local_files_only=True))
    except Exception as exc:  # hub errors vary by version; the message is what matters
        raise FileNotFoundError(
            f"tokenizer {path_or_name!r}: no such directory and no locally cached copy "
            "(hcapo-store never downloads; pass a directory with tokenizer files)"
        ) from exc


def load_tokenizer(path_or_name: str | Path) -> Any:
    """``path_or_name``'s tokenizer, the one ``AutoTokenizer`` loads. Where this process has not
    imported ``AutoTokenizer`` (whose import brings torch) and an earlier process recorded the
    class it chose for the same files and library versions (rendering/tokenizer_memo.py),
    through that class, held to the recorded digest (:func:`load_as`); else by the rule
    (:func:`load_by_rule`). ``HCAPO_RENDERING=reference`` always goes by the rule."""
    from hcapo_store.rendering import verify

    directory = resolve_tokenizer_dir(path_or_name)
    if _AUTO_MODULE not in sys.modules and not verify.reference_mode():
        state = files_state(directory)
        recorded = tokenizer_memo.read(state)
        if recorded is not None:
            loaded = LoadedClass(*recorded, files=state)
            tokenizer = _through_class(directory, loaded)
            if tokenizer is not None:
                _remember(loaded)
                return tokenizer
    return load_by_rule(directory)


def load_by_rule(path_or_name: str | Path) -> Any:
    """``path_or_name``'s tokenizer as ``AutoTokenizer`` loads it: the rule every other load is
    held to, remembered by class and digest for :func:`loaded_class` and for later processes
    (rendering/tokenizer_memo.py)."""
    from transformers import AutoTokenizer

    directory = resolve_tokenizer_dir(path_or_name)
    state = files_state(directory)  # read before loading: a change meanwhile is not remembered as it
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {directory}: {exc}") from exc
    cls = type(tokenizer)
    loaded = LoadedClass(cls.__module__, cls.__qualname__, load_digest(tokenizer), state)
    _remember(loaded)
    if _importable(loaded):
        tokenizer_memo.write(state, loaded.module, loaded.qualname, loaded.digest)
    return tokenizer


# Where AutoTokenizer lives: once it is imported, loading through it costs no more than a class's load.
_AUTO_MODULE = "transformers.models.auto.tokenization_auto"


@dataclass(frozen=True)
class LoadedClass:
    """The class ``AutoTokenizer`` chose for a directory's tokenizer files, and the digest of what
    it loaded (:func:`load_digest`): what lets another process load the same tokenizer through
    the class alone (:func:`load_as`). Importing ``AutoTokenizer`` imports torch (transformers'
    configuration classes import it): ~1.5 s of CPU and ~185 MB in each process that prepares
    prompts and never runs a model (bench/tokenizer_load.py)."""

    module: str
    qualname: str
    digest: str
    files: tuple[str, tuple[tuple[str, int, int], ...]]  # files_state when it was loaded


_LOADED: dict[tuple[str, tuple[tuple[str, int, int], ...]], LoadedClass] = {}
_loaded_lock = threading.Lock()


def _remember(loaded: LoadedClass) -> None:
    with _loaded_lock:
        if len(_LOADED) >= 64:
            _LOADED.clear()
        _LOADED[loaded.files] = loaded


def loaded_class(path_or_name: str | Path) -> LoadedClass | None:
    """How :func:`load_tokenizer` loaded ``path_or_name``'s current files in this process (its
    class and the rule's digest), or None when it did not (or they changed since)."""
    state = files_state(path_or_name)
    with _loaded_lock:
        return _LOADED.get(state)


def load_as(path_or_name: str | Path, loaded: LoadedClass | None) -> Any:
    """``path_or_name``'s tokenizer through the class ``AutoTokenizer`` chose for it in another
    process (``loaded``), without importing ``AutoTokenizer``: the ``tokenizer_class`` strategy
    (rendering/verify.py), held to its rule at every load. Where there is nothing to go by
    (``loaded`` None, or files changed since) it is :func:`load_tokenizer`'s; where the class
    fails to load, is not one of transformers' own, or its tokenizer's digest differs from the
    rule's, the rule's (counted and logged as a fallback)."""
    directory = resolve_tokenizer_dir(path_or_name)
    if loaded is None or files_state(directory) != loaded.files:  # not this check's case
        return load_tokenizer(directory)
    tokenizer = _through_class(directory, loaded)
    return tokenizer if tokenizer is not None else load_by_rule(directory)


def _importable(loaded: LoadedClass) -> bool:
    """Whether ``loaded``'s class is one of transformers' own, by module and name (remote code
    and nested classes: the rule decides)."""
    return loaded.module.startswith("transformers.") and "." not in loaded.qualname


def _through_class(directory: Path, loaded: LoadedClass) -> Any:
    """``directory``'s tokenizer loaded through ``loaded``'s class when its digest is the one
    recorded, else None (a fallback, counted, where the class could be tried)."""
    if not _importable(loaded):
        return None
    from hcapo_store.rendering import verify

    try:
        cls = getattr(importlib.import_module(loaded.module), loaded.qualname)
        tokenizer = cls.from_pretrained(str(directory), local_files_only=True)
    except (ImportError, AttributeError, OSError, ValueError, TypeError) as exc:
        verify.disagreed(verify.TOKENIZER_CLASS, f"{loaded.qualname} did not load {directory}: {exc}")
        return None
    if load_digest(tokenizer) != loaded.digest:
        verify.disagreed(
            verify.TOKENIZER_CLASS, f"{loaded.qualname}'s tokenizer of {directory} differs from AutoTokenizer's"
        )
        return None
    return tokenizer


# Crosses the whole pipeline (normalizer, pre-tokenizer, model, post-processor): spaces, digits,
# newlines and tabs, accents, CJK, an emoji, and (added below) the tokenizer's own special tokens.
_PROBE = "Hello, world!  It's 2026:\n\tx = [1, 22, 333]; naïve café 東京 🙂 </s> <|im_end|>"


def load_digest(tokenizer: Any) -> str:
    """What a load made, in ~1 ms: its class, its settings (``init_kwargs`` but its path), its
    size, added and special tokens, chat template, and the ids of a probe text through the
    whole pipeline. Two loads of the same files agree where class and arguments agree; a load
    through another class (``LlamaTokenizer`` where ``AutoTokenizer`` takes ``TokenizersBackend``)
    differs in the class, and where it builds another pipeline, in the probe's ids."""
    cls = type(tokenizer)
    settings = {k: _plain(v) for k, v in sorted(tokenizer.init_kwargs.items()) if k != "name_or_path"}
    added = sorted((int(i), repr(t)) for i, t in tokenizer.added_tokens_decoder.items())
    special = {k: _plain(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    probe = _PROBE + "".join(sorted(str(t) for t in tokenizer.all_special_tokens))
    parts = [
        cls.__module__,
        cls.__qualname__,
        len(tokenizer),
        settings,
        added,
        special,
        getattr(tokenizer, "chat_template", None),
        tokenizer(probe, add_special_tokens=True)["input_ids"],
        tokenizer(probe, add_special_tokens=False)["input_ids"],
    ]
    return _sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode())


def _plain(value: Any) -> Any:
    """``value`` as JSON that is the same in every process (no object addresses)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def files_state(path_or_name: str | Path) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """The directory and the (name, size, mtime_ns) of its tokenizer files (``TOKENIZER_FILES``):
    what tells whether a tokenizer loaded from it earlier is still the one there."""
    directory = resolve_tokenizer_dir(path_or_name)
    state = []
    for name in TOKENIZER_FILES:
        try:
            st = (directory / name).stat()
        except FileNotFoundError:
            continue
        state.append((name, st.st_size, st.st_mtime_ns))
    return str(directory.resolve()), tuple(state)


def loaded_from(tokenizer: Any, path_or_name: str | Path) -> bool:
    """Whether ``tokenizer`` was loaded from ``path_or_name`` (its ``name_or_path``, as
    ``load_tokenizer`` sets it, names the same directory)."""
    source = getattr(tokenizer, "name_or_path", None)
    if not source:
        return False
    if str(source) == str(path_or_name):
        return True
    try:
        return resolve_tokenizer_dir(source).resolve() == resolve_tokenizer_dir(path_or_name).resolve()
    except FileNotFoundError:
        return False


def given_or_loaded(directory: str | Path, given: Any, error: type[Exception]) -> Any:
    """``given`` (a tokenizer the caller loaded from ``directory``: ValueError naming both when it
    was loaded from elsewhere), else ``directory``'s tokenizer loaded now (``error`` with the
    reason when it cannot be)."""
    if given is not None:
        if not loaded_from(given, directory):
            raise ValueError(
                f"the tokenizer given was loaded from {getattr(given, 'name_or_path', None)!r}, not from "
                f"{str(directory)!r}: pass the tokenizer loaded from that directory"
            )
        return given
    try:
        return load_tokenizer(directory)
    except (OSError, ValueError) as exc:
        raise error(f"cannot load tokenizer {directory}: {exc}") from exc


class PerTokenizer:
    """A value kept per tokenizer object while ``state`` (what it was made from: the object's
    size, chat template...) stays the same, dropped with the object: a trainer makes new builders
    and renderers of its one kept tokenizer every step. A tokenizer that cannot be weakly
    referenced gets a value made for the call."""

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, tokenizer: Any, state: Any, make: Callable[[], Any]) -> Any:
        with self._lock:  # one value per object: callers in several threads share it
            try:
                held = self._kept.get(tokenizer)
            except TypeError:  # not weak-referenceable or not hashable
                return make()
            if held is None or held[0] != state:
                held = self._kept[tokenizer] = (state, make())
            return held[1]


class KeptTokenizer:
    """One directory's tokenizer, loaded on first use and kept: loaded again only when the
    directory's tokenizer files change (``files_state``: a file rewritten in place, added or
    removed). For its owner's read-only use, e.g. ``StoreAdvantages`` handing it to
    ``score_live`` and ``Handoff`` each training step (neither changes a tokenizer): not a cache
    for code that adds tokens or sets a chat template (``load_tokenizer`` gives such code its own)."""

    def __init__(self, path_or_name: str | Path) -> None:
        self.path = path_or_name
        self.loads = 0  # how many times it was loaded
        self._state: tuple[str, tuple[tuple[str, int, int], ...]] | None = None
        self._tokenizer: Any = None

    def get(self) -> Any:
        state = files_state(self.path)  # read before loading: a change during the load is seen next time
        if self._tokenizer is None or state != self._state:
            self._tokenizer = load_tokenizer(self.path)
            self._state = state
            self.loads += 1
        return self._tokenizer


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# files_state(directory) -> (files, files_sha256): the files hashed once while their sizes and
# mtimes stay (KeptTokenizer's rule); a trainer's every step fingerprints its tokenizer (~0.05 s a hash)
_FILE_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int], ...]], tuple[list[str], str]] = {}


def _files_digest(directory: Path) -> tuple[list[str], str]:
    """The directory's tokenizer files and the sha256 over their names and contents."""
    state = files_state(directory)  # read before hashing: a change meanwhile is seen next time
    kept = _FILE_DIGESTS.get(state)
    if kept is not None:
        return list(kept[0]), kept[1]
    files = sorted(name for name in TOKENIZER_FILES if (directory / name).is_file())
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0" + _sha256((directory / name).read_bytes()).encode() + b"\n")
    if len(_FILE_DIGESTS) >= 64:
        _FILE_DIGESTS.clear()
    _FILE_DIGESTS[state] = (files, digest.hexdigest())
    return list(files), digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any, path_or_name: str | Path) -> dict[str, Any]:
    directory = resolve_tokenizer_dir(path_or_name)
    files, files_sha256 = _files_digest(directory)
    try:
        template: str | None = tokenizer.get_chat_template()
    except ValueError:  # no chat template at all
        template = None
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    import tokenizers

    return {
        "name": directory.name,
        "files": files,
        "files_sha256": files_sha256,
        "chat_template_sha256": None if template is None else _sha256(template.encode("utf-8")),
        "adds_bos": bos is not None and bool(probe) and probe[0] == bos,
        # what turns the files into ids: the scorer names everything that changes its numbers, so
        # a `tokenizers` upgrade (or another transformers tokenizer class) starts a new scorer even
        # where the probe conversation tokenizes the same (docs/SCORING.md)
        "tokenizers_version": tokenizers.__version__,
        "class": type(tokenizer).__name__,
    }


def tokenizer_content(tokenizer: Any) -> dict[str, str]:
    """What makes a tokenizer's ids and chat texts, part by part, as hashes: its vocabulary,
    merges, added tokens, the pipeline around the model (normalizer, pre-tokenizer,
    post-processor, decoder), the special tokens it names and its chat template.

    Computed on load, never stored: a tokenizer re-saved with ``save_pretrained`` (trainers do
    this into every checkpoint) has other bytes but the same content. Two tokenizers with the
    same content turn the same messages into the same ids."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}
    model = spec.get("model") or {}
    vocab = model.get("vocab") if model else tokenizer.get_vocab()
    try:
        template: str | None = tokenizer.get_chat_template()
    except ValueError:  # no chat template at all
        template = None
    parts: dict[str, Any] = {
        "vocabulary": vocab,
        "merges": [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []],
        "model": {k: v for k, v in model.items() if k not in ("vocab", "merges")},
        "added_tokens": sorted(
            (
                int(i),
                t.content,
                bool(t.special),
                bool(t.lstrip),
                bool(t.rstrip),
                bool(t.normalized),
                bool(t.single_word),
            )
            for i, t in tokenizer.added_tokens_decoder.items()
        ),
        "pipeline": {k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder")},
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": template,
    }
    return {
        name: _sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()) for name, value in parts.items()
    }


def content_sha256(tokenizer: Any) -> str:
    """One hash of :func:`tokenizer_content`: equal for a tokenizer and its re-saved copies."""
    return _sha256(json.dumps(tokenizer_content(tokenizer), sort_keys=True).encode())


def content_difference(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The parts (``tokenizer_content`` keys) in which two tokenizers differ."""
    return [name for name in sorted(set(mine) | set(theirs)) if mine.get(name) != theirs.get(name)]
