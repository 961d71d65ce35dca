"""Offline tokenizer loading and the fingerprint that goes into the scorer identity."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

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
    from transformers import AutoTokenizer

    directory = resolve_tokenizer_dir(path_or_name)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {directory}: {exc}") from exc


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_fingerprint(tokenizer: Any, path_or_name: str | Path) -> dict[str, Any]:
    directory = resolve_tokenizer_dir(path_or_name)
    files = sorted(name for name in TOKENIZER_FILES if (directory / name).is_file())
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0" + _sha256((directory / name).read_bytes()).encode() + b"\n")
    try:
        template: str | None = tokenizer.get_chat_template()
    except ValueError:  # no chat template at all
        template = None
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    return {
        "name": directory.name,
        "files": files,
        "files_sha256": digest.hexdigest(),
        "chat_template_sha256": None if template is None else _sha256(template.encode("utf-8")),
        "adds_bos": bos is not None and bool(probe) and probe[0] == bos,
    }
