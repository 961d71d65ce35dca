"""A small SGLang-compatible HTTP server over a local transformers causal LM.

It gives tests, the demo and CPU-only users a real endpoint with real log-probabilities.
It speaks the scoring subset of SGLang's native ``POST /generate`` (and of vLLM's
``POST /v1/completions`` with ``prompt_logprobs``), and the ``POST /tokenize`` /
``/detokenize`` both servers have, with the same JSON shapes, so the HTTP backends are
exercised exactly as against the real servers. Generation is limited to one
greedy token: this server scores, it does not chat.

Standard library only (``http.server``); one forward pass at a time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from hcapo_store.http_server import BackgroundHTTPServer
from hcapo_store.scoring import defaults
from hcapo_store.scoring.backends.vllm import VLLM_LOGPROB_FLOOR
from hcapo_store.scoring.forward import LogprobModel, PositionScores, dtype_name

log = logging.getLogger(__name__)

SERVER_VERSION = "hcapo-reference-1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
_MAX_BODY = 256 * 1024 * 1024

JSON = dict[str, Any]


class BadRequest(ValueError):
    """The request is invalid; answered with HTTP 400 and SGLang's error body."""


@dataclass(frozen=True)
class _Item:
    """One sequence of a /generate request, normalised."""

    input_ids: list[int]
    rid: str
    return_logprob: bool
    logprob_start_len: int
    max_new_tokens: int
    top_logprobs_num: int = 0  # > 0: input_top_logprobs, as SGLang returns them


