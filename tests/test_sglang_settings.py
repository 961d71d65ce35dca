"""Issue 40 item 6 for SGLang: a server restarted with other settings is a new scorer. The
engine's settings that change its numbers (scoring/backends/sglang.ENGINE_SETTINGS, from
``/server_info``) are part of the scorer; behind the real SGLang router (``smg``), which answers
``/get_server_info`` without them, each worker it lists (``/workers``) is asked directly, so the
same workers are one scorer through the router and direct. Workers that disagree are refused,
naming the setting; a router whose workers cannot be listed keeps the scorer without settings,
said in the provenance and in one logged line."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from _waiting import wait_until

from hcapo_store.devkit.refserver import SERVER_VERSION, ReferenceServer, make_server
from hcapo_store.errors import ScoringError
from hcapo_store.scoring.backends.sglang import engine_settings
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.storage.store import Store


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path) -> Iterator[tuple[ReferenceServer, ReferenceServer, ReferenceServer]]:
    """Two float32 workers, and a third of the same model in bfloat16 (other numbers)."""
    with (
        make_server(tiny_model_dir) as a,
        make_server(tiny_model_dir) as b,
        make_server(tiny_model_dir, dtype="bfloat16") as c,
    ):
        yield a, b, c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Router:
    """The real SGLang router in front of ``urls`` (skips when ``smg`` is not installed)."""

    def __init__(self, urls: list[str]) -> None:
        smg = shutil.which("smg")
        if smg is None:
            pytest.skip("the SGLang router (pip install sglang-router: `smg`) is not installed")
        port = _free_port()
        cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "manual"]
        cmd += ["--worker-urls", *urls, "--log-level", "warn"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                listed = httpx.get(f"{self.url}/workers", timeout=5).json().get("workers", [])
            except (httpx.HTTPError, ValueError):
                return False
            return len(listed) == len(urls) and all(w.get("is_healthy") for w in listed)

        try:
            wait_until(ready, "the router knows its workers as healthy", procs={"smg": self.proc})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _prepared(store: Store, url: str, tokenizer: Path) -> Any:
    return prepare(store, ScoreConfig(server=url, tokenizer=str(tokenizer)))


def test_the_engine_settings_are_a_whitelist_of_what_changes_the_numbers() -> None:
    info = {
        "version": "0.5.9",
        "dtype": "bfloat16",
        "tp_size": 2,
        "kv_cache_dtype": "fp8_e5m2",
        "attention_backend": "fa3",
        "input_logprob_temperature": 0.7,
        # volatile, or not about the numbers: never part of the scorer
        "port": 30000,
        "host": "0.0.0.0",
        "mem_fraction_static": 0.83,
        "max_total_tokens": 812345,
        "random_seed": 12,
        "pid": 4242,
        "memory_usage": {"weight": 1.5},
        "internal_states": [{"last_gen_throughput": 3.1}],
    }
    assert engine_settings(info) == {
        "version": "0.5.9",
        "dtype": "bfloat16",
        "tp_size": 2,
        "kv_cache_dtype": "fp8_e5m2",
        "attention_backend": "fa3",
        "input_logprob_temperature": 0.7,
    }


def test_through_the_router_the_workers_settings_make_the_same_scorer_as_direct(
    workers, tiny_model_dir: Path, tmp_path: Path
) -> None:
    a, b, c = workers
    router = _Router([a.url, b.url])
    try:
        with Store.open(str(tmp_path / "s.db")) as store:
            direct = _prepared(store, a.url, tiny_model_dir)
            routed = _prepared(store, router.url, tiny_model_dir)
            bf16 = _prepared(store, c.url, tiny_model_dir)
    finally:
        router.close()
    engine = direct.spec["backend"]["engine"]
    assert engine == {
        "name": "sglang",
        "version": SERVER_VERSION,
        "dtype": "float32",
        "tp_size": 1,
        "quantization": None,
        "kv_cache_dtype": "auto",
    }
    assert routed.spec["backend"]["engine"] == engine and routed.scorer_id == direct.scorer_id
    assert routed.spec["provenance"]["server"]["engine_settings"].startswith("2 worker(s) behind the router")
    assert direct.spec["provenance"]["server"]["engine_settings"] == "the server"
    # the same model restarted in bfloat16 is another scorer
    assert bf16.spec["backend"]["engine"]["dtype"] == "bfloat16" and bf16.scorer_id != direct.scorer_id


def test_workers_with_other_settings_behind_one_router_are_refused(
    workers, tiny_model_dir: Path, tmp_path: Path
) -> None:
    a, _, c = workers
    router = _Router([a.url, c.url])
    try:
        with Store.open(str(tmp_path / "s.db")) as store, pytest.raises(ScoringError) as err:
            _prepared(store, router.url, tiny_model_dir)
    finally:
        router.close()
    message = str(err.value)
    assert "run with other settings: dtype" in message and "\n" not in message
    assert a.url in message and c.url in message


class _OldRouter:
    """A real HTTP server on 127.0.0.1 shaped like an SGLang router that cannot list its
    workers: it answers ``/get_server_info`` with its own counts, as the router does, forwards
    ``/get_model_info`` to its worker, and has no ``/workers``."""

    def __init__(self, worker: ReferenceServer) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/get_server_info":
                    self._send(200, {"router_manager": True, "routers_count": 1, "workers_count": 1})
                elif path == "/get_model_info":
                    self._send(200, httpx.get(f"{worker.url}/get_model_info", timeout=10).json())
                else:
                    self._send(404, {"detail": "Not Found"})

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_old_router_keeps_the_scorer_without_settings_and_says_so(
    workers, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, _, _ = workers
    old = _OldRouter(a)
    try:
        with Store.open(str(tmp_path / "s.db")) as store, caplog.at_level(logging.WARNING):
            prep = _prepared(store, old.url, tiny_model_dir)
    finally:
        old.close()
    assert "engine" not in prep.spec["backend"]  # as before this change: nothing learned, nothing named
    assert prep.spec["provenance"]["server"]["engine_settings"] == (
        "not read: the router lists no workers (GET /workers)"
    )
    lines = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(lines) == 1 and old.url in lines[0]
