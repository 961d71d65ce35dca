"""Checking an inference server's URL before anything connects to it.

A URL the HTTP stack cannot use (``http://[::1`` without its bracket, port 99999, no scheme)
would otherwise surface as a traceback from deep inside the socket code, or as "is the
server up?" about a server that could never be reached. Kept free of heavy imports: the
command line checks ``--server`` with it while parsing options.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from hcapo_store.errors import UsageError
from hcapo_store.masking import mask_url

FORM = "http://HOST:PORT (https:// too; an IPv6 host in brackets: http://[::1]:30000)"


def check_server_url(url: str) -> str:
    """``url`` when an HTTP client can connect to it; else ``UsageError`` with one line."""
    shown = mask_url(url) if "@" in url else url  # no password in an error line
    shown = shown if len(shown) <= 200 else shown[:199] + "…"
    if not url.strip():
        raise UsageError(f"--server {url!r} is empty: pass {FORM}")
    if "://" not in url:
        raise UsageError(f"--server {shown!r} has no scheme: pass {FORM}, e.g. http://{url.strip()}")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number in 0..65535
    except ValueError as exc:
        raise UsageError(f"--server {shown!r} is not a usable URL ({exc}): pass {FORM}") from exc
    if parts.scheme.lower() not in ("http", "https"):
        raise UsageError(f"--server {shown!r}: the scheme {parts.scheme!r} is not HTTP; pass {FORM}")
    if not parts.hostname:
        raise UsageError(f"--server {shown!r} names no host: pass {FORM}")
    if port == 0:
        raise UsageError(f"--server {shown!r}: port 0 cannot be connected to; pass the server's port, {FORM}")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise UsageError(f"--server {shown!r} contains spaces or control characters: pass {FORM}")
    return url
