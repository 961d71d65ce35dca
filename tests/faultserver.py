"""A fault-injecting SGLang-compatible HTTP server for scoring tests.

It wraps a real :class:`hcapo_store.devkit.refserver.ReferenceServer` *in-process*: correct
answers come from ``ref.generate(body)`` (real logprobs of a real model), and faults are
injected around them on a deterministic schedule. ``/model_info``, ``/server_info``,
``/health``, ``/tokenize`` and ``/detokenize`` are served from the reference server, without faults.

Every ``/generate`` request is logged, keyed by a hash of its ``input_ids`` and
``logprob_start_len`` (:func:`input_key`), so that tests can count requests per distinct
request even when the clients are other processes; :meth:`FaultServer.step_counts` maps
the logged requests back to the steps they scored (a grouped request scores several).

Faults (``FAULTS``)::

    http_500 http_503 http_429   retryable statuses (429 carries Retry-After: 0.1)
    abort abort_503              HTTP 200 with finish_reason.type == "abort" (retryable)
    timeout                      holds the request until the client gives up, then drops it
    hang                         holds the request until ``die()`` or ``shutdown()``, then drops it
    drop                         closes the socket without any response
    http_400                     SGLang's 400 body (permanent)
    malformed_json               200 with a truncated JSON body (permanent)
    missing_logprobs             200 without meta_info.input_token_logprobs (permanent)
    wrong_ids                    one returned token id differs from the one sent (permanent)
    wrong_count                  one entry too few (permanent)
    null_logprob                 a scored logprob is null (orjson's -inf; permanent)
    positive_logprob             a scored logprob is > 0 (permanent)
    tiny_logprob                 a scored logprob of -1e300 (-inf as float32; permanent)
    huge_cached                  meta_info.cached_tokens = 2**64 - 1 (permanent)
    echo_key                     401 whose body echoes the Authorization header sent (permanent)
    trickle                      200 with the right answer, one byte every half second (timeout)
    huge_body                    200 with no length, bytes without end until the client leaves
                                 (permanent: too_large)
    te_identity                  the answer framed by ``Transfer-Encoding: identity`` (connect)
    endless_trailers             the answer chunked, then trailer lines without end (connect)
    lenient_chunk                the answer chunked with a chunk size `` 0x…`` (connect)
    gzip_bomb                    200 in ``Content-Encoding: gzip, gzip``, a few KB that inflate
                                 to 64 MB (permanent: bad_encoding)
    stray_bytes                  the right answer and then bytes past its end on the kept
                                 connection (answered; the next request on it fails: connect)

These are not in the random pool (``FAULTS``). Every request's path and
Authorization header are kept in ``seen`` (a test checks where credentials went).

A schedule is ``schedule(key, n) -> fault name | None`` where ``n`` counts the earlier
requests with the same key (0 for the first one).

``die()`` plays a server process that went away: the port stops accepting, and every
request on a connection still open is closed without an answer.
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import json
import random
import select
import socket
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hcapo_store.devkit.refserver import ReferenceServer
from hcapo_store.http_server import BackgroundHTTPServer

HOLD_LIMIT_S = 1800.0  # a hang guard for held requests, far above any client timeout in the tests

Schedule = Callable[[str, int], "str | None"]

RETRYABLE = {
    "http_500": "http_500",
    "http_503": "http_503",
    "http_429": "http_429",
    "abort": "abort",
    "abort_503": "abort",
    "timeout": "timeout",
    "drop": "connect",
    "hang": "timeout",
}
PERMANENT = {
    "http_400": "http_400",
    "malformed_json": "bad_response",
    "missing_logprobs": "bad_response",
    "wrong_ids": "mismatch",
    "wrong_count": "mismatch",
    "null_logprob": "bad_response",
    "positive_logprob": "bad_response",
}
HOSTILE = {
    "tiny_logprob": "bad_response",
    "huge_cached": "bad_response",
    "echo_key": "http_401",
    "trickle": "timeout",
    "huge_body": "too_large",
    "te_identity": "connect",
    "endless_trailers": "connect",
    "lenient_chunk": "connect",
    "gzip_bomb": "bad_encoding",
}
# Answered as asked, but the connection that carried it is poisoned for the next request.
STRAY = "stray_bytes"
# fault -> the error kind the client must record for it
FAULTS = tuple(k for k in {**RETRYABLE, **PERMANENT} if k != "hang")  # the random pool: a hang never ends by itself
ERROR_KIND = {**RETRYABLE, **PERMANENT, **HOSTILE}


def input_key(input_ids: Sequence[int], first_scored: int | None = None) -> str:
    """A short stable hash of a token id list and of the first scored position (the same
    in every process): a group resumed after a kill sends the same ids from a later start."""
    tail = [-1, first_scored] if first_scored is not None else []
    return hashlib.sha1(array("q", [*input_ids, *tail]).tobytes()).hexdigest()[:20]


def request_key(prompt: Any) -> str:
    """The key of the request for a StepPrompt or a GroupPrompt."""
    return input_key(prompt.input_ids, prompt.first_scored)


def steps_covered(requests: Sequence[tuple[Sequence[int], int]], prompts: Mapping[Any, Any]) -> Counter:
    """Per step key, how many of the requests ``(input_ids, first_scored)`` scored that step:
    the step's ids are a prefix of the request's and its scored span lies inside the request's."""
    out: Counter = Counter()
    for key, p in prompts.items():
        n, ids = len(p.input_ids), tuple(p.input_ids)
        out[key] = sum(1 for r_ids, first in requests if first <= p.first_scored and tuple(r_ids[:n]) == ids)
    return out


