"""SGLang native ``POST /generate`` (SGLang's native API: ``input_ids``, ``return_logprob``, ``logprob_start_len``).

Pure payload building and response parsing, plus a thin Backend over ``HttpClient``.
We send ``input_ids`` (never text: the server would re-tokenize and may add BOS) with
``logprob_start_len = first_scored - 1`` and drop returned entry 0, which SGLang always
returns as null. Every returned token id and the count are checked; an HTTP 200 whose
``finish_reason`` is ``abort`` is a failure.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import orjson

from hcapo_store.errors import InferenceError, ScoringError
from hcapo_store.masking import mask_url
from hcapo_store.rendering.requests import StepPrompt
from hcapo_store.scoring.backends.base import (
    LOGPROB_FLOOR,
    LOGPROB_ROUNDING,
    BackendScore,
    checked_cached_tokens,
    outside_logprobs,
    precision_identity,
    routing_headers,
)
from hcapo_store.scoring.backends.http import HttpBackend, HttpClient, wire_ids

log = logging.getLogger(__name__)


def build_payload(prompt: StepPrompt, *, max_new_tokens: int = 0) -> dict[str, Any]:
    if prompt.first_scored < 1:
        raise ValueError("the first scored token needs at least one token of context")
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if max_new_tokens:
        sampling["temperature"] = 0.0  # old servers: generate one greedy token, ignored
    return {
        "input_ids": wire_ids(prompt.input_ids),
        "return_logprob": True,
        "logprob_start_len": prompt.first_scored - 1,
        "sampling_params": sampling,
        "stream": False,
        "rid": uuid.uuid4().hex,  # fresh per attempt: SGLang aborts match rid prefixes
    }


def _bad(message: str) -> InferenceError:
    return InferenceError("bad_response", message, retryable=False)


def parse_response(prompt: StepPrompt, body: Any) -> BackendScore:
    """Verify and extract the scored logprobs; raise InferenceError on anything off."""
    if isinstance(body, list):
        if len(body) != 1:
            raise _bad(f"expected one result, got a list of {len(body)}")
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise _bad("response has no meta_info")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        status = finish.get("status_code")
        raise InferenceError(
            "abort",
            f"server aborted the request: {finish.get('message')!r} (status {status})",
            retryable=status is None or status in (408, 429) or (isinstance(status, int) and status >= 500),
        )
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, (list, FlatEntries)):
        raise _bad("response has no input_token_logprobs (was return_logprob honoured?)")
    ids = prompt.input_ids
    start = prompt.first_scored - 1
    expected = len(ids) - start
    if len(entries) != expected:
        raise InferenceError(
            "mismatch", f"expected {expected} input_token_logprobs entries, got {len(entries)}", retryable=False
        )
    prompt_tokens = meta.get("prompt_tokens")
    if isinstance(prompt_tokens, int) and prompt_tokens != len(ids):
        raise InferenceError(
            "mismatch",
            f"server counted {prompt_tokens} prompt tokens, we sent {len(ids)} (truncated by the server?)",
            retryable=False,
        )
    logprobs = (
        _fast_flat(entries, ids, start) if isinstance(entries, FlatEntries) else _fast_logprobs(entries, ids, start)
    )
    if logprobs is None:
        logprobs = _checked_logprobs(entries.as_list() if isinstance(entries, FlatEntries) else entries, ids, start)
    return BackendScore(
        logprobs=logprobs,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        cached_tokens=checked_cached_tokens(meta.get("cached_tokens"), len(ids)),
    )


_NUMBER_TYPES = frozenset((int, float))  # exact types: bool (a subclass of int) is not a logprob
_ENTRY_TYPES = frozenset((list, tuple))


def _as_logprobs(values: list[Any]) -> list[float] | None:
    """Numbers that are all finite log-probabilities (rounding above 0 clipped), else None."""
    array = np.asarray(values, dtype=np.float64)
    if outside_logprobs(array).any():
        return None
    return np.minimum(array, 0.0).tolist()


def _fast_logprobs(entries: list[Any], ids: Sequence[int], start: int) -> list[float] | None:
    """The whole check in a few C-level passes; None when anything is off (the slow path
    then finds the first bad entry and raises with its position)."""
    if not entries or not set(map(type, entries)) <= _ENTRY_TYPES or min(map(len, entries)) < 2:
        return None
    if [e[1] for e in entries] != ids[start:]:
        return None
    values = [e[0] for e in entries[1:]]
    if not set(map(type, values)) <= _NUMBER_TYPES:
        return None
    return _as_logprobs(values)


class FlatEntries:
    """``input_token_logprobs`` decoded flat (``[lp, id, null, lp, id, null, …]``): one list of
    numbers instead of one small list per position (``decode_generate``)."""

    __slots__ = ("flat", "raw")

    def __init__(self, flat: list[Any], raw: bytes) -> None:
        self.flat, self.raw = flat, raw

    def __len__(self) -> int:
        return len(self.flat) // 3

    def as_list(self) -> list[Any]:
        """The entries as the server wrote them (for the entry-by-entry check and its message)."""
        return list(orjson.loads(self.raw))


_LOGPROBS_KEY = b'"input_token_logprobs":['


def decode_generate(body: bytes) -> Any:
    """A ``/generate`` response: its ``input_token_logprobs`` decoded as :class:`FlatEntries`
    when it is exactly ``[[lp, id, null], …]`` (the shape SGLang writes without text), every
    other part as JSON. Anything else, or a body with several of them, is decoded whole:
    the checks of ``parse_response`` then see it as sent."""
    at = body.find(_LOGPROBS_KEY)
    if at < 0 or body.find(_LOGPROBS_KEY, at + 1) >= 0:
        return orjson.loads(body)
    a = at + len(_LOGPROBS_KEY) - 1  # the array's "["
    end = body.find(b"]]", a)
    if end < 0 or body[a + 1 : a + 2] != b"[":
        return orjson.loads(body)
    inner = body[a + 1 : end + 1]  # "[lp,id,null],…,[lp,id,null]"
    k = inner.count(b"[")
    if not (inner.count(b"]") == k and inner.count(b"],[") == k - 1 and inner.count(b",null]") == k):
        return orjson.loads(body)
    try:
        flat = orjson.loads(b"[" + inner.translate(None, b"[]") + b"]")
        rest = orjson.loads(body[:a] + b"[]" + body[end + 2 :])
    except orjson.JSONDecodeError:
        return orjson.loads(body)
    meta = rest.get("meta_info") if isinstance(rest, dict) else None
    if len(flat) != 3 * k or not isinstance(meta, dict) or meta.get("input_token_logprobs") != []:
        return orjson.loads(body)
    meta["input_token_logprobs"] = FlatEntries(flat, body[a : end + 2])
    return rest


def _fast_flat(entries: FlatEntries, ids: Sequence[int], start: int) -> list[float] | None:
    """:func:`_fast_logprobs` on flat entries; None when anything is off (then entry by entry)."""
    flat = entries.flat
    if not flat or flat[2::3].count(None) != len(entries) or flat[1::3] != ids[start:]:
        return None
    values = flat[3::3]
    if not set(map(type, values)) <= _NUMBER_TYPES or not set(map(type, flat[1::3])) <= {int}:
        return None
    return _as_logprobs(values)


def _checked_logprobs(entries: list[Any], ids: Sequence[int], start: int) -> list[float]:
    """Entry by entry; raises InferenceError at the first entry that is not as sent."""
    logprobs: list[float] = []
    for j, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise _bad(f"entry {j} is not a [logprob, token_id, text] triple: {entry!r}")
        if entry[1] != ids[start + j]:
            raise InferenceError(
                "mismatch",
                f"position {start + j}: server token id {entry[1]!r}, sent {ids[start + j]}",
                retryable=False,
            )
        if j == 0:
            continue  # always null: SGLang does not compute logits before logprob_start_len
        value = entry[0]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # orjson writes -inf as null, so a null here is not a number we can store.
            raise _bad(f"position {start + j}: logprob is {value!r}")
        if not math.isfinite(value) or value > LOGPROB_ROUNDING:
            raise _bad(f"position {start + j}: logprob {value!r} is not a log-probability")
        if value < LOGPROB_FLOOR:
            raise _bad(f"position {start + j}: logprob {value!r} is below the floor {LOGPROB_FLOOR:g}")
        logprobs.append(min(float(value), 0.0))
    return logprobs


# server_info keys that change an input token's logprob (the temperature it is scaled by, the
# original or processed distribution): part of the scorer's identity where echoed
_LOGPROB_KEY = re.compile(r"logprob|temperature|temp_scaled")

# SGLang's server_args (echoed whole by /server_info) that change the numbers a prefill computes,
# each part of the scorer's identity where the server reports it. Never a volatile field (ports,
# hosts, memory fractions and token pools derived from free memory, pids, load): those differ
# between identical servers.
ENGINE_SETTINGS: dict[str, str] = {
    "version": "the engine's build: its kernels",
    "revision": "the weights' revision (the model path is the scorer's server_model)",
    "dtype": "what the model computes in",
    "quantization": "the weights' quantization",
    "torchao_config": "torchao's quantization",
    "kv_cache_dtype": "what the attention reads the context from",
    "enable_fp32_lm_head": "the LM head's precision (the logits)",
    "tp_size": "tensor parallelism: how each matmul's sums are split and reduced",
    "pp_size": "pipeline parallelism",
    "ep_size": "expert parallelism",
    "enable_dp_attention": "data-parallel attention",
    "moe_runner_backend": "the MoE kernels",
    "attention_backend": "the attention kernels",
    "prefill_attention_backend": "the prefill's attention kernels",
    "triton_attention_reduce_in_fp32": "the triton attention's reduction precision",
    "enable_deterministic_inference": "batch-invariant kernels",
    "rl_on_policy_target": "the kernels matched to a trainer's",
    "json_model_override_args": "overrides of the model's config",
}


def logprob_settings(server_info: dict[str, Any]) -> dict[str, Any]:
    """The server's settings that change input logprobs, where it reports them (scalars only)."""
    return {
        k: v
        for k, v in sorted(server_info.items())
        if _LOGPROB_KEY.search(k) and (v is None or isinstance(v, (str, int, float, bool)))
    }


