"""The rollout's own logprobs as scores of a scorer of kind ``rollout`` (``score-rollout``).

A trainer's rollouts carry the behaviour policy's logprob of every sampled token (OpenAI
``logprobs``, verl's ``rollout_log_probs``, a Pi session's ``logprobs``: read by
``ingestion/rollout_logprobs.py``). Stored as scores they are the student side of a
log-ratio run (``credits compute --variant log-ratio --against``) without any model call.

Each step's entries are checked against the tokenizer's ids of that step: the policy's own
tokens as the tokenized export places them (``turns`` rendering, ``rendering/alignment.py``),
token by token (the id where the entry names one, else its bytes, else its text against the
id's decoding). The entries cover those tokens exactly, or all but a final end-of-turn token
an API does not report (then the scored span is one shorter than the step's own tokens, and
a scorer of the whole span is refused as "other tokens" by the log-ratio run). A step that
does not match fails with its reason (``attempts``, shown by ``status`` / ``scorers list``),
never shifted; steps without entries are left unscored.

The scorer: kind ``rollout``, the record's engine, model and weight version, the tokenizer's
fingerprint, action span ``policy``; records of other policies give other scorers.

It lives in ``outputs/`` beside ``alignment.py``, whose ``turns`` placement it needs (the
layers below cannot import it): it writes scores, not files.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import text

from hcapo_store.clock import utcnow
from hcapo_store.errors import ScoringError
from hcapo_store.ingestion.rollout_logprobs import RolloutFormatError, RolloutTokens, read_rollout
from hcapo_store.rendering.alignment import EpisodeRenderer
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.scoring.scorer import register, remember_tokenizer, scorer_label
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store

ERROR_KIND = "rollout_mismatch"


@dataclass
class RolloutReport:
    scorers: dict[str, str] = field(default_factory=dict)  # scorer id -> label
    episodes: int = 0  # episodes that carried rollout logprobs
    scored: int = 0
    failed: int = 0
    unscored: int = 0  # steps without entries
    failures: list[str] = field(default_factory=list)  # "episode step N: reason", the first 20

    def as_dict(self) -> dict[str, Any]:
        return {
            "scorers": self.scorers,
            "episodes": self.episodes,
            "scored": self.scored,
            "failed": self.failed,
            "unscored": self.unscored,
            "failures": self.failures,
        }

    @property
    def message(self) -> str:
        msg = (
            f"stored rollout logprobs of {self.scored} step(s) of {self.episodes} episode(s) under "
            f"{len(self.scorers)} scorer(s) ({', '.join(self.scorers.values()) or 'none'}); "
            f"{self.failed} step(s) failed, {self.unscored} without logprobs"
        )
        return msg + "".join(f"\n  failed: {f}" for f in self.failures)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level map (printable characters for the 256 bytes), inverted."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


def _token_bytes(tokenizer: Any) -> Any:
    """id -> the token's bytes (byte-level BPE: through GPT-2's byte map; else its decoding)."""
    decoder = _byte_decoder()

    def of(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str) and piece and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        return str(tokenizer.decode([int(token_id)])).encode("utf-8")

    return of


def check_tokens(entries: RolloutTokens, own: Sequence[int], tokenizer: Any, token_bytes: Any) -> str | None:
    """Why ``entries`` are not the step's own tokens ``own`` (None: they are, maybe but the last)."""
    n = len(entries.logprobs)
    if n not in (len(own), len(own) - 1):
        return f"{n} logprob entries for the step's {len(own)} own tokens"
    if n == len(own) - 1 and own[-1] not in set(getattr(tokenizer, "all_special_ids", [])):
        return f"{n} logprob entries for the step's {len(own)} own tokens, and the last is not an end-of-turn token"
    for i, token_id in enumerate(own[:n]):
        named, raw, token = entries.ids[i], entries.token_bytes[i], entries.tokens[i]
        if named is not None:
            ok, saw = named == token_id, f"id {named}"
        elif raw is not None:
            ok, saw = raw == token_bytes(token_id), f"bytes {raw!r}"
        elif token is not None:
            ok, saw = token == tokenizer.decode([token_id]), f"token {token!r}"
        else:
            continue  # verl without ids: the count is all there is to check
        if not ok:
            return f"token {i}: the rollout has {saw}, the tokenizer's id there is {token_id} ({tokenizer.decode([token_id])!r})"
    if not all(np.isfinite(entries.logprobs)) or any(v > 0 for v in entries.logprobs):
        return "a logprob is not a finite number <= 0"
    return None


