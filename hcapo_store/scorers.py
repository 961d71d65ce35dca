"""Scorer identity: everything that determines a step's logprobs → canonical JSON → id.

Same options → the same id (a rerun resumes); any change → a new scorer, and old
results stay valid for the old one. The server URL is not part of it: two servers of
the same model and tokenizer are the same scorer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from hcapo_store import db
from hcapo_store.clock import utcnow
from hcapo_store.models import Scorer
from hcapo_store.store import Store


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def scorer_id(spec: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()


def scorer_label(spec: dict[str, Any]) -> str:
    b = spec["backend"]
    model = b.get("model") or b.get("server_model") or "?"
    return f"{b['kind']}:{model} ctx={spec['max_context']} lp={spec['max_logprob_tokens']}"


def register(store: Store, spec: dict[str, Any]) -> str:
    """Insert the scorer if new; return its id."""
    sid = scorer_id(spec)
    try:
        with db.write(store.engine) as conn:
            exists = conn.execute(select(Scorer.id).where(Scorer.id == sid)).first()
            if exists is None:
                conn.execute(insert(Scorer), {"id": sid, "label": scorer_label(spec), "spec": canonical_json(spec),
                                              "created_at": utcnow().isoformat(timespec="seconds")})
    except IntegrityError:
        # PostgreSQL: workers starting together race to insert the same scorer (SQLite
        # serialises writers at BEGIN IMMEDIATE); the id is the spec's hash, so theirs is ours.
        pass
    return sid
