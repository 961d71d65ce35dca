"""Credentials never leave the process: one place that masks them in URLs and messages.

A server URL may carry ``user:password@`` (httpx sends it as basic auth) or a token in
its query string, and ``--api-key`` is a secret of its own. Anything shown to users,
stored in the database (``attempt_errors``, ``attempts.last_error``) or logged goes
through ``mask_credentials`` first. Besides the URL patterns, every secret the process
was configured with (``register_secret``) is masked wherever it appears: a gateway may
echo the key it was sent in an error body.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
MIN_SECRET_CHARS = 4  # shorter "secrets" would mask ordinary words and digits everywhere

# scheme://user:password@host → scheme://user:***@host (the user name stays: it helps debugging)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):(?P<secret>[^/\s@]+)@")
_SECRET_PARAMS = r"api[_-]?key|access[_-]?token|token|key|password|passwd|secret|sig|signature"
_QUERY_SECRET = re.compile(rf"(?P<head>[?&](?:{_SECRET_PARAMS})=)(?P<secret>[^&#\s]+)", re.I)
_SECRET_PARAM = re.compile(rf"(?:{_SECRET_PARAMS})\Z", re.I)

_secrets: set[str] = set()  # values configured in this process (API keys, URL passwords)


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever it appears from now on (too short a value is ignored)."""
    if value and len(value) >= MIN_SECRET_CHARS:
        _secrets.add(value)


def register_url_secrets(url: str) -> None:
    """Register the password and query-string secrets a URL carries."""
    parts = urlsplit(url)
    register_secret(parts.password)
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_PARAM.match(name):
            register_secret(value)


def mask_credentials(text: str) -> str:
    """``text`` with every URL password, query-string secret and registered secret replaced by ``***``."""
    for secret in sorted(_secrets, key=len, reverse=True):  # longest first: one may contain another
        if secret in text:
            text = text.replace(secret, MASK)
    text = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", text)


def mask_url(url: str) -> str:
    """A URL as it may be displayed or stored."""
    return mask_credentials(url)


def split_query_token(url: str) -> tuple[str, str | None]:
    """``url`` without an ``api_key``/``token``-style query parameter, and that parameter's
    value: a key belongs in the Authorization header, not in every request's path (where
    proxies and access logs keep it)."""
    parts = urlsplit(url)
    kept: list[tuple[str, str]] = []
    token: str | None = None
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_PARAM.match(name) and token is None:
            token = value
        else:
            kept.append((name, value))
    if token is None:
        return url, None
    return urlunsplit(parts._replace(query=urlencode(kept))), token