class ReferenceServer(BackgroundHTTPServer):
    """The HTTP server plus the model; ``requests`` counts /generate and /v1/completions
    calls that reach the model, ``sequences`` the sequences that went through it. A
    prefill-only /generate without logprobs (a client's vocabulary probe) only checks its
    ids, as SGLang's tokenizer manager does, and is not counted."""

    def __init__(
        self,
        scorer: LogprobModel,
        tokenizer: Any | None,
        *,
        tokenizer_path: str | None,
        host: str,
        port: int,
    ) -> None:
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.model_path = str(scorer.model_dir)
        self.weight_version = "default"  # SGLang reports it in /model_info and every response
        config = scorer.model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.advertise_context = True  # False: enforce the limit without saying it (as older servers)
        self.max_logprobs = 20  # vLLM's --max-logprobs (its default): a larger prompt_logprobs is refused
        # vLLM's --logprobs-mode, reported in /server_info as vLLM's development mode does (its config,
        # model_config.logprobs_mode); None: not reported. The numbers stay raw log-probabilities (what
        # processed_logprobs also are for a scoring request: temperature 0, no logits processors).
        self.logprobs_mode: str | None = None
        self.requests = 0
        self.sequences = 0
        self.routing_keys: list[str | None] = []  # X-SMG-Routing-Key of each scoring request, in order
        self.sequences_seen: list[list[int]] = []  # the ids of every scored sequence, in order (for tests)
        # (path, body without its token ids or text) of every scoring request: what a client asked for
        self.requests_seen: list[tuple[str, JSON]] = []
        self._count_lock = threading.Lock()
        self.thread_name = "hcapo-refserver"
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True

    def _advertised(self) -> int | None:
        return self.context_length if self.advertise_context else None

    # --- endpoints -------------------------------------------------------------------

    def model_info(self) -> JSON:
        config = self.scorer.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "served_model_name": self.model_path,
            "weight_version": self.weight_version,
            "model_type": config.model_type,
            # what the model computes in: part of the scorer unless float32 on the CPU (precision_identity)
            "dtype": dtype_name(self.scorer.dtype),
            "device": self.scorer.device.type,
            "architectures": list(getattr(config, "architectures", None) or []),
        }

    def server_info(self) -> JSON:
        context = self._advertised()
        return {
            "version": SERVER_VERSION,
            "status": "ready",
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.model_path,
            "context_length": context,
            "max_req_input_len": context - 1 if context else None,
            "max_total_num_tokens": context,
            "skip_tokenizer_init": self.tokenizer is None,
            # what it computes with, named as SGLang's server_args name them (its own, truly: one
            # process, no tensor parallelism, no quantization, the KV "cache" in the model's dtype)
            "dtype": dtype_name(self.scorer.dtype),
            "tp_size": 1,
            "quantization": None,
            "kv_cache_dtype": "auto",
            "scorer": self.scorer.model_info(),
            **({"vllm_config": {"model_config": {"logprobs_mode": self.logprobs_mode}}} if self.logprobs_mode else {}),
        }

    def models(self) -> JSON:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_path,
                    "object": "model",
                    "owned_by": "hcapo-store",
                    "root": self.model_path,
                    "max_model_len": self._advertised(),
                }
            ],
        }

    def generate(self, body: JSON) -> JSON | list[JSON]:
        """SGLang ``/generate``: a dict for one request, a list in input order for a batch."""
        batch, items = self._generate_items(body)
        if any(item.return_logprob or item.max_new_tokens for item in items):
            self._count_request()
        text_in_logprobs = bool(body.get("return_text_in_logprobs", False))
        outputs = [self._generate_one(item, text_in_logprobs) for item in items]
        return outputs if batch else outputs[0]

    def completions(self, body: JSON) -> JSON:
        """vLLM ``/v1/completions`` with ``prompt_logprobs`` and ``max_tokens: 1``."""
        self._count_request()
        prompts = self._completion_prompts(body.get("prompt"))
        max_tokens = body.get("max_tokens", 16)
        if max_tokens != 1:
            raise BadRequest(f"max_tokens must be 1 on the reference server, got {max_tokens!r}")
        k = body.get("prompt_logprobs")
        if k is not None and (not _is_int(k) or k < 0):
            raise BadRequest(f"prompt_logprobs must be a non-negative integer, got {k!r}")
        if k is not None and k > self.max_logprobs:  # vLLM's own words (processor._validate_logprobs)
            raise BadRequest(
                f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.max_logprobs}"
            )
        if body.get("logprobs") is not None:
            raise BadRequest("sample logprobs are not supported by the reference server; use prompt_logprobs")
        if body.get("stream"):
            raise BadRequest("prompt_logprobs are not available when stream=True")
        detokenize = body.get("detokenize", True)
        if not isinstance(detokenize, bool):
            raise BadRequest(f"detokenize must be a boolean, got {detokenize!r}")
        choices = [self._completion_choice(i, ids, k, detokenize) for i, ids in enumerate(prompts)]
        prompt_tokens = sum(len(ids) for ids in prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_path,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(prompts),
                "total_tokens": prompt_tokens + len(prompts),
            },
        }

    # --- /generate ---------------------------------------------------------------------

    def _generate_items(self, body: JSON) -> tuple[bool, list[_Item]]:
        for field in ("input_embeds", "token_ids_logprob"):
            if body.get(field) is not None:
                raise BadRequest(f"{field} is not supported by the reference server")
        if body.get("stream"):
            raise BadRequest("stream is not supported by the reference server")
        batch, sequences = self._generate_inputs(body)
        n = len(sequences)
        sampling = _per_item(body.get("sampling_params"), n, "sampling_params", dict, {})
        return_logprob = _per_item(body.get("return_logprob"), n, "return_logprob", bool, False)
        starts = _per_item(body.get("logprob_start_len"), n, "logprob_start_len", int, -1)
        tops = _per_item(body.get("top_logprobs_num"), n, "top_logprobs_num", int, 0)
        rids = _rids(body.get("rid"), n, batch)
        items = []
        for i, ids in enumerate(sequences):
            max_new = sampling[i].get("max_new_tokens", 128)
            if max_new not in (0, 1) or isinstance(max_new, bool):
                raise BadRequest(
                    f"max_new_tokens must be 0 (prefill only) or 1 on the reference server, got {max_new!r}"
                )
            items.append(
                _Item(ids, rids[i], return_logprob[i], self._start(ids, return_logprob[i], starts[i]), max_new, tops[i])
            )
        return batch, items

    def _generate_inputs(self, body: JSON) -> tuple[bool, list[list[int]]]:
        """(is_batch, token id lists) from exactly one of ``input_ids`` / ``text``."""
        input_ids, text = body.get("input_ids"), body.get("text")
        if (input_ids is None) == (text is None):
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            batch = isinstance(text, list)
            texts = text if batch else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a non-empty list of strings")
            return batch, [self._tokenize(t) for t in texts]
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("input_ids cannot be empty.")
        batch = isinstance(input_ids[0], list)
        sequences = input_ids if batch else [input_ids]
        for ids in sequences:
            self._check_ids(ids)
        return batch, sequences

    def _start(self, ids: list[int], return_logprob: bool, start: int) -> int:
        """Resolve ``logprob_start_len`` as SGLang's scheduler does (-1 = no input logprobs)."""
        if not return_logprob or start == -1:
            return len(ids)
        if start < -1:
            raise BadRequest(f"logprob_start_len must be >= -1, got {start}")
        if start > len(ids):
            raise BadRequest(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len."
            )
        return start

    def _generate_one(self, item: _Item, text_in_logprobs: bool) -> JSON:
        began = time.perf_counter()
        ids, start = item.input_ids, item.logprob_start_len
        generate = item.max_new_tokens == 1
        # Entry 0 is always null (SGLang computes no logits for the position before
        # logprob_start_len), so the scored tokens start at start + 1.
        first_scored = start + 1 if item.return_logprob and start < len(ids) else len(ids)
        options = {"top_k": item.top_logprobs_num} if item.top_logprobs_num > 0 else {}
        scores = (
            self._run(ids, first_scored, next_token=generate, **options)
            if generate or first_scored < len(ids)
            else None
        )
        output_ids = [scores.next_token[0]] if scores and scores.next_token else []
        meta: JSON = {
            "id": item.rid,
            "finish_reason": {"type": "length", "length": item.max_new_tokens},
            "prompt_tokens": len(ids),
            "weight_version": self.weight_version,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
        }
        if item.return_logprob:
            decode = self._decode_one if text_in_logprobs else _no_text
            logprobs = scores.logprobs if scores else []
            meta["input_token_logprobs"] = [[None, ids[start], decode(ids[start])]] if start < len(ids) else []
            meta["input_token_logprobs"] += [
                [_finite_or_none(lp), tok, decode(tok)] for lp, tok in zip(logprobs, ids[first_scored:])
            ]
            if item.top_logprobs_num > 0:  # entry 0 null, then the top-k triples of each scored position
                top = scores.top if scores and scores.top else []
                meta["input_top_logprobs"] = ([None] if start < len(ids) else []) + [
                    [[_finite_or_none(lp), tok, decode(tok)] for tok, lp in row] for row in top
                ]
            meta["output_token_logprobs"] = (
                [[_finite_or_none(scores.next_token[1]), output_ids[0], decode(output_ids[0])]]
                if output_ids and scores and scores.next_token
                else []
            )
        meta["e2e_latency"] = time.perf_counter() - began
        return {"text": self._decode(output_ids), "output_ids": output_ids, "meta_info": meta}

    # --- /v1/completions ---------------------------------------------------------------

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._tokenize(prompt)]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("prompt must be a non-empty list of token ids, a list of such lists, or a string")
        if all(isinstance(p, str) for p in prompt):
            return [self._tokenize(p) for p in prompt]
        prompts = prompt if isinstance(prompt[0], list) else [prompt]
        for ids in prompts:
            self._check_ids(ids)
        return prompts

    def _completion_choice(self, index: int, ids: list[int], k: int | None, detokenize: bool = True) -> JSON:
        # Without prompt_logprobs only the last position (the generated token) is needed.
        first_scored = 1 if k is not None else len(ids)
        scores = self._run(ids, first_scored, top_k=k or 0, ranks=k is not None, next_token=True)
        assert scores.next_token is not None  # always set when next_token=True
        token = scores.next_token[0]
        prompt_logprobs = None
        if k is not None:
            tops = scores.top or [[] for _ in scores.logprobs]
            prompt_logprobs = [None] + [
                self._vllm_position(tok, lp, rank, top, detokenize)
                for tok, lp, rank, top in zip(ids[1:], scores.logprobs, scores.ranks or [], tops)
            ]
        return {
            "index": index,
            "text": self._decode([token]) if detokenize else "",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [token],
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": ids,
        }

    def _vllm_position(
        self, token: int, logprob: float, rank: int, top: list[tuple[int, float]], detokenize: bool
    ) -> JSON:
        """One prompt_logprobs entry: the actual token first, then the top-k (vLLM order)."""
        entry = {str(token): self._vllm_logprob(token, logprob, rank, detokenize)}
        for r, (tok, lp) in enumerate(top, start=1):
            entry.setdefault(str(tok), self._vllm_logprob(tok, lp, r, detokenize))
        return entry

    def _vllm_logprob(self, token: int, logprob: float, rank: int, detokenize: bool) -> JSON:
        value = logprob if math.isfinite(logprob) else VLLM_LOGPROB_FLOOR
        # detokenize: false leaves decoded_token null, as vLLM does
        return {"logprob": value, "rank": rank, "decoded_token": self._decode_one(token) if detokenize else None}

    # --- /tokenize, /detokenize (SGLang and vLLM alike) --------------------------------

    def tokenize(self, body: JSON) -> JSON:
        """``{"prompt": text, "add_special_tokens": bool}`` → ``{"tokens", "count", "max_model_len"}``."""
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string (chat messages are not supported by the reference server)")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise BadRequest(f"add_special_tokens must be a boolean, got {add_special!r}")
        tokens = list(self._tokenizer_or_refuse()(prompt, add_special_tokens=add_special)["input_ids"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self._advertised()}

    def detokenize(self, body: JSON) -> JSON:
        """``{"tokens": [ids]}`` → ``{"text"}`` (SGLang) and ``{"prompt"}`` (vLLM): the same text."""
        tokens = body.get("tokens")
        self._check_ids(tokens)
        text = self._tokenizer_or_refuse().decode(tokens, skip_special_tokens=bool(body.get("skip_special_tokens")))
        return {"text": text, "prompt": text}

    def _tokenizer_or_refuse(self) -> Any:
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer (started without one, as --skip-tokenizer-init)")
        return self.tokenizer

    # --- shared ------------------------------------------------------------------------

    def _run(self, ids: list[int], first_scored: int, **options: Any) -> PositionScores:
        with self._count_lock:
            self.sequences += 1
            self.sequences_seen.append(list(ids))
        return self.scorer.score_positions(ids, first_scored, **options)

    def _count_request(self) -> None:
        with self._count_lock:
            self.requests += 1

    def _check_ids(self, ids: Any) -> None:
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids cannot be empty.")
        for token in ids:
            if not _is_int(token) or not 0 <= token < self.scorer.vocab_size:
                raise BadRequest(f"token id {token!r} is not in the model's vocabulary [0, {self.scorer.vocab_size})")
        if self.context_length and len(ids) >= self.context_length:
            raise BadRequest(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest("text input needs a tokenizer; start the server with --tokenizer or send token ids")
        # Special tokens added by default (e.g. BOS), as SGLang does for text.
        ids = list(self.tokenizer(text)["input_ids"])
        self._check_ids(ids)
        return ids

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None and ids else ""

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None


def make_server(
    model_dir: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    device: str | None = None,
    dtype: str | None = None,
    chunk_size: int = 512,
    context_length: int | None = None,
    cuda_graphs: bool = defaults.CUDA_GRAPHS,
) -> ReferenceServer:
    """Load the model (and tokenizer: ``tokenizer_dir``, else the model dir if it holds
    one) and bind the server; port 0 picks a free port. Call ``start()`` or
    ``serve_forever()`` to serve. ``context_length`` (default: the model's) is advertised and
    enforced as SGLang does: at most ``context_length - 1`` input tokens. ``device`` and
    ``dtype`` as ``LogprobModel``'s (default: the GPU when there is one; the checkpoint's dtype
    there, float32 on the CPU); ``/model_info`` reports both. ``cuda_graphs``: as ``LogprobModel``'s."""
    from transformers import AutoTokenizer

    scorer = LogprobModel(model_dir, device=device, dtype=dtype, chunk_size=chunk_size, cuda_graphs=cuda_graphs)
    if tokenizer_dir is None and any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES):
        tokenizer_dir = model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir is not None else None
    server = ReferenceServer(
        scorer,
        tokenizer,
        tokenizer_path=str(tokenizer_dir) if tokenizer_dir is not None else None,
        host=host,
        port=port,
    )
    if context_length is not None:
        server.context_length = context_length
    return server


# --- HTTP plumbing ---------------------------------------------------------------------

_GET_ROUTES: dict[str, Callable[[ReferenceServer], JSON]] = {
    "/model_info": ReferenceServer.model_info,
    "/server_info": ReferenceServer.server_info,
    # SGLang's older names, still served; the SGLang router forwards only these to a worker.
    "/get_model_info": ReferenceServer.model_info,
    "/get_server_info": ReferenceServer.server_info,
    "/v1/models": ReferenceServer.models,
}
_POST_ROUTES: dict[str, Callable[[ReferenceServer, JSON], JSON | list[JSON]]] = {
    "/generate": ReferenceServer.generate,
    "/v1/completions": ReferenceServer.completions,
    "/tokenize": ReferenceServer.tokenize,
    "/detokenize": ReferenceServer.detokenize,
}
_TOKEN_FIELDS = ("input_ids", "prompt", "text")  # left out of requests_seen: the ids are in sequences_seen


def _wants_logprobs(body: JSON) -> bool:
    """A scoring request: token ids sent with logprobs asked for (SGLang return_logprob, vLLM
    prompt_logprobs), not a vocabulary probe (no logprobs) or a tokenizer probe (text)."""
    if not isinstance(body, dict) or not (body.get("return_logprob") or body.get("prompt_logprobs") is not None):
        return False
    return isinstance(body.get("input_ids"), list) or isinstance(body.get("prompt"), list)


def _make_handler(server: ReferenceServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as HTTP clients expect of SGLang
        server_version = SERVER_VERSION

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/health_generate"):
                self._send(HTTPStatus.OK, b"", "text/plain")
            elif path in _GET_ROUTES:
                self._send_json(HTTPStatus.OK, _GET_ROUTES[path](server))
            else:
                self._send_error(HTTPStatus.NOT_FOUND, f"Not Found: {path}")

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                body = self._read_json()  # first: an unread body would poison keep-alive
                route = _POST_ROUTES.get(path)
                if route is not None and _wants_logprobs(body):
                    server.routing_keys.append(self.headers.get("X-SMG-Routing-Key"))
                    server.requests_seen.append((path, {k: v for k, v in body.items() if k not in _TOKEN_FIELDS}))
                if route is None:
                    self._send_error(HTTPStatus.NOT_FOUND, f"Not Found: {path}")
                    return
                self._send_json(HTTPStatus.OK, route(server, body))
            except ValueError as exc:  # BadRequest, and the scorer's own input checks
                self._send_error(HTTPStatus.BAD_REQUEST, str(exc))
            except Exception as exc:
                log.exception("reference server: %s failed", path)
                self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

        do_PUT = do_POST  # SGLang routes /generate for POST and PUT

        def _read_json(self) -> JSON:
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or not 0 <= length <= _MAX_BODY:
                self.close_connection = True  # the body cannot be skipped reliably
                raise BadRequest(f"send the body with a Content-Length of at most {_MAX_BODY} bytes")
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise BadRequest(f"malformed JSON body: {exc}") from None
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            return body

        def _send_json(self, status: HTTPStatus, payload: Any) -> None:
            self._send(status, json.dumps(payload, allow_nan=False).encode(), "application/json")

        def _send_error(self, status: HTTPStatus, message: str) -> None:
            # A 400 from SGLang has exactly this body; other statuses use the same shape.
            self._send_json(status, {"error": {"message": message}})

        def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


# --- request normalisation -------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_item(value: Any, n: int, name: str, kind: type, default: Any) -> list[Any]:
    """Broadcast a scalar to every batch item, or check a per-item list (SGLang rules)."""
    if value is None:
        return [default] * n
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise BadRequest(f"{name} has {len(values)} entries for a batch of {n}")
    for v in values:
        ok = _is_int(v) if kind is int else isinstance(v, kind)
        if not ok:
            raise BadRequest(f"{name} must be {kind.__name__} or a list of {kind.__name__}, got {v!r}")
    return [default if v is None else v for v in values]


def _rids(rid: Any, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(n)] if batch else [rid]
    if not isinstance(rid, list) or len(rid) != n or not all(isinstance(r, str) for r in rid):
        raise BadRequest(f"rid must be a string or a list of {n} strings")
    if len(set(rid)) != n:
        raise BadRequest(f"Duplicate request IDs detected within the request: {rid}")
    return rid


def _finite_or_none(value: float) -> float | None:
    # SGLang serialises with orjson, which writes -inf as null.
    return value if math.isfinite(value) else None


def _no_text(token: int) -> None:
    return None