def engine_settings(server_info: dict[str, Any]) -> dict[str, Any]:
    """The settings of :data:`ENGINE_SETTINGS` and the logprob settings the server reports."""
    settings = {k: server_info[k] for k in ENGINE_SETTINGS if k in server_info}
    return {k: v for k, v in {**settings, **logprob_settings(server_info)}.items() if v is None or _scalar(v)}


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def is_router(server_info: dict[str, Any]) -> bool:
    """An SGLang router (sglang-router, ``smg``) answers ``/get_server_info`` itself, with its own
    counts (``router_manager``, ``workers_count``) and none of its workers' settings."""
    return "version" not in server_info and any(k in server_info for k in ("router_manager", "workers_count"))


class SGLangBackend(HttpBackend):
    kind = "sglang"
    top_k = 0  # ``score --top-k K``: set by ``prepare``; the request asks top_logprobs_num K (scoring/topk.py)

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        max_new_tokens: int = 0,
        client: HttpClient | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> None:
        super().__init__(url, api_key=api_key, client=client, timeout=timeout)
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.model_info: dict[str, Any] = {}
        self.server_info: dict[str, Any] = {}
        # what the engine computes with (engine_settings); None: not readable (settings_source says why)
        self.settings: dict[str, Any] | None = None
        self.settings_source = ""
        self.worker_infos: list[dict[str, Any]] = []  # behind a router: each worker's server_info

    async def start(self) -> None:
        self.model_info = await self._read_model_info()
        # The SGLang router forwards only the older names (/get_*) to a worker.
        self.server_info = await self._read_server_info(self._open())
        self._check_requested_model()
        if not self.settings_source:  # once per backend: prepare() and the run share them
            await self._read_settings()
        self.remember_served()

    @staticmethod
    async def _read_server_info(client: HttpClient) -> dict[str, Any]:
        for path in ("/server_info", "/get_server_info"):
            try:
                info = await client.get_json(path)
            except InferenceError as exc:
                if not exc.kind.startswith("http_4"):
                    raise
                continue
            return info if isinstance(info, dict) else {}
        return {}

    async def _read_settings(self) -> None:
        """The engine's settings (:func:`engine_settings`): the server's own, or behind a router
        each worker's, asked directly (the router's ``/workers`` lists them); workers that
        disagree are refused, naming the setting. Nothing readable (a router without
        ``/workers``, workers out of reach): no settings in the scorer, as before, said in the
        spec's provenance and in one logged line."""
        if not is_router(self.server_info):
            self.settings, self.settings_source = engine_settings(self.server_info), "the server"
            return
        listed = await self.get_optional("/workers")
        workers = listed.get("workers") if isinstance(listed, dict) else None
        urls = [w["url"] for w in workers or [] if isinstance(w, dict) and isinstance(w.get("url"), str)]
        if not urls:
            return self._unreadable("the router lists no workers (GET /workers)")
        seen: dict[str, dict[str, Any]] = {}
        for url in urls:
            client = HttpClient(url, api_key=self.api_key, timeout=10.0)
            try:
                info = await self._read_server_info(client)
            except InferenceError as exc:
                return self._unreadable(f"worker {mask_url(url)} cannot be asked directly ({exc.kind})")
            finally:
                await client.close()
            if "version" not in info:
                return self._unreadable(f"worker {mask_url(url)} reports no server_info")
            seen[url] = engine_settings(info)
            self.worker_infos.append(info)
        first_url, first = next(iter(seen.items()))
        for url, settings in seen.items():
            differ = sorted(k for k in set(first) | set(settings) if first.get(k) != settings.get(k))
            if differ:
                k = differ[0]
                raise ScoringError(
                    f"the workers behind the SGLang router at {self.display_url} run with other settings: "
                    f"{k} {first.get(k)!r} at {mask_url(first_url)}, {settings.get(k)!r} at {mask_url(url)} "
                    f"({ENGINE_SETTINGS.get(k, 'a logprob setting')}): their scores would be two scorers' under "
                    "one; give each group of workers its own router"
                )
        self.settings, self.settings_source = first, f"{len(seen)} worker(s) behind the router, asked directly"

    def _unreadable(self, why: str) -> None:
        self.settings_source = f"not read: {why}"
        self.worker_infos = []  # the input limit is then the router's answer, as before
        log.warning(
            "the SGLang router at %s: the engine's settings could not be read (%s); the scorer does not name them",
            self.display_url,
            why,
        )

    def _check_requested_model(self) -> None:
        """``--model NAME`` labels the scores: refuse before any request when the server
        serves another model (its path, its served name, or the path's last part)."""
        served = [v for v in (self.model_info.get("model_path"), self.model_info.get("served_model_name")) if v]
        if self.model is None or not served:
            return  # no label asked for (the served id is the label), or a server that does not say
        names = {str(v).rstrip("/") for v in served}
        names |= {n.rsplit("/", 1)[-1] for n in names}
        if self.model.rstrip("/") not in names:
            raise ScoringError(
                f"the SGLang server at {self.display_url} serves {served[0]!r}, not --model {self.model!r}: "
                "pass the served model's name or path, or omit --model to label scores with it"
            )

    async def _read_model_info(self) -> dict[str, Any]:
        info = await self.get_optional("/model_info")
        info = info if info is not None else await self._open().get_json("/get_model_info")  # older servers
        return info if isinstance(info, dict) else {}

    def served_facts(self) -> dict[str, Any]:
        # a server asked directly: its settings too (a restart with others stops a run; behind a
        # router they are the workers', read when the run starts)
        direct = self.settings_source == "the server" and self.settings
        return {**_served_facts(self.model_info), **({"engine": self.settings} if direct else {})}

    async def read_served_facts(self) -> dict[str, Any]:
        facts = _served_facts(await self._read_model_info())
        if self.settings_source == "the server" and self.settings:
            facts["engine"] = engine_settings(await self._read_server_info(self._open()))
        return facts

    def server_model_id(self) -> str | None:
        return self.model_info.get("model_path") or self.model_info.get("served_model_name")

    def tokenizer_path(self) -> str | None:
        return self.model_info.get("tokenizer_path")

    def identity(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.model,
            "server_model": self.server_model_id(),
            "max_new_tokens": self.max_new_tokens,
            **(precision_identity(**self.computes_in()) if self.computes_in() else {}),
            # what the engine computes with, where it says (server_info; behind a router, its workers')
            **({"engine": {"name": "sglang", **self.settings}} if self.settings else {}),
        }

    def computes_in(self) -> dict[str, str]:
        """The served dtype and device type, when the server reports them (the reference server)."""
        dtype, device = self.model_info.get("dtype"), self.model_info.get("device")
        return {"dtype": str(dtype), "device": str(device)} if dtype and device else {}

    def reported(self) -> dict[str, Any]:
        """Recorded with the scorer (provenance, not its id): where the engine's settings in its
        identity were read, or why they could not be (an SGLang router without ``/workers``)."""
        return {"engine_settings": self.settings_source} if self.settings_source else {}

    def context_length(self) -> int | None:
        """The input limit: the server's, or behind a router the smallest of its workers'."""
        limits = [_input_limit({**self.model_info, **info}) for info in self.worker_infos or [self.server_info]]
        known = [n for n in limits if n is not None]
        return min(known) if known else None

    async def score(self, prompt: StepPrompt) -> BackendScore:
        started = time.monotonic()
        payload = build_payload(prompt, max_new_tokens=self.max_new_tokens)
        if self.top_k:  # the same request: input_top_logprobs beside input_token_logprobs
            payload["top_logprobs_num"] = self.top_k
        body = await self._started().post_json("/generate", payload, routing_headers(prompt), decode=decode_generate)
        await self.verify_model()
        self._check_weight_version(body)
        result = parse_response(prompt, body)
        top = None
        if self.top_k:
            top = sglang_entries(prompt, body[0] if isinstance(body, list) else body, self.top_k)
        return BackendScore(
            logprobs=result.logprobs,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            latency_s=time.monotonic() - started,
            model_id=self.server_model_id(),
            top=top,
        )

    def weight_version(self) -> str | None:
        """The weight version the server reports (``/model_info``), read at start."""
        value = (self.served or {}).get("weight_version")
        return None if value is None else str(value)

    def _check_weight_version(self, body: Any) -> None:
        """Every response reports the weights it came from (``meta_info.weight_version``)."""
        items = body if isinstance(body, list) else [body]
        expected = (self.served or {}).get("weight_version")
        for item in items:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            got = meta.get("weight_version") if isinstance(meta, dict) else None
            if expected is not None and got is not None and got != expected:
                self._compare_served({**(self.served or {}), "weight_version": got}, "in a response")

    async def server_tokens(self, text: str) -> tuple[list[int], bool] | None:
        """``text`` as the server's own tokenizer encodes it, and whether special tokens (a BOS)
        were added: ``/tokenize`` without them where the server has it, else ``/generate`` with
        ``text`` (which adds them: SGLang calls its tokenizer with the defaults) and the ids
        read back from the input logprobs of a prefill-only request. None when the server
        cannot tokenize (started with ``--skip-tokenizer-init``)."""
        tokens = await self._tokenize({"prompt": text, "add_special_tokens": False})
        if tokens is not None:
            return tokens, False
        payload = {
            "text": text,
            "return_logprob": True,
            "logprob_start_len": 0,  # every position's id comes back
            "sampling_params": {"max_new_tokens": 0},
            "stream": False,
            "rid": uuid.uuid4().hex,
        }
        try:
            body = await self._open().post_json("/generate", payload)
        except InferenceError as exc:
            if exc.kind.startswith("http_4"):
                return None
            raise
        meta = body.get("meta_info") if isinstance(body, dict) else None
        entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) >= 2 for e in entries):
            raise _bad("POST /generate with text: no input_token_logprobs to read the server's token ids from")
        return [e[1] for e in entries], True

    async def check_token_id(self, token_id: int) -> str | None:
        """None when the server accepts ``token_id``, else its reason. SGLang reports no
        vocabulary size, but rejects ids outside it: a prefill-only request that computes nothing."""
        return await self._rejection(
            "/generate", {"input_ids": [token_id], "sampling_params": {"max_new_tokens": 0}, "stream": False}
        )