def store_rollout_scores(
    store: Store, tokenizer_dir: str | Path, *, episodes: Sequence[int] | None = None
) -> RolloutReport:
    """Stores the rollout logprobs of every current episode (or of ``episodes``) that carries them."""
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ScoringError(f"cannot load tokenizer {tokenizer_dir}: {exc}") from exc
    fingerprint = tokenizer_fingerprint(tokenizer, tokenizer_dir)
    renderer = EpisodeRenderer(tokenizer)
    token_bytes = _token_bytes(tokenizer)
    report = RolloutReport()
    where = "" if episodes is None else f" AND id IN ({', '.join(str(int(i)) for i in episodes) or 'NULL'})"
    with db.read(store.engine) as conn:
        listed = conn.execute(
            text(f"SELECT id, name, source_format FROM episodes WHERE is_current IS TRUE{where} ORDER BY id")
        ).all()
    for ep_id, name, fmt in listed:
        with db.read(store.engine) as conn:
            raw = conn.execute(text("SELECT raw_source FROM episodes WHERE id = :i"), {"i": ep_id}).scalar()
            bad: str | None = None
            try:
                record = read_rollout(fmt, bytes(raw or b""))
            except (RolloutFormatError, ValueError) as exc:
                record, bad = None, str(exc)
            steps = conn.execute(
                text("SELECT id, step_index, message_index FROM steps WHERE episode_id = :e ORDER BY step_index"),
                {"e": ep_id},
            ).all()
            messages = load_messages(conn, ep_id) if record is not None else []
        if record is None and bad is None:
            continue
        policy = dict(record.policy) if record else {}
        spec: dict[str, Any] = {
            "backend": {"kind": "rollout", **{k: v for k, v in policy.items() if k != "weight_version"}},
            "tokenizer": fingerprint,
            "max_context": None,
            "max_logprob_tokens": None,
            "action_span": "policy",
        }
        if "weight_version" in policy:
            spec["weight_version"] = policy["weight_version"]
        sid = register(store, spec)
        report.scorers[sid] = scorer_label(spec)
        remember_tokenizer(store, fingerprint["files_sha256"], tokenizer_dir)
        report.episodes += 1
        results: dict[int, tuple[RolloutTokens, int, int, int, bool] | str] = {}
        if bad is not None:
            results = {int(s[0]): f"the episode's logprobs cannot be read: {bad}" for s in steps}
        elif record is not None and len(record.messages) != len(steps):
            results = {
                int(
                    s[0]
                ): f"the source has {len(record.messages)} assistant message(s) for the episode's {len(steps)} step(s)"
                for s in steps
            }
        elif record is not None:
            al = renderer.align(messages, [(int(s[1]), int(s[2])) for s in steps], "turns")
            for (step_id, index, _), entries in zip(steps, record.messages):
                if entries is None:
                    report.unscored += 1
                    continue
                if index not in al.spans:
                    results[int(step_id)] = f"the step's own tokens cannot be placed: {al.refused.get(index)}"
                    continue
                a, b = al.spans[index]
                why = check_tokens(entries, al.input_ids[a:b], tokenizer, token_bytes)
                results[int(step_id)] = why or (entries, a, b, b - a, al.flattened)
        _write(store, sid, ep_id, name, steps, results, report)
    return report


def _write(
    store: Store, sid: str, ep_id: int, name: str, steps: Sequence[Any], results: dict, report: RolloutReport
) -> None:
    now_iso, now = utcnow().isoformat(timespec="seconds"), time.time()
    index_of = {int(s[0]): int(s[1]) for s in steps}
    with db.write(store.engine) as conn:
        for step_id, result in results.items():
            conn.execute(text("DELETE FROM scores WHERE step_id = :s AND scorer_id = :sc"), {"s": step_id, "sc": sid})
            conn.execute(text("DELETE FROM attempts WHERE step_id = :s AND scorer_id = :sc"), {"s": step_id, "sc": sid})
            if isinstance(result, str):
                report.failed += 1
                if len(report.failures) < 20:
                    report.failures.append(f"{name} step {index_of[step_id]}: {result}")
                conn.execute(
                    text(
                        "INSERT INTO attempts (step_id, scorer_id, episode_id, step_index, status, attempt_count, "
                        "last_error_kind, last_error, updated_at) VALUES (:s, :sc, :e, :i, 'failed', 1, :k, :m, :t)"
                    ),
                    {
                        "s": step_id,
                        "sc": sid,
                        "e": ep_id,
                        "i": index_of[step_id],
                        "k": ERROR_KIND,
                        "m": result,
                        "t": now,
                    },
                )
                continue
            entries, start, end, own, flattened = result
            values = np.asarray(entries.logprobs, dtype="<f4")
            conn.execute(
                text(
                    "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob, "
                    "total_action_tokens, skipped_action_tokens, truncated_prefix_tokens, input_tokens, "
                    "logprob_start_len, flattened, created_at) VALUES (:s, :sc, :b, :n, :m, :total, :skipped, 0, :inp, "
                    ":start, :fl, :at)"
                ),
                {
                    "s": step_id,
                    "sc": sid,
                    "b": values.tobytes(),
                    "n": len(values),
                    "m": float(values.astype(np.float64).mean()) if len(values) else 0.0,
                    "total": own,
                    # own tokens the rollout gave no value for (an end-of-turn token the API left out)
                    "skipped": max(own - len(values), 0),
                    "inp": end,
                    "start": start,
                    "fl": flattened,
                    "at": now_iso,
                },
            )
            conn.execute(
                text(
                    "INSERT INTO attempts (step_id, scorer_id, episode_id, step_index, status, attempt_count, "
                    "updated_at) VALUES (:s, :sc, :e, :i, 'done', 1, :t)"
                ),
                {"s": step_id, "sc": sid, "e": ep_id, "i": index_of[step_id], "t": now},
            )
            report.scored += 1
