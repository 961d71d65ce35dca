"""Canonical JSON: the one byte form that every stored id and hash is computed from.

Scorer ids were first computed with non-ASCII characters kept as UTF-8 and credit-run
hashes with them escaped; both are stored in databases, so both forms stay exactly as
they were (tests/test_canonical.py pins them with a non-ASCII spec).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any, *, ascii_only: bool = False) -> str:
    """Sorted keys, no whitespace; ``ascii_only`` escapes non-ASCII (the credit-run form)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=ascii_only)


def content_hash(obj: Any, *, ascii_only: bool = False) -> str:
    """SHA-256 hex digest of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj, ascii_only=ascii_only).encode()).hexdigest()
