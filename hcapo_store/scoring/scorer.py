"""Scorer identity: everything that determines a step's logprobs → canonical JSON → id.

Same options → the same id (a rerun resumes); any change → a new scorer, and old
results stay valid for the old one. ``provenance`` (library versions) is stored in the
spec but left out of the id. The server URL is not part of it: two servers of
the same model and tokenizer are the same scorer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text

from hcapo_store.canonical import canonical_json, content_hash
from hcapo_store.clock import utcnow
from hcapo_store.errors import CreditError
from hcapo_store.storage import db
from hcapo_store.storage.db import sql_now
from hcapo_store.storage.store import Store

# Spec keys stored with the scorer but not part of its id (e.g. library versions: the
# rendering they produce is in the id as ``rendering_sha256``).
NOT_IDENTITY = ("provenance",)


def scorer_id(spec: dict[str, Any]) -> str:
    return content_hash({k: v for k, v in spec.items() if k not in NOT_IDENTITY})


def scorer_label(spec: dict[str, Any]) -> str:
    """A readable name that differs when the main parts of the spec differ (the id is the
    spec's hash; the label is not part of it, so stored ids never change with it)."""
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.rendering.prompts import HINDSIGHT_TEMPLATE, template_hash

    b = spec["backend"]
    model = b.get("model") or b.get("server_model") or "?"
    parts = [f"{b['kind']}:{model}"]
    if b.get("dtype"):  # in the id only off float32 on the CPU (backends.base.precision_identity)
        parts.append(f"{b['dtype']}@{b.get('device', '?')}")
    tok = spec.get("tokenizer") or {}
    if tok:
        parts.append(f"tok={tok.get('name', '?')}@{str(tok.get('files_sha256') or '')[:8]}")
    if tok.get("tokenizers_version"):  # in the id since issue 40: an upgrade shows in `scorers list`
        parts.append(f"tokenizers={tok['tokenizers_version']}")
    parts += [f"ctx={spec['max_context']}", f"lp={spec['max_logprob_tokens']}"]
    template = spec.get("hindsight_template_sha256")
    if template and template != template_hash(HINDSIGHT_TEMPLATE):
        parts.append(f"tpl={template[:8]}")
    conv = spec.get("conversion") or {}
    if conv.get("include_thinking") is False:
        parts.append("no-thinking")
    if conv.get("max_tool_result_chars", ConvertOptions.max_tool_result_chars) != ConvertOptions.max_tool_result_chars:
        parts.append(f"tool-chars={conv['max_tool_result_chars']}")
    if spec.get("prompt_layout"):
        parts.append(f"layout={spec['prompt_layout']}")
    if spec.get("truncation"):
        parts.append(f"trunc={spec['truncation']}")
    if spec.get("hindsight") is False:
        parts.append("no-hindsight")
    if spec.get("action_span"):
        parts.append(f"span={spec['action_span']}")
    if spec.get("weight_version") is not None:
        parts.append(f"wv={spec['weight_version']}")
    if spec.get("top_k"):  # `score --top-k K`: in the id, so in the name too
        parts.append(f"top-k={spec['top_k']}")
    return " ".join(parts)


def register(store: Store, spec: dict[str, Any]) -> str:
    """Insert the scorer if new; return its id."""
    sid = scorer_id(spec)
    # Workers starting together race to insert the same scorer on PostgreSQL (SQLite
    # serialises writers at BEGIN IMMEDIATE); the id is the spec's hash, so theirs is ours.
    with db.write(store.engine) as conn:
        conn.execute(
            text(
                "INSERT INTO scorers (id, label, spec, created_at) VALUES (:id, :label, :spec, :at) "
                "ON CONFLICT (id) DO NOTHING"
            ),
            {
                "id": sid,
                "label": scorer_label(spec),
                "spec": canonical_json(spec),
                "at": utcnow().isoformat(timespec="seconds"),
            },
        )
    return sid


def resolve_scorer(conn: Connection, scorer: str | None) -> tuple[str, str]:
    """The scorer to use: the given id / unique id prefix / label, else the only one."""
    rows = conn.execute(text("SELECT id, label FROM scorers ORDER BY created_at, id")).all()
    if not rows:
        raise CreditError("no scorer in this database: score some steps first")
    listing = "; ".join(f"{r.id[:12]} ({r.label})" for r in rows)
    if scorer is None:
        if len(rows) == 1:
            return rows[0].id, rows[0].label
        raise CreditError(f"{len(rows)} scorers in this database, pick one with --scorer: {listing}")
    exact = [r for r in rows if r.id == scorer or r.label == scorer]
    matches = exact or [r for r in rows if r.id.startswith(scorer)]
    if len(matches) != 1:
        what = "matches several scorers" if matches else "matches no scorer"
        raise CreditError(f"--scorer {scorer!r} {what}; scorers: {listing}")
    return matches[0].id, matches[0].label


# Per scorer: steps of current episodes that are scored / failed / leased / missing.
SCORER_COUNTS_SQL = """
SELECT sc.id AS scorer_id, sc.label, sc.created_at,
       (SELECT COUNT(*) FROM scores s JOIN steps st ON st.id = s.step_id
          JOIN episodes e ON e.id = st.episode_id
        WHERE s.scorer_id = sc.id AND e.is_current) AS scored,
       (SELECT COUNT(*) FROM attempts a JOIN episodes e ON e.id = a.episode_id
        WHERE a.scorer_id = sc.id AND a.status = 'failed' AND e.is_current) AS failed,
       (SELECT COUNT(*) FROM attempts a JOIN episodes e ON e.id = a.episode_id
        WHERE a.scorer_id = sc.id AND a.status = 'leased' AND a.lease_expires_at > :now
          AND e.is_current) AS leased
FROM scorers sc
ORDER BY sc.created_at
"""


# Per scorer, over the current episodes whose every step it scored (and whose floor it recorded):
# the conversation tokens (the floor), the tokens its requests sent and those the server cached.
FLOOR_SQL = """
WITH per_episode AS (
    SELECT st.episode_id, COUNT(*) AS scored, SUM(s.sent_tokens) AS sent,
           SUM(s.sent_cached_tokens) AS cached, COUNT(s.sent_cached_tokens) AS reported
    FROM scores s JOIN steps st ON st.id = s.step_id
    WHERE s.scorer_id = :scorer
    GROUP BY st.episode_id
)
SELECT COUNT(*) AS episodes, SUM(f.conversation_tokens) AS conversation, SUM(p.sent) AS sent,
       SUM(p.cached) AS cached, SUM(p.reported) AS reported, SUM(p.scored) AS steps
FROM episode_floors f
JOIN per_episode p ON p.episode_id = f.episode_id
JOIN episodes e ON e.id = f.episode_id
WHERE f.scorer_id = :scorer AND e.is_current
  AND p.scored = (SELECT COUNT(*) FROM steps x WHERE x.episode_id = f.episode_id)
"""


def floor_accounting(conn: Connection, scorer_id: str) -> dict[str, Any]:
    """The scorer's tokens against the prefill floor, over its fully scored current episodes:
    ``conversation_tokens`` (each token of each episode's conversation once), ``sent_tokens``,
    ``cached_tokens`` (None unless the server reported it for every request), their ratios
    ``sent_per_floor`` and ``prefilled_per_floor`` (sent minus cached), None when nothing counts."""
    r = conn.execute(text(FLOOR_SQL), {"scorer": scorer_id}).mappings().one()
    floor, sent = int(r["conversation"] or 0), int(r["sent"] or 0)
    cached = int(r["cached"] or 0) if r["steps"] and r["reported"] == r["steps"] else None
    return {
        "floor_episodes": int(r["episodes"] or 0),
        "conversation_tokens": floor,
        "sent_tokens": sent,
        "cached_tokens": cached,
        "sent_per_floor": round(sent / floor, 3) if floor else None,
        "prefilled_per_floor": round((sent - cached) / floor, 3) if floor and cached is not None else None,
    }


def scorer_counts(store: Store) -> list[dict[str, Any]]:
    """Per scorer: scored / failed / leased / missing steps of current episodes, and its tokens
    against the prefill floor (:func:`floor_accounting`)."""
    with db.read(store.engine) as conn:
        total = int(
            conn.execute(
                text("SELECT COUNT(*) FROM steps s JOIN episodes e ON e.id = s.episode_id WHERE e.is_current")
            ).scalar_one()
        )
        rows = conn.execute(text(SCORER_COUNTS_SQL), {"now": sql_now(conn)}).mappings().all()
        out = []
        for r in rows:
            d = dict(r)
            d["missing"] = total - d["scored"] - d["failed"]
            d.update(floor_accounting(conn, d["scorer_id"]))
            out.append(d)
    return out


def computes_in(spec: dict[str, Any]) -> str:
    """``dtype@device`` of a scorer's model: from its identity, else as recorded at registration
    (``provenance``), else float32@cpu for an in-process scorer (all it could be before the dtype
    was chosen); empty for a server that does not say."""
    backend = spec.get("backend") or {}
    facts = backend if backend.get("dtype") else (spec.get("provenance") or {}).get("computes_in") or {}
    if facts.get("dtype"):
        return f"{facts['dtype']}@{facts.get('device', '?')}"
    return "float32@cpu" if backend.get("kind") == "transformers" else ""


def scorer_spec(store: Store, scorer_id: str) -> dict[str, Any]:
    with db.read(store.engine) as conn:
        return _spec(conn, scorer_id)


def _spec(conn: Connection, scorer_id: str) -> dict[str, Any]:
    spec = conn.execute(text("SELECT spec FROM scorers WHERE id = :id"), {"id": scorer_id}).scalar()
    return json.loads(spec) if spec else {}


def remember_tokenizer(store: Store, files_sha256: str, directory: str | Path) -> None:
    """Record that a tokenizer with these files was loaded from ``directory`` (absolute); a
    hub name (no such directory) is not a place to look again."""
    where = Path(directory).expanduser()
    path = str(where.resolve())
    if not files_sha256 or len(path) > 4096 or not where.is_dir():
        return
    now = utcnow().isoformat(timespec="seconds")
    # One upsert: workers starting together on PostgreSQL each saw no row to update and
    # then collided on the insert (an update-then-insert is not atomic under READ COMMITTED).
    with db.write(store.engine) as conn:
        conn.execute(
            text(
                "INSERT INTO tokenizer_locations (files_sha256, path, seen_at) VALUES (:h, :p, :t) "
                "ON CONFLICT (files_sha256, path) DO UPDATE SET seen_at = excluded.seen_at"
            ),
            {"t": now, "h": files_sha256, "p": path},
        )


def known_tokenizer_dirs(store: Store, files_sha256: str) -> list[Path]:
    """Directories a tokenizer with these files was loaded from, most recently seen first."""
    with db.read(store.engine) as conn:
        return _tokenizer_dirs(conn, files_sha256)


def _tokenizer_dirs(conn: Connection, files_sha256: str) -> list[Path]:
    rows = conn.execute(
        text("SELECT path FROM tokenizer_locations WHERE files_sha256 = :h ORDER BY seen_at DESC, path"),
        {"h": files_sha256},
    ).all()
    return [Path(r[0]) for r in rows]


def scorer_tokenizer_record(store: Store, scorer_id: str) -> tuple[dict[str, Any], list[Path]]:
    """In one read: the scorer's tokenizer fingerprint (``{}`` for a scorer without one) and the
    directories a tokenizer with its files was loaded from, most recently seen first."""
    with db.read(store.engine) as conn:
        return tokenizer_record(conn, scorer_id)


def tokenizer_record(conn: Connection, scorer_id: str) -> tuple[dict[str, Any], list[Path]]:
    """:func:`scorer_tokenizer_record` within a read the caller holds."""
    theirs = _spec(conn, scorer_id).get("tokenizer") or {}
    return theirs, _tokenizer_dirs(conn, theirs.get("files_sha256") or "")
