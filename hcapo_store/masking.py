"""Credentials never leave the process: one place that masks them in URLs and messages.

A server URL may carry ``user:password@`` (httpx sends it as basic auth) or a token in
its query string. Anything shown to users, stored in the database (``attempt_errors``,
``attempts.last_error``) or logged goes through ``mask_credentials`` first.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@host → scheme://user:***@host (the user name stays: it helps debugging)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):(?P<secret>[^/\s@]+)@")
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:api[_-]?key|access[_-]?token|token|key|password|passwd|secret|sig|signature)=)"
    r"(?P<secret>[^&#\s]+)",
    re.I,
)


def mask_credentials(text: str) -> str:
    """``text`` with every URL password and query-string secret replaced by ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", text)


def mask_url(url: str) -> str:
    """A URL as it may be displayed or stored."""
    return mask_credentials(url)