def no_faults(key: str, n: int) -> None:
    return None


def plan_schedule(plan: Mapping[str, Sequence[str]]) -> Schedule:
    """Per key, the faults of its first requests in order; later requests are answered."""

    def schedule(key: str, n: int) -> str | None:
        faults = plan.get(key, ())
        return faults[n] if n < len(faults) else None

    return schedule


def random_schedule(seed: int, rate: float, faults: Iterable[str] = FAULTS) -> Schedule:
    """A fault with probability ``rate``, drawn from an RNG seeded by (seed, key, n):
    the same request gets the same answer whatever the arrival order."""
    pool = tuple(faults)

    def schedule(key: str, n: int) -> str | None:
        rng = random.Random(f"{seed}:{key}:{n}")
        return rng.choice(pool) if rng.random() < rate else None

    return schedule


@dataclass(frozen=True)
class LogEntry:
    key: str
    n: int
    fault: str | None
    at: float
    ids: tuple[int, ...] = ()
    first_scored: int = 0


class FaultServer(BackgroundHTTPServer):
    """Serve /generate from ``ref.generate`` with faults; ``delay`` adds latency to every
    /generate; a ``timeout`` fault holds the request until the client gives up. /generate
    waits while ``gate`` is clear, before the request is logged (a test decides when scoring
    may start); while ``hold_answers`` is a cleared ``threading.Event``, logged requests wait
    for it before they are answered (a test acts between arrival and answer)."""

    def __init__(
        self,
        ref: ReferenceServer,
        schedule: Schedule = no_faults,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        delay: float = 0.0,
    ) -> None:
        self.ref = ref
        self.schedule = schedule
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.hold_answers: threading.Event | None = None
        self.tokenize_route = True  # False: no /tokenize (an older SGLang), a 404 as SGLang gives
        self.generation = 0  # bumped by swap(): connections of an older generation are dropped
        self.log: list[LogEntry] = []
        self.counts: Counter[str] = Counter()  # /generate requests per input key
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization header) of every request
        self._lock = threading.Lock()
        self.dead = threading.Event()
        self.unhang = threading.Event()
        self.thread_name = "faultserver"
        self.httpd = _QuietServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True

    def die(self) -> None:
        """Stop answering anything, as a killed server would."""
        self.dead.set()
        self.shutdown()

    def shutdown(self) -> None:
        self.unhang.set()
        super().shutdown()

    # -- bookkeeping

    def reset(self, schedule: Schedule | None = None) -> None:
        with self._lock:
            self.log.clear()
            self.counts.clear()
            if schedule is not None:
                self.schedule = schedule

    def swap(self, ref: ReferenceServer) -> None:
        """Put another model behind the URL, as a server restarted with it would be: connections
        opened before (and requests they carry) are dropped without an answer."""
        with self._lock:
            self.ref = ref
            self.generation += 1

    @property
    def requests(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def faults_for(self, key: str) -> list[str | None]:
        """What each request with this key got, in arrival order (None: a correct answer)."""
        with self._lock:
            return [e.fault for e in sorted(self.log, key=lambda e: e.n) if e.key == key]

    def step_counts(self, prompts: Mapping[Any, Any], *, answered: bool = True) -> Counter:
        """Per step key of ``prompts`` (StepPrompts), how many logged requests scored it:
        its ids are a prefix of the request's and its scored span inside the request's.
        ``answered``: only requests that got a correct answer."""
        with self._lock:
            entries = [(e.ids, e.first_scored) for e in self.log if e.fault is None or not answered]
        return steps_covered(entries, prompts)

    def _arrive(self, ids: Any, start: Any) -> tuple[str, str | None]:
        valid = isinstance(ids, list) and ids and isinstance(ids[0], int) and isinstance(start, int)
        first = start + 1 if valid else 0
        key = input_key(ids, first) if valid else "?"
        with self._lock:
            n = self.counts[key]
            self.counts[key] += 1
            fault = self.schedule(key, n)
            self.log.append(LogEntry(key, n, fault, time.monotonic(), tuple(ids) if valid else (), first))
        return key, fault


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client killed with -9 or timed out: expected in these tests
        super().handle_error(request, client_address)


@functools.cache
def _gzip_bomb() -> bytes:
    """A few KB that inflate to 64 MB through two layers of gzip."""
    return gzip.compress(gzip.compress(bytes(64 << 20), compresslevel=9), compresslevel=9)


def _corrupt(fault: str, response: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(response)
    meta = out["meta_info"]
    entries = meta.get("input_token_logprobs") or []
    if fault == "missing_logprobs":
        meta.pop("input_token_logprobs", None)
    elif fault == "wrong_ids":
        last = entries[-1]
        entries[-1] = [last[0], last[1] + 1, last[2]]
    elif fault == "wrong_count":
        del entries[-1]
    elif fault == "null_logprob":
        entries[-1] = [None, entries[-1][1], entries[-1][2]]
    elif fault == "positive_logprob":
        entries[-1] = [0.25, entries[-1][1], entries[-1][2]]
    elif fault == "tiny_logprob":
        entries[-1] = [-1e300, entries[-1][1], entries[-1][2]]
    elif fault == "huge_cached":
        meta["cached_tokens"] = 2**64 - 1
    else:  # pragma: no cover - a typo in a test's plan
        raise ValueError(f"unknown corruption {fault!r}")
    return out


def _make_handler(server: FaultServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.generation = server.generation

        def parse_request(self) -> bool:
            ok = super().parse_request()
            if ok:
                with server._lock:
                    server.seen.append((self.path, self.headers.get("Authorization")))
            return ok

        def _stale(self) -> bool:
            """This connection belongs to the server before a swap(): it dies unanswered."""
            if self.generation != server.generation:
                self.close_connection = True
                return True
            return False

        def do_GET(self) -> None:
            if self._stale() or server.dead.is_set():
                self.close_connection = True
                return
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/health_generate"):
                self._send(HTTPStatus.OK, b"", "text/plain")
            elif path in ("/model_info", "/get_model_info"):
                self._json(HTTPStatus.OK, server.ref.model_info())
            elif path in ("/server_info", "/get_server_info"):
                self._json(HTTPStatus.OK, server.ref.server_info())
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": {"message": f"Not Found: {path}"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)  # always read the body: keep-alive stays sane
            if self._stale() or server.dead.is_set():
                self.close_connection = True
                return
            path = self.path.split("?", 1)[0]
            routes = ("/generate", "/tokenize", "/detokenize") if server.tokenize_route else ("/generate",)
            if path not in routes:
                self._json(HTTPStatus.NOT_FOUND, {"error": {"message": f"Not Found: {self.path}"}})
                return
            try:
                body = json.loads(raw)
            except ValueError as exc:
                self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": f"malformed JSON body: {exc}"}})
                return
            if path != "/generate":  # the server's own tokenizer, as the reference server has it: no faults
                try:
                    answer = server.ref.tokenize(body) if path == "/tokenize" else server.ref.detokenize(body)
                except ValueError as exc:
                    self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
                    return
                self._json(HTTPStatus.OK, answer)
                return
            if not body.get("return_logprob"):  # the client's vocabulary probe: no faults, not logged
                self._answer(body, None)
                return
            server.gate.wait(HOLD_LIMIT_S)
            _, fault = server._arrive(body.get("input_ids"), body.get("logprob_start_len"))
            if server.delay:
                time.sleep(server.delay)
            if server.hold_answers is not None:
                server.hold_answers.wait(HOLD_LIMIT_S)
            if self._stale() or server.dead.is_set():  # a killed server answers nothing it held
                self.close_connection = True
                return
            if fault == "drop":
                self.close_connection = True  # no status line, no headers: the socket just closes
                return
            if fault == "hang":
                server.unhang.wait()
                self.close_connection = True
                return
            if fault == "timeout":
                self._hold_until_client_leaves()
                self.close_connection = True
                return
            if fault == "echo_key":  # a gateway that quotes what it was sent
                sent = self.headers.get("Authorization")
                self._json(HTTPStatus.UNAUTHORIZED, {"error": {"message": f"invalid credentials: {sent}"}})
                return
            if fault == "trickle":
                self._trickle(json.dumps(server.ref.generate(body)).encode())
                return
            if fault == "huge_body":
                self._endless_body()
                return
            if fault in ("te_identity", "endless_trailers", "lenient_chunk", "gzip_bomb", STRAY):
                self._raw_answer(fault, json.dumps(server.ref.generate(body)).encode())
                return
            if fault in ("http_500", "http_503"):
                code = int(fault[5:])
                self._json(
                    HTTPStatus(code),
                    {"object": "error", "message": "injected failure", "type": str(code), "code": code},
                )
                return
            if fault == "http_429":
                self._json(
                    HTTPStatus.TOO_MANY_REQUESTS, {"error": {"message": "slow down"}}, headers={"Retry-After": "0.1"}
                )
                return
            if fault == "http_400":
                self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": "injected bad request"}})
                return
            if fault == "malformed_json":
                self._send(
                    HTTPStatus.OK, b'{"text": "", "output_ids": [], "meta_info": {"input_token_logp', "application/json"
                )
                return
            if fault in ("abort", "abort_503"):
                status = 503 if fault == "abort_503" else None
                self._json(
                    HTTPStatus.OK,
                    {
                        "text": "",
                        "output_ids": [],
                        "meta_info": {
                            "id": body.get("rid"),
                            "prompt_tokens": len(body.get("input_ids") or []),
                            "finish_reason": {
                                "type": "abort",
                                "message": "Abort before prefill",
                                "status_code": status,
                            },
                            "input_token_logprobs": [],
                            "output_token_logprobs": [],
                        },
                    },
                )
                return
            self._answer(body, fault)

        def _answer(self, body: dict[str, Any], fault: str | None) -> None:
            try:
                response = server.ref.generate(body)
            except ValueError as exc:
                self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
                return
            if fault is not None:
                response = _corrupt(fault, response)
            self._json(HTTPStatus.OK, response)

        def _trickle(self, data: bytes) -> None:
            """A whole, correct answer, one byte every half second: each read is quick."""
            self.close_connection = True
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                for i in range(len(data)):
                    if server.unhang.wait(0.5):
                        return
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return

        def _raw_answer(self, fault: str, data: bytes) -> None:
            """The right answer, framed or followed as ``fault`` says, written as raw bytes."""
            self.close_connection = fault != STRAY  # stray bytes: the connection stays open
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            if fault == "te_identity":
                wire = head + b"Transfer-Encoding: identity\r\n\r\n" + data
            elif fault == "lenient_chunk":
                wire = head + b"Transfer-Encoding: chunked\r\n\r\n 0x%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"
            elif fault == "gzip_bomb":
                bomb = _gzip_bomb()
                wire = head + b"Content-Encoding: gzip, gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb) + bomb
            elif fault == STRAY:
                wire = head + b"Content-Length: %d\r\n\r\n" % len(data) + data + b"garbage after the answer"
            else:  # endless_trailers
                wire = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(data) + data + b"\r\n0\r\n"
            try:
                self.wfile.write(wire)
                self.wfile.flush()
                deadline = time.monotonic() + HOLD_LIMIT_S
                n = 0
                while fault == "endless_trailers" and time.monotonic() < deadline and not server.unhang.is_set():
                    self.wfile.write(b"X-Trailer-%d: more\r\n" % n)  # until the client leaves
                    n += 1
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _endless_body(self) -> None:
            """200 without a length, and bytes until the client leaves (ends at HOLD_LIMIT_S)."""
            self.close_connection = True
            chunk = b" " * 65536
            deadline = time.monotonic() + HOLD_LIMIT_S
            try:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                while time.monotonic() < deadline and not server.unhang.is_set():
                    self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                return

        def _hold_until_client_leaves(self) -> None:
            """Answer nothing until the client closes the connection (its timeout fired)."""
            deadline = time.monotonic() + HOLD_LIMIT_S
            while time.monotonic() < deadline:
                readable, _, _ = select.select([self.connection], [], [], 0.1)
                if readable and not self.connection.recv(1, socket.MSG_PEEK):
                    return

        def _json(self, status: HTTPStatus, payload: Any, headers: Mapping[str, str] | None = None) -> None:
            self._send(status, json.dumps(payload).encode(), "application/json", headers)

        def _send(
            self, status: HTTPStatus, data: bytes, content_type: str, headers: Mapping[str, str] | None = None
        ) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


# --------------------------------------------------------------------------- test helpers


def step_requests(store: Any, builder: Any, grouping: str = "grouped") -> dict[str, list[tuple[str, int]]]:
    """The requests a run with all steps claimed sends: request key -> its steps' keys."""
    from sqlalchemy import text

    from hcapo_store.rendering.requests import GroupPrompt
    from hcapo_store.scoring.grouping import group_prompts
    from hcapo_store.storage.episodes import load_episode

    out: dict[str, list[tuple[str, int]]] = {}
    with store.engine.connect() as conn:
        ids = [r for (r,) in conn.execute(text("SELECT id FROM episodes WHERE is_current ORDER BY id"))]
        for episode_id in ids:
            episode = load_episode(conn, episode_id)
            built = builder.build_episode(episode.messages, episode.outcome, episode.steps)
            for r in group_prompts(built, grouping=grouping, max_tokens=builder.max_context):
                if isinstance(r, GroupPrompt):
                    out[request_key(r)] = [(episode.name, m.step_index) for m in r.members]
    return out


def step_prompts(store: Any, builder: Any) -> dict[tuple[str, int], Any]:
    """(episode name, step index) -> StepPrompt | PromptFailure for every current step."""
    from sqlalchemy import text

    from hcapo_store.storage.episodes import load_episode

    out: dict[tuple[str, int], Any] = {}
    with store.engine.connect() as conn:
        ids = [r for (r,) in conn.execute(text("SELECT id FROM episodes WHERE is_current ORDER BY id"))]
        for episode_id in ids:
            episode = load_episode(conn, episode_id)
            for p in builder.build_episode(episode.messages, episode.outcome, episode.steps):
                out[(episode.name, p.step_index)] = p
    return out


def stored_scores(store: Any, scorer_id: str) -> dict[tuple[str, int], tuple[float, bytes, int]]:
    """(episode name, step index) -> (mean_logprob, token_logprobs blob, token_count)."""
    from sqlalchemy import text

    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT e.name, st.step_index, s.mean_logprob, s.token_logprobs, s.token_count FROM scores s "
                "JOIN steps st ON st.id = s.step_id JOIN episodes e ON e.id = st.episode_id "
                "WHERE s.scorer_id = :sc"
            ),
            {"sc": scorer_id},
        ).all()
    return {(name, idx): (mean, bytes(blob), n) for name, idx, mean, blob, n in rows}
