"""vLLM OpenAI-compatible ``POST /v1/completions`` with ``prompt_logprobs`` (vLLM's OpenAI-compatible server, ``prompt_logprobs`` sampling parameter).

Pure payload building and response parsing, plus a thin Backend over ``HttpClient``.
We send the token ids as ``prompt`` (no tokenizer runs, so no BOS is added),
``max_tokens: 1`` (vLLM rejects 0 outside the echo path), ``temperature: 0``,
``prompt_logprobs`` and ``detokenize: false`` (otherwise vLLM decodes every returned
candidate token to text on its event loop and stalls the engine; we read ids only:
docs/SCORING.md "Connections"). vLLM computes logprobs for the whole prompt (there is no start
offset): entry 0 is null, and entry ``i`` is a dict keyed by token id *as a string*
that always contains the prompt token at ``i`` (plus the top-k). We keep entries
``first_scored:`` and check everything we can: the count, every position's token id,
``prompt_token_ids`` and ``usage.prompt_tokens`` when present, and ``-9999.0`` (vLLM's
clamp of ``-inf``), which is not a log-probability we can store.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import httpx

from hcapo_store.errors import InferenceError, ScoringError
from hcapo_store.rendering.requests import StepPrompt
from hcapo_store.scoring import defaults
from hcapo_store.scoring.backends.base import LOGPROB_ROUNDING, BackendScore, checked_cached_tokens, routing_headers
from hcapo_store.scoring.backends.http import HttpBackend, HttpClient, wire_ids

VLLM_LOGPROB_FLOOR = -9999.0  # vLLM writes -inf prompt logprobs as this value
# vLLM's --logprobs-mode (since vllm #47680 prompt_logprobs follow it): only raw log-probabilities
# are scored unless the scorer declares another mode (ScoreConfig.logprobs_mode, --logprobs-mode);
# the names and the default live in scoring/defaults.py
RAW_LOGPROBS = defaults.LOGPROBS_MODE
LOGPROBS_MODES = defaults.LOGPROBS_MODES
_MODE_IN_CONFIG = re.compile(r"logprobs_mode\W{0,4}(?:LogprobsMode\.)?([A-Za-z_]+)")
DEFAULT_PROMPT_LOGPROBS = 1  # 0 is accepted by recent vLLM only; 1 everywhere (vLLM's SamplingParams)


def build_payload(
    prompt: StepPrompt, *, model: str | None = None, prompt_logprobs: int = DEFAULT_PROMPT_LOGPROBS
) -> dict[str, Any]:
    if prompt.first_scored < 1:
        raise ValueError("the first scored token needs at least one token of context")
    payload: dict[str, Any] = {
        "prompt": wire_ids(prompt.input_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": prompt_logprobs,
        "detokenize": False,  # ids are all we read; decoding each candidate stalls vLLM's loop
        "stream": False,
    }
    if model is not None:
        payload["model"] = model
    return payload


def _bad(message: str) -> InferenceError:
    return InferenceError("bad_response", message, retryable=False)


def _mismatch(message: str) -> InferenceError:
    return InferenceError("mismatch", message, retryable=False)


def _logprob_value(value: Any) -> Any:
    """A ``Logprob`` object ``{"logprob": x, "rank": r, …}``, or a bare number."""
    if isinstance(value, dict):
        return value.get("logprob")
    return value


def parse_response(prompt: StepPrompt, body: Any) -> BackendScore:
    """Verify and extract the scored logprobs; raise InferenceError on anything off."""
    if not isinstance(body, dict):
        raise _bad(f"response is not a JSON object: {str(body)[:200]!r}")
    if "choices" not in body and ("error" in body or body.get("object") == "error"):
        err = body.get("error", body)
        message = err.get("message") if isinstance(err, dict) else err
        raise _bad(f"server returned an error with HTTP 200: {str(message)[:300]!r}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        n = len(choices) if isinstance(choices, list) else None
        raise _bad(f"expected exactly one choice, got {n if n is not None else repr(choices)[:100]}")
    choice = choices[0]
    ids = prompt.input_ids
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list):
        raise _bad("response has no prompt_logprobs (was prompt_logprobs honoured? it is a vLLM extra parameter)")
    if len(entries) != len(ids):
        raise _mismatch(f"expected {len(ids)} prompt_logprobs entries, got {len(entries)} (truncated by the server?)")
    token_ids = choice.get("prompt_token_ids")
    if token_ids is not None:
        if not isinstance(token_ids, list) or len(token_ids) != len(ids):
            raise _mismatch(
                f"server prompt_token_ids has {len(token_ids) if isinstance(token_ids, list) else '?'} "
                f"entries, we sent {len(ids)}"
            )
        for i, (got, sent) in enumerate(zip(token_ids, ids)):
            if got != sent:
                raise _mismatch(f"position {i}: server prompt token id {got!r}, sent {sent}")
    usage = body.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool) and prompt_tokens != len(ids):
        raise _mismatch(f"server counted {prompt_tokens} prompt tokens, we sent {len(ids)} (truncated by the server?)")
    if entries[0] is not None:
        raise _bad(
            f"prompt_logprobs entry 0 should be null (no context before the first token), got {entries[0]!r:.100}"
        )
    logprobs: list[float] = []
    for i in range(1, len(ids)):
        entry = entries[i]
        if not isinstance(entry, dict):
            raise _bad(f"position {i}: prompt_logprobs entry is {entry!r:.100}, not a dict keyed by token id")
        key = str(ids[i])
        if key not in entry:
            raise _mismatch(
                f"position {i}: sent token id {ids[i]} is not among the returned ids "
                f"{list(entry)[:5]} (token alignment is off)"
            )
        if i < prompt.first_scored:
            continue  # context: only the alignment matters
        value = _logprob_value(entry[key])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(f"position {i}: logprob is {value!r}")
        if value <= VLLM_LOGPROB_FLOOR:
            raise _bad(f"position {i}: logprob {value!r} is vLLM's clamp of -inf (probability 0 under the model)")
        if not math.isfinite(value) or value > LOGPROB_ROUNDING:
            raise _bad(f"position {i}: logprob {value!r} is not a log-probability")
        logprobs.append(min(float(value), 0.0))
    cached = None
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens_details"), dict):
        c = usage["prompt_tokens_details"].get("cached_tokens")
        cached = checked_cached_tokens(c, len(ids))
    return BackendScore(
        logprobs=logprobs,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool) else None,
        cached_tokens=cached,
    )


class VLLMBackend(HttpBackend):
    kind = "vllm"
    top_k = 0  # ``score --top-k K``: set by ``prepare``; the request asks prompt_logprobs K (scoring/topk.py)

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        prompt_logprobs: int = DEFAULT_PROMPT_LOGPROBS,
        logprobs_mode: str = RAW_LOGPROBS,
        client: HttpClient | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> None:
        super().__init__(url, api_key=api_key, client=client, timeout=timeout)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ScoringError(f"logprobs mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if logprobs_mode not in defaults.SCORABLE_LOGPROBS_MODES:
            raise ScoringError(
                f"--logprobs-mode {logprobs_mode}: prompt_logprobs in a logits mode are not log-probabilities, "
                f"which is what is stored; use one of {', '.join(defaults.SCORABLE_LOGPROBS_MODES)}"
            )
        self.logprobs_mode = logprobs_mode  # what the scorer declares the server's mode is
        self.served_logprobs_mode: str | None = None  # what the server says (/server_info), when it does
        self.requested_model = model
        self.model = model  # the served model name sent with every request (learned in start())
        self.prompt_logprobs = prompt_logprobs
        self.model_card: dict[str, Any] = {}
        self.version: str | None = None

    async def _model_cards(self) -> list[dict[str, Any]]:
        body = await self._open().get_json("/v1/models")
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list):
            raise InferenceError(
                "bad_response", f"GET /v1/models: no data list in {str(body)[:200]!r}", retryable=False
            )
        return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]

    def served_facts(self) -> dict[str, Any]:
        # the logprobs mode where the server reports it: a restart with another stops a run
        mode = {"logprobs_mode": self.served_logprobs_mode} if self.served_logprobs_mode else {}
        return {"id": self.model_card.get("id"), "root": self.model_card.get("root"), **mode}

    async def read_served_facts(self) -> dict[str, Any]:
        card = next((c for c in await self._model_cards() if c["id"] == self.model), {})
        mode = await self._read_logprobs_mode() if self.served_logprobs_mode else None
        return {"id": card.get("id"), "root": card.get("root"), **({"logprobs_mode": mode} if mode else {})}

    async def start(self) -> None:
        cards = await self._model_cards()
        served = [c["id"] for c in cards]
        if self.requested_model is None:
            if len(cards) != 1:
                raise ScoringError(
                    f"the vLLM server at {self.display_url} serves {served or 'no models'}: "
                    "pass --model NAME to choose one"
                )
            self.model_card = cards[0]
        else:
            match = [c for c in cards if c["id"] == self.requested_model]
            if not match:
                raise ScoringError(
                    f"the vLLM server at {self.display_url} serves {served}, not {self.requested_model!r}"
                )
            self.model_card = match[0]
        self.model = self.model_card["id"]
        info = await self.get_optional("/version")
        self.version = info.get("version") if isinstance(info, dict) else None
        self.served_logprobs_mode = await self._read_logprobs_mode()
        mode = self.served_logprobs_mode
        if mode is not None and mode != self.logprobs_mode:
            remedy = (
                f"pass --logprobs-mode {mode} (a scorer of its own)"
                if mode in defaults.SCORABLE_LOGPROBS_MODES
                else "its logits are not log-probabilities"
            )
            raise ScoringError(
                f"the vLLM server at {self.display_url} runs --logprobs-mode {mode}, not {self.logprobs_mode} "
                f"(the scorer's --logprobs-mode): {remedy}, or restart the server with --logprobs-mode "
                f"{self.logprobs_mode}"
            )
        self.remember_served()

    async def _read_logprobs_mode(self) -> str | None:
        """The server's --logprobs-mode where it says (``/server_info``, which vLLM answers in its
        development mode with its whole config: as JSON when asked, the text form names no mode);
        None when it does not."""
        info = await self.get_optional("/server_info?config_format=json")
        if not isinstance(info, dict):
            return None
        match = _MODE_IN_CONFIG.search(json.dumps(info))
        mode = match.group(1).lower() if match else None
        return mode if mode in LOGPROBS_MODES else None

    def server_model_id(self) -> str | None:
        return self.model_card.get("root") or self.model

    def tokenizer_path(self) -> str | None:
        """vLLM's ``root`` is the model path or hub id; used as the tokenizer when it is a local dir."""
        return self.model_card.get("root")

    def identity(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.model,
            "server_model": self.server_model_id(),
            "prompt_logprobs": self.prompt_logprobs,
            # what changes the numbers, where known: only when set or reported (existing
            # scorers of a server that reports neither keep their ids)
            **({"logprobs_mode": self.logprobs_mode} if self.logprobs_mode != RAW_LOGPROBS else {}),
            **({"engine": {"name": "vllm", "version": self.version}} if self.version else {}),
        }

    def context_length(self) -> int | None:
        # prompt + max_tokens (1, see above) must fit max_model_len
        value = self.model_card.get("max_model_len")
        return value - 1 if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None

    async def score(self, prompt: StepPrompt) -> BackendScore:
        client = self._started()
        started = time.monotonic()
        body = await client.post_json(
            "/v1/completions",
            # top-k: prompt_logprobs K gives each position's K most likely with the sampled token's own
            build_payload(prompt, model=self.model, prompt_logprobs=max(self.prompt_logprobs, self.top_k)),
            routing_headers(prompt),
        )
        await self.verify_model()
        reported = body.get("model") if isinstance(body, dict) else None
        if isinstance(reported, str) and reported != self.model:  # every completion names its model
            self._compare_served({**(self.served or {}), "id": reported}, "in a response")
        result = parse_response(prompt, body)
        top = None
        if self.top_k:
            top = vllm_ranked(prompt, body, self.top_k)
        return BackendScore(
            logprobs=result.logprobs,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            latency_s=time.monotonic() - started,
            model_id=self.server_model_id(),
            top=top,
        )

    async def server_tokens(self, text: str) -> tuple[list[int], bool] | None:
        """``text`` as the served model's tokenizer encodes it (``POST /tokenize``, without
        special tokens); None when the server cannot tokenize (no tokenizer, or no such route)."""
        tokens = await self._tokenize({"model": self.model, "prompt": text, "add_special_tokens": False})
        return None if tokens is None else (tokens, False)

    async def check_token_id(self, token_id: int) -> str | None:
        """None when the server accepts ``token_id``, else its reason (vLLM rejects prompt ids
        outside the vocabulary with HTTP 400; it reports no vocabulary size)."""
        return await self._rejection(
            "/v1/completions",
            {"model": self.model, "prompt": [token_id], "max_tokens": 1, "temperature": 0.0, "stream": False},
        )


def vllm_ranked(prompt: StepPrompt, body: Any, k: int) -> list[list[tuple[int, float]]]:
    """Each scored position's K most likely (id, logprob) from an answer ``parse_response`` already
    checked (``prompt_logprobs: K``: entries by rank; the sampled token's own entry beside them)."""
    entries = body["choices"][0]["prompt_logprobs"]
    out = []
    for i in range(prompt.first_scored, len(prompt.input_ids)):
        ranked = []
        for key, value in entries[i].items():
            rank = value.get("rank") if isinstance(value, dict) else None
            lp = value.get("logprob") if isinstance(value, dict) else value
            if isinstance(rank, int) and 1 <= rank <= k and isinstance(lp, (int, float)):
                ranked.append((rank, int(key), float(lp)))
        ranked.sort()
        if [r for r, _, _ in ranked] != list(range(1, k + 1)):
            raise InferenceError(
                "bad_response",
                f"position {i}: prompt_logprobs ranks {[r for r, _, _ in ranked]}, not 1..{k}",
                retryable=False,
            )
        out.append([(t, min(v, 0.0)) for _, t, v in ranked])
    return out
