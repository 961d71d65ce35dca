"""The tokenized export as a trainer reads it, and the checks before a trainer may use it.

The ids are ``token_ids``, not ``input_ids`` (``rendering/token_format.py`` says why);
``as_model_inputs`` gives them that name for a trainer that does use the advantages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hcapo_store.errors import TrainingDataError
from hcapo_store.rendering.token_format import COLUMNS, FINGERPRINT_KEYS, TOKEN_IDS


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an ``export dataset --tokenized`` file (.jsonl or .parquet)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise TrainingDataError(f"{path}:{n}: not a JSON line ({exc.msg})") from exc
    return rows


def rows_fingerprint(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The tokenizer fingerprint every row was exported with (refused when rows disagree)."""
    seen: dict[tuple, dict[str, Any]] = {}
    for i, row in enumerate(rows):
        missing = [c for c in COLUMNS if c not in row]
        if missing:
            hint = " (an `input_ids` column: re-export with this version)" if "input_ids" in row else ""
            raise TrainingDataError(
                f"row {i} is not a tokenized export row: no {', '.join(missing)}{hint}; "
                "write one with `hcapo-store export dataset OUT --tokenized --tokenizer DIR`"
            )
        prov = row.get("provenance") or {}
        key = tuple(prov.get(k) for k in FINGERPRINT_KEYS)
        if key[0] is None:
            raise TrainingDataError(f"row {i} has no tokenizer fingerprint in its provenance")
        seen.setdefault(
            key,
            {
                "tokenizer": prov.get("tokenizer"),
                "tokenizer_content_sha256": prov.get("tokenizer_content_sha256"),  # rows of older versions: None
                **dict(zip(FINGERPRINT_KEYS, key)),
            },
        )
    if not seen:
        raise TrainingDataError("no rows to train on")
    if len(seen) > 1:
        names = sorted(str(v["tokenizer"]) for v in seen.values())
        raise TrainingDataError(f"the rows come from {len(seen)} different tokenizers ({', '.join(names)})")
    return next(iter(seen.values()))


def check_tokenizer(rows: Iterable[Mapping[str, Any]], tokenizer: Any, tokenizer_dir: str | Path | None = None) -> None:
    """Refuses rows exported with another tokenizer or chat template than ``tokenizer``.

    ``tokenizer_dir`` is the directory the tokenizer was loaded from (default: its
    ``name_or_path``); the fingerprint hashes its files, as the scorer's does.
    """
    from hcapo_store.rendering.tokenizers import content_sha256, tokenizer_fingerprint

    theirs = rows_fingerprint(rows)
    where = tokenizer_dir if tokenizer_dir is not None else getattr(tokenizer, "name_or_path", None)
    if not where or not Path(where).is_dir():
        raise TrainingDataError(
            f"cannot fingerprint the tokenizer ({where!r} is not a directory): pass tokenizer_dir= "
            "(the directory the model's tokenizer files are in)"
        )
    mine = tokenizer_fingerprint(tokenizer, where)
    for key, ours in (("tokenizer_files_sha256", "files_sha256"), ("chat_template_sha256", "chat_template_sha256")):
        if theirs[key] != mine[ours]:
            # other bytes, the same content: a re-saved copy (trainers save one into every checkpoint)
            recorded = theirs.get("tokenizer_content_sha256")
            if recorded is not None and recorded == content_sha256(tokenizer):
                return
            why = f"{key} differs" + (", and so does its content" if recorded is not None else "")
            raise TrainingDataError(
                f"the rows were exported with tokenizer {theirs['tokenizer']!r}, not the one in {where} "
                f"({why}): train the model whose tokenizer scored the run, or export again with "
                f"--tokenizer {where}"
            )


def as_model_inputs(row: Mapping[str, Any], max_length: int | None = None, keep: str = "start") -> dict[str, Any]:
    """``input_ids``/``labels``/``advantages`` of one row, cut to ``max_length`` (``keep``
    ``start`` or ``end``) — the three together, so an advantage never moves to another token."""
    ids, labels, adv = row[TOKEN_IDS], row["labels"], row["advantages"]
    if not len(ids) == len(labels) == len(adv):
        raise TrainingDataError(
            f"row {row.get('episode', '?')}: token_ids, labels and advantages differ in length "
            f"({len(ids)}, {len(labels)}, {len(adv)})"
        )
    if max_length is not None and len(ids) > max_length:
        cut = slice(None, max_length) if keep == "start" else slice(-max_length, None)
        ids, labels, adv = ids[cut], labels[cut], adv[cut]
    return {"input_ids": list(ids), "labels": list(labels), "advantages": [float(a) for a in adv]}