def _input_limit(info: dict[str, Any]) -> int | None:
    # SGLang takes at most max_req_input_len input tokens; a model of context 32768 accepts
    # 32767 (it keeps one position to generate), so context_length alone means one less.
    limit, context = info.get("max_req_input_len"), info.get("context_length")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    if isinstance(context, int) and not isinstance(context, bool) and context > 1:
        return context - 1
    return None


def _served_facts(model_info: dict[str, Any]) -> dict[str, Any]:
    return {k: model_info.get(k) for k in ("model_path", "tokenizer_path", "weight_version", "dtype", "device")}


def sglang_entries(prompt: StepPrompt, body: Any, k: int) -> list[list[tuple[int, float]]]:
    """Each scored position's K most likely (id, logprob) from an answer ``parse_response`` already
    checked (``input_top_logprobs``: entry 0 null, then K ``[logprob, id, text]`` per position)."""
    entries = (body.get("meta_info") or {}).get("input_top_logprobs") if isinstance(body, dict) else None
    n = len(prompt.input_ids) - prompt.first_scored
    if not isinstance(entries, list) or len(entries) != n + 1:
        got = len(entries) if isinstance(entries, list) else entries
        raise InferenceError(
            "bad_response", f"input_top_logprobs has {got!r} entries for {n} scored tokens (+1)", retryable=False
        )
    out = []
    for i, row in enumerate(entries[1:]):
        if not isinstance(row, list) or len(row) != k:
            raise InferenceError("bad_response", f"position {i}: {row!r:.80} is not {k} triples", retryable=False)
        pairs = []
        for triple in row:
            lp, token = (triple[0], triple[1]) if isinstance(triple, list) and len(triple) >= 2 else (None, None)
            if not isinstance(token, int) or not isinstance(lp, (int, float)):
                raise InferenceError("bad_response", f"position {i}: triple {triple!r:.80}", retryable=False)
            pairs.append((int(token), min(float(lp), 0.0)))
        out.append(sorted(pairs, key=lambda p: -p[1]))
    return out
