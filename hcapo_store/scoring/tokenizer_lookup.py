"""The tokenizer a scorer used, found again (from a directory given, or from where the store
records it was loaded) and checked against the scorer's fingerprint: what the tokenized
export, ``Handoff`` and the episode pages render with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hcapo_store.errors import ExportError
from hcapo_store.rendering.tokenizers import (
    content_difference,
    given_or_loaded,
    load_tokenizer,
    tokenizer_content,
    tokenizer_fingerprint,
)
from hcapo_store.scoring.scorer import scorer_tokenizer_record
from hcapo_store.storage.store import Store


def scorer_tokenizer(
    store: Store,
    scorer_id: str,
    tokenizer_dir: str | Path | None = None,
    *,
    note: Callable[[str], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The tokenizer in ``tokenizer_dir`` and its fingerprint, refused unless it is the
    scorer's. Without a directory: the first of those the scorer's tokenizer was loaded from
    (recorded when scoring: ``score``, ``score-rollout``; the store's ``tokenizer_locations``)
    whose files still hash exactly as the scorer's did: a directory the store names is anyone's
    choice who could write to it, so a copy equal by content only is not taken from it (pass it
    with ``--tokenizer``). ``note`` is told which directory was taken and why. Reads the store
    only: a read-only credential can export and hand off."""
    return recorded_tokenizer(scorer_id, scorer_tokenizer_record(store, scorer_id), tokenizer_dir, note=note)


def recorded_tokenizer(
    scorer_id: str,
    record: tuple[dict[str, Any], list[Path]],
    tokenizer_dir: str | Path | None = None,
    *,
    note: Callable[[str], None] | None = None,
    loaded: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """:func:`scorer_tokenizer` from the scorer's tokenizer ``record`` already read
    (``scorer_tokenizer_record``: its fingerprint and the directories it was loaded from).
    ``loaded``: the tokenizer already loaded from ``tokenizer_dir`` (e.g. kept across a trainer's
    steps), checked as a loaded one is instead of loading it again."""
    theirs, known = record
    if loaded is not None and tokenizer_dir is None:
        raise ValueError("loaded= is the tokenizer loaded from tokenizer_dir: pass that directory too")
    if tokenizer_dir is not None:
        return _checked_tokenizer(scorer_id, theirs, known, tokenizer_dir, loaded)
    tried = []
    for candidate in known:
        if not candidate.is_dir():
            tried.append(f"{candidate} (not there)")
            continue
        try:
            tokenizer = load_tokenizer(candidate)
        except (OSError, ValueError):
            tried.append(f"{candidate} (cannot be loaded)")
            continue
        mine = tokenizer_fingerprint(tokenizer, candidate)
        if any(theirs.get(key) != mine[key] for key in ("files_sha256", "chat_template_sha256")):
            tried.append(f"{candidate} (its files' hashes differ from the scorer's)")
            continue
        if note is not None:
            note(
                f"tokenizer: {candidate} (no --tokenizer: the store records it as where scorer {scorer_id[:12]}'s "
                f"tokenizer {theirs.get('name', '?')!r} was loaded from, and its files hash as the scorer's)"
            )
        return tokenizer, mine
    where = f" (where the store says it was: {', '.join(tried)})" if tried else ""
    raise ExportError(
        f"this needs the tokenizer scorer {scorer_id[:12]} used ({theirs.get('name', '?')!r}){where}: "
        "pass its directory with --tokenizer DIR"
    )


def _checked_tokenizer(
    scorer_id: str, theirs: dict[str, Any], known: list[Path], tokenizer_dir: str | Path, loaded: Any = None
) -> tuple[Any, dict[str, Any]]:
    tokenizer = given_or_loaded(tokenizer_dir, loaded, ExportError)
    mine = tokenizer_fingerprint(tokenizer, tokenizer_dir)
    same_bytes = all(theirs.get(key) == mine[key] for key in ("files_sha256", "chat_template_sha256"))
    if not same_bytes:  # the fast path failed: compare by content with the scorer's own copy
        _check_content(scorer_id, theirs, known, tokenizer, tokenizer_dir)
    return tokenizer, mine


def _check_content(
    scorer_id: str, theirs: dict[str, Any], known: list[Path], tokenizer: Any, tokenizer_dir: str | Path
) -> None:
    """Accept ``tokenizer`` when its content (vocabulary, merges, added tokens, pipeline, chat
    template) equals that of the scorer's tokenizer, found where it was loaded before with its
    bytes unchanged (stored fingerprints hold file hashes only, so the content is computed on load).
    A trainer's ``save_pretrained`` copy passes; one changed merge does not."""
    used = f"the scorer used {theirs.get('name', '?')!r}"
    for candidate in known:  # where the scorer's tokenizer was loaded from, most recent first
        if not candidate.is_dir():
            continue
        try:
            reference = load_tokenizer(candidate)
        except (OSError, ValueError):
            continue
        ref_print = tokenizer_fingerprint(reference, candidate)
        if any(theirs.get(key) != ref_print[key] for key in ("files_sha256", "chat_template_sha256")):
            continue  # changed since it was remembered
        differs = content_difference(tokenizer_content(tokenizer), tokenizer_content(reference))
        if not differs:
            return
        raise ExportError(
            f"tokenizer {tokenizer_dir} is not the one scorer {scorer_id[:12]} used: its "
            f"{', '.join(d.replace('_', ' ') for d in differs)} differ from {candidate} ({used}): "
            "pass that tokenizer directory"
        )
    raise ExportError(
        f"tokenizer {tokenizer_dir} is not the one scorer {scorer_id[:12]} used (files_sha256 differs; {used}), "
        "and the store records no directory where that tokenizer is, so the two cannot be compared by content: "
        "pass the scorer's own tokenizer directory, or run its `score` once more with `--tokenizer DIR` "
        "(it records where the tokenizer is; then re-saved copies of it are recognised)"
    )
