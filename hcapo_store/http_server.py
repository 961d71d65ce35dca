"""A stdlib HTTP server run from a background thread.

Shared by the reference server (``hcapo_store.devkit.refserver``) and the tests' fault
server, which both need a real socket on 127.0.0.1 with a clean start and stop.
"""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer
from typing import TypeVar

_S = TypeVar("_S", bound="BackgroundHTTPServer")


class BackgroundHTTPServer:
    """An ``httpd`` served from a background thread: ``url``, ``start()``, ``shutdown()``,
    and use as a context manager. Subclasses set ``self.httpd`` in ``__init__``."""

    httpd: ThreadingHTTPServer
    thread_name = "hcapo-http"
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        # the bound socket's own address (what TCPServer stores): a str host, as typeshed cannot promise
        host, port = self.httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self: _S) -> _S:
        """Serve from a background thread (once: a started server stays as it is); returns self."""
        if self._thread is not None:  # already serving: a second loop on one socket would race
            return self
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
