"""The vLLM backend: pure payload/parse checks, a stdlib fault server for malformed
responses, and the reference server's ``/v1/completions`` over real HTTP, checked against
the SGLang path and a direct forward pass of the same tiny model."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.errors import InferenceError, ScoringError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.requests import StepPrompt
from hcapo_store.scoring.backends.sglang import SGLangBackend
from hcapo_store.scoring.backends.vllm import VLLMBackend, build_payload, parse_response
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store

TOL = 1e-5
IDS = [3, 17, 5, 9, 11, 4]


def _prompt(ids: list[int] = IDS, first_scored: int = 3) -> StepPrompt:
    return StepPrompt(
        step_index=0,
        input_ids=list(ids),
        first_scored=first_scored,
        total_action_tokens=len(ids) - first_scored,
        skipped_action_tokens=0,
        truncated_prefix_tokens=0,
        flattened=False,
    )


def _good_body(ids: list[int] = IDS, *, value: float = -1.5) -> dict[str, Any]:
    entries: list[Any] = [None]
    for i, tok in enumerate(ids[1:], start=1):
        entries.append(
            {
                str(tok): {"logprob": value - i / 10, "rank": 2, "decoded_token": "x"},
                "99": {"logprob": -0.1, "rank": 1, "decoded_token": "y"},
            }
        )
    # vLLM names the served model (the request's) in every completion.
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "served-name",
        "choices": [
            {
                "index": 0,
                "text": "a",
                "finish_reason": "length",
                "prompt_logprobs": entries,
                "prompt_token_ids": list(ids),
            }
        ],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
    }


# --- pure functions ----------------------------------------------------------------------


def test_build_payload() -> None:
    p = build_payload(_prompt(), model="served")
    assert p == {
        "prompt": IDS,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 1,
        "detokenize": False,
        "stream": False,
        "model": "served",
    }
    assert build_payload(_prompt(), prompt_logprobs=0)["prompt_logprobs"] == 0
    with pytest.raises(ValueError):
        build_payload(_prompt(first_scored=0))


def test_parse_good_response_keeps_scored_positions() -> None:
    got = parse_response(_prompt(), _good_body())
    assert got.logprobs == pytest.approx([-1.8, -1.9, -2.0])
    assert got.prompt_tokens == len(IDS)
    # A bare number instead of a Logprob object, no prompt_token_ids, no usage: accepted.
    body = _good_body()
    choice = body["choices"][0]
    choice["prompt_logprobs"] = [None] + [{str(t): -0.5} for t in IDS[1:]]
    del choice["prompt_token_ids"]
    del body["usage"]
    assert parse_response(_prompt(), body).logprobs == [-0.5, -0.5, -0.5]


def _mutated(fn) -> dict[str, Any]:
    body = _good_body()
    fn(body, body["choices"][0])
    return body


@pytest.mark.parametrize(
    ("mutate", "kind"),
    [
        (lambda b, c: c["prompt_logprobs"][4].pop(str(IDS[4])), "mismatch"),  # sent id missing in a scored row
        (lambda b, c: c["prompt_logprobs"][1].pop(str(IDS[1])), "mismatch"),  # ... in a context row
        (lambda b, c: c["prompt_logprobs"].pop(), "mismatch"),  # one entry short
        (lambda b, c: c.__setitem__("prompt_token_ids", [*IDS[:-1], 7]), "mismatch"),
        (lambda b, c: b["usage"].__setitem__("prompt_tokens", len(IDS) - 1), "mismatch"),
        (lambda b, c: c["prompt_logprobs"][5][str(IDS[5])].__setitem__("logprob", -9999.0), "bad_response"),
        (lambda b, c: c["prompt_logprobs"][5][str(IDS[5])].__setitem__("logprob", None), "bad_response"),
        (lambda b, c: c["prompt_logprobs"][5][str(IDS[5])].__setitem__("logprob", 0.5), "bad_response"),
        (lambda b, c: c["prompt_logprobs"].__setitem__(0, {str(IDS[0]): {"logprob": -1.0}}), "bad_response"),
        (lambda b, c: c["prompt_logprobs"].__setitem__(3, None), "bad_response"),
        (lambda b, c: c.__setitem__("prompt_logprobs", None), "bad_response"),  # misspelled / ignored param
        (lambda b, c: b["choices"].append(dict(c)), "bad_response"),
        (lambda b, c: b.pop("choices"), "bad_response"),
    ],
)
def test_parse_rejects(mutate, kind: str) -> None:
    with pytest.raises(InferenceError) as info:
        parse_response(_prompt(), _mutated(mutate))
    assert info.value.kind == kind and not info.value.retryable


def test_parse_rejects_integer_keys_mismatch() -> None:
    # Keys must be the token id as a string (JSON); another token at the position is a mismatch.
    body = _good_body()
    body["choices"][0]["prompt_logprobs"][3] = {"12345": {"logprob": -0.2}}
    with pytest.raises(InferenceError, match="position 3"):
        parse_response(_prompt(), body)


# --- a stdlib fault server ---------------------------------------------------------------


class _Fault:
    """Serves /v1/models and answers /v1/completions with whatever ``reply`` says."""

    def __init__(self) -> None:
        self.reply: tuple[int, bytes] = (200, b"{}")
        self.models: Any = {
            "object": "list",
            "data": [{"id": "served-name", "root": "/nowhere", "max_model_len": 4096}],
        }
        self.bodies: list[dict[str, Any]] = []
        self.gets: dict[str, Any] = {}  # more GET routes (/version, /server_info) and their bodies
        fault = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, json.dumps(fault.models).encode())
                elif self.path.split("?")[0] in fault.gets:
                    self._send(200, json.dumps(fault.gets[self.path.split("?")[0]]).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                fault.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._send(*fault.reply)

            def _send(self, status: int, data: bytes) -> None:
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
        host, port = self.httpd.server_address[:2]
        self.url = f"http://{host}:{port}"


@pytest.fixture
def fault() -> Iterator[_Fault]:
    f = _Fault()
    yield f
    f.httpd.shutdown()
    f.httpd.server_close()


async def _score_once(url: str, prompt: StepPrompt, **kw: Any):
    backend = VLLMBackend(url, **kw)
    await backend.start()
    try:
        return backend, await backend.score(prompt)
    finally:
        await backend.close()


def test_fault_server_good_and_model_discovery(fault: _Fault) -> None:
    fault.reply = (200, json.dumps(_good_body()).encode())
    backend, result = asyncio.run(_score_once(fault.url + "/v1/", _prompt()))
    assert result.logprobs == pytest.approx([-1.8, -1.9, -2.0]) and result.model_id == "/nowhere"
    assert fault.bodies[-1]["model"] == "served-name" and fault.bodies[-1]["prompt"] == IDS
    assert backend.context_length() == 4095  # input tokens: max_model_len 4096 less the one generated
    assert backend.identity() == {
        "kind": "vllm",
        "model": "served-name",
        "server_model": "/nowhere",
        "prompt_logprobs": 1,
    }


@pytest.mark.parametrize(
    ("status", "data", "kind", "retryable"),
    [
        (200, b"not json", "bad_response", False),
        (200, json.dumps({"object": "error", "message": "boom", "code": 400}).encode(), "bad_response", False),
        (200, json.dumps(_mutated(lambda b, c: c["prompt_logprobs"][4].pop(str(IDS[4])))).encode(), "mismatch", False),
        (
            200,
            json.dumps(_mutated(lambda b, c: c["prompt_logprobs"][4][str(IDS[4])].update(logprob=-9999.0))).encode(),
            "bad_response",
            False,
        ),
        (
            400,
            json.dumps({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}).encode(),
            "http_400",
            False,
        ),
        (503, b'{"error": {"message": "overloaded"}}', "http_503", True),
    ],
)
def test_fault_server_rejects(fault: _Fault, status: int, data: bytes, kind: str, retryable: bool) -> None:
    fault.reply = (status, data)
    with pytest.raises(InferenceError) as info:
        asyncio.run(_score_once(fault.url, _prompt()))
    assert info.value.kind == kind and info.value.retryable is retryable


def test_a_completion_from_another_model_is_refused(fault: _Fault) -> None:
    body = _good_body()
    body["model"] = "another-model"
    fault.reply = (200, json.dumps(body).encode())
    with pytest.raises(InferenceError) as info:
        asyncio.run(_score_once(fault.url, _prompt()))
    assert info.value.kind == "model_changed" and not info.value.retryable
    assert "'served-name' -> 'another-model'" in str(info.value)


def test_the_scorer_names_the_engine_and_its_logprobs_mode(fault: _Fault) -> None:
    """Issue 40: vLLM's --logprobs-mode changes prompt_logprobs (vllm #47680): a server that
    reports a mode other than raw log-probabilities is refused unless the scorer declares it,
    and then it is in the scorer's identity, with the engine's version."""
    fault.reply = (200, json.dumps(_good_body()).encode())
    fault.gets["/version"] = {"version": "0.21.0"}
    fault.gets["/server_info"] = {"vllm_config": "model='m', logprobs_mode=LogprobsMode.PROCESSED_LOGPROBS, seed=0"}
    with pytest.raises(ScoringError, match="runs --logprobs-mode processed_logprobs"):
        asyncio.run(_score_once(fault.url, _prompt()))
    backend, result = asyncio.run(_score_once(fault.url, _prompt(), logprobs_mode="processed_logprobs"))
    assert result.logprobs == pytest.approx([-1.8, -1.9, -2.0])
    assert backend.identity()["logprobs_mode"] == "processed_logprobs"
    assert backend.identity()["engine"] == {"name": "vllm", "version": "0.21.0"}
    fault.gets["/server_info"] = {"vllm_config": "logprobs_mode=raw_logprobs"}
    backend, _ = asyncio.run(_score_once(fault.url, _prompt()))
    assert "logprobs_mode" not in backend.identity()  # raw: the default, named by its absence
    with pytest.raises(ScoringError, match="logprobs mode must be one of"):
        VLLMBackend(fault.url, logprobs_mode="softmax")


def test_model_selection(fault: _Fault) -> None:
    fault.models = {"data": [{"id": "a"}, {"id": "b", "max_model_len": 100}]}

    async def start(**kw: Any) -> VLLMBackend:
        backend = VLLMBackend(fault.url, **kw)
        try:
            await backend.start()
        finally:
            await backend.close()
        return backend

    with pytest.raises(ScoringError, match="pass --model"):
        asyncio.run(start())
    with pytest.raises(ScoringError, match="not 'c'"):
        asyncio.run(start(model="c"))
    backend = asyncio.run(start(model="b"))
    assert (
        backend.model == "b" and backend.context_length() == 99
    )  # its max_model_len 100, less the one generated token


# --- the reference server over real HTTP -------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as srv:
        yield srv


def _full_logprobs(model_dir: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1).numpy()


def test_reference_server_matches_sglang_and_forward_pass(server: ReferenceServer, tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(7)
    prompts = [_prompt(rng.integers(5, 200, n).tolist(), first) for n, first in ((12, 1), (30, 20), (9, 8))]

    async def run() -> tuple[list, list, VLLMBackend]:
        vllm, sglang = VLLMBackend(server.url), SGLangBackend(server.url)
        await vllm.start()
        await sglang.start()
        try:
            return ([await vllm.score(p) for p in prompts], [await sglang.score(p) for p in prompts], vllm)
        finally:
            await vllm.close()
            await sglang.close()

    via_vllm, via_sglang, backend = asyncio.run(run())
    assert backend.model == str(tiny_model_dir) and backend.context_length() == 32767  # input tokens of a 32768 context
    for p, v, s in zip(prompts, via_vllm, via_sglang):
        assert len(v.logprobs) == p.scored_tokens
        np.testing.assert_allclose(v.logprobs, s.logprobs, atol=TOL, rtol=0)
        full = _full_logprobs(tiny_model_dir, p.input_ids)
        expected = [full[i - 1, p.input_ids[i]] for i in range(p.first_scored, len(p.input_ids))]
        np.testing.assert_allclose(v.logprobs, expected, atol=TOL, rtol=0)
        assert v.prompt_tokens == len(p.input_ids)


def test_score_steps_end_to_end_same_as_sglang(
    server: ReferenceServer, tiny_model_dir: Path, samples: Path, tmp_path: Path
) -> None:
    with Store.open(str(tmp_path / "v.db")) as store:
        ingest(store, [samples])
        blobs = {}
        for backend in ("vllm", "sglang"):
            cfg = ScoreConfig(backend=backend, server=server.url, tokenizer=str(tiny_model_dir), max_context=8192)
            prep = prepare(store, cfg)
            report = run_scoring(store, prep, RunOptions(concurrency=2, limit=6))
            assert report.scored == 6 and report.failed == 0, report.summary()
            _, rows = store.query(
                "SELECT step_id, token_logprobs FROM scores WHERE scorer_id = :s ORDER BY step_id",
                {"s": prep.scorer_id},
            )
            blobs[backend] = {step: np.frombuffer(b, dtype="<f4") for step, b in rows}
        assert blobs["vllm"].keys() == blobs["sglang"].keys() and len(blobs["vllm"]) == 6
        for step, values in blobs["vllm"].items():
            np.testing.assert_allclose(values, blobs["sglang"][step], atol=TOL, rtol=0)


def test_an_sglang_scorer_names_the_engine_and_its_logprob_settings(server: ReferenceServer) -> None:
    """Issue 40: the engine's version where the server reports it, and the settings that change
    input logprobs (the temperature they are scaled by) where it echoes them."""
    from hcapo_store.devkit.refserver import SERVER_VERSION
    from hcapo_store.scoring.backends.sglang import logprob_settings

    async def identity() -> dict[str, Any]:
        backend = SGLangBackend(server.url)
        await backend.start()
        try:
            assert backend.reported() == {"engine_settings": "the server"}
            return backend.identity()
        finally:
            await backend.close()

    # in the scorer's id (behind a router, read from its workers: tests/test_sglang_settings.py)
    assert asyncio.run(identity())["engine"]["version"] == SERVER_VERSION
    info = {"version": "0.5", "temp_scaled_logprobs": True, "input_logprob_temperature": 0.7, "port": 1, "x": [1]}
    assert logprob_settings(info) == {"input_logprob_temperature": 0.7, "temp_scaled_logprobs": True}
