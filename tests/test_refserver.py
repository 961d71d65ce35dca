"""The reference server over real HTTP with a real (tiny) model, checked against a direct
full forward pass of the same model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hcapo_store.devkit.refserver import ReferenceServer, make_server

TOL = 1e-5
FullLogprobs = Callable[[list[int]], torch.Tensor]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    # A chunk smaller than most scored spans, so the chunked LM head is exercised.
    with make_server(tiny_model_dir, chunk_size=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ReferenceServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def full_logprobs(tiny_model_dir: Path) -> FullLogprobs:
    """log_softmax of the full-vocabulary logits of a plain forward pass: [n, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


@pytest.fixture(scope="module")
def sequences(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    chat = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
        {"role": "tool", "content": "README.md\nsrc"},
        {"role": "assistant", "content": "Two entries: README.md and src."},
    ]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    generator = torch.Generator().manual_seed(1)
    random_ids = torch.randint(0, len(tokenizer), (23,), generator=generator).tolist()
    return [tokenizer(rendered, add_special_tokens=False)["input_ids"], random_ids, [5, 17]]


def _generate(client: httpx.Client, **body: Any) -> Any:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _check_input_logprobs(item: dict[str, Any], ids: list[int], start: int, full: torch.Tensor) -> None:
    entries = item["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(ids) - start
    assert item["meta_info"]["prompt_tokens"] == start + len(entries)
    if entries:
        assert entries[0] == [None, ids[start], None]
    for j, (logprob, token, text) in enumerate(entries[1:], start=1):
        position = start + j
        assert token == ids[position] and text is None
        assert logprob == pytest.approx(full[position - 1, token].item(), abs=TOL)


@pytest.mark.parametrize("where", ["zero", "one", "middle", "last", "end"])
def test_generate_matches_direct_forward(
    client: httpx.Client, sequences: list[list[int]], full_logprobs: FullLogprobs, where: str
) -> None:
    for ids in sequences:
        n = len(ids)
        start = {"zero": 0, "one": 1, "middle": n // 2, "last": n - 1, "end": n}[where]
        item = _generate(
            client,
            input_ids=ids,
            return_logprob=True,
            logprob_start_len=start,
            sampling_params={"max_new_tokens": 0},
            rid="req-1",
        )
        _check_input_logprobs(item, ids, start, full_logprobs(ids))
        meta = item["meta_info"]
        assert item["output_ids"] == [] and item["text"] == ""
        assert meta["output_token_logprobs"] == []
        assert meta["id"] == "req-1"
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["completion_tokens"] == 0 and meta["cached_tokens"] == 0
        assert meta["weight_version"] == "default" and meta["e2e_latency"] >= 0


def test_generate_batch_in_input_order(
    client: httpx.Client, sequences: list[list[int]], full_logprobs: FullLogprobs
) -> None:
    starts = [len(ids) // 3 for ids in sequences]
    items = _generate(
        client,
        input_ids=sequences,
        return_logprob=True,
        logprob_start_len=starts,
        sampling_params={"max_new_tokens": 0},
        rid="batch",
    )
    assert isinstance(items, list) and len(items) == len(sequences)
    for i, (item, ids, start) in enumerate(zip(items, sequences, starts)):
        assert item["meta_info"]["id"] == f"batch_{i}"
        _check_input_logprobs(item, ids, start, full_logprobs(ids))


def test_generate_without_input_logprobs_runs_no_model(
    client: httpx.Client, server: ReferenceServer, sequences: list[list[int]]
) -> None:
    ids = sequences[1]
    before = server.sequences
    default_start = _generate(client, input_ids=ids, return_logprob=True, sampling_params={"max_new_tokens": 0})
    assert default_start["meta_info"]["input_token_logprobs"] == []
    no_logprob = _generate(client, input_ids=ids, logprob_start_len=0, sampling_params={"max_new_tokens": 0})
    assert "input_token_logprobs" not in no_logprob["meta_info"]
    assert server.sequences == before


def test_generate_one_greedy_token(
    client: httpx.Client, sequences: list[list[int]], full_logprobs: FullLogprobs, tiny_model_dir: Path
) -> None:
    ids = sequences[0]
    full = full_logprobs(ids)
    item = _generate(
        client,
        input_ids=ids,
        return_logprob=True,
        logprob_start_len=len(ids) - 3,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
    )
    expected = int(full[-1].argmax())
    assert item["output_ids"] == [expected]
    assert item["text"] == AutoTokenizer.from_pretrained(str(tiny_model_dir)).decode([expected])
    [[logprob, token, _]] = item["meta_info"]["output_token_logprobs"]
    assert token == expected and logprob == pytest.approx(full[-1, expected].item(), abs=TOL)
    assert item["meta_info"]["completion_tokens"] == 1
    assert item["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    _check_input_logprobs(item, ids, len(ids) - 3, full)


def test_text_is_tokenized_with_special_tokens_default(
    client: httpx.Client, tiny_model_dir: Path, full_logprobs: FullLogprobs
) -> None:
    text = "<|im_start|>user\nRun the tests.<|im_end|>\n"
    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir))(text)["input_ids"]
    item = _generate(client, text=text, return_logprob=True, logprob_start_len=0, sampling_params={"max_new_tokens": 0})
    assert [e[1] for e in item["meta_info"]["input_token_logprobs"]] == ids
    _check_input_logprobs(item, ids, 0, full_logprobs(ids))


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4}, "logprob_start_len=4"),
        ({"input_ids": [], "return_logprob": True}, "input_ids cannot be empty"),
        ({"input_ids": [[1, 2], []], "return_logprob": True}, "input_ids cannot be empty"),
        ({"input_ids": [1, 10**9]}, "vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {}}, "max_new_tokens"),  # SGLang's default is 128
        ({"input_ids": [[1, 2], [3]], "logprob_start_len": [0], "return_logprob": True}, "logprob_start_len"),
        ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "Duplicate request IDs"),
        ({"sampling_params": {"max_new_tokens": 0}}, "input_ids"),
    ],
)
def test_generate_rejects_bad_requests(client: httpx.Client, body: dict[str, Any], fragment: str) -> None:
    response = client.post("/generate", json={"sampling_params": {"max_new_tokens": 0}} | body)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


def test_malformed_json_is_400_and_connection_survives(client: httpx.Client) -> None:
    for content in (b"{not json", b"[1, 2]"):
        response = client.post("/generate", content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 400
        assert response.json()["error"]["message"]
    assert client.post("/nope", json={"a": 1}).status_code == 404
    assert client.get("/health").status_code == 200


def test_info_endpoints(client: httpx.Client, tiny_model_dir: Path) -> None:
    assert client.get("/health").status_code == 200
    info = client.get("/model_info").json()
    assert info["model_path"] == str(tiny_model_dir)
    assert info["tokenizer_path"] == str(tiny_model_dir)
    assert info["is_generation"] is True and info["served_model_name"]
    server_info = client.get("/server_info").json()
    assert server_info["context_length"] == 32768
    assert server_info["max_req_input_len"] == 32767
    assert server_info["version"].startswith("hcapo-reference-")


@pytest.mark.parametrize("k", [0, 3])
def test_vllm_prompt_logprobs(
    client: httpx.Client, sequences: list[list[int]], full_logprobs: FullLogprobs, k: int
) -> None:
    prompts = sequences[:2]
    response = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompts, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    total = sum(len(p) for p in prompts)
    assert body["usage"] == {"prompt_tokens": total, "completion_tokens": 2, "total_tokens": total + 2}
    for index, (choice, ids) in enumerate(zip(body["choices"], prompts)):
        full = full_logprobs(ids)
        assert choice["index"] == index and choice["finish_reason"] == "length"
        assert choice["prompt_token_ids"] == ids
        assert choice["token_ids"] == [int(full[-1].argmax())]
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for i, entry in enumerate(entries[1:], start=1):
            row = full[i - 1]
            actual = entry[str(ids[i])]
            assert actual["logprob"] == pytest.approx(row[ids[i]].item(), abs=TOL)
            assert actual["rank"] == int((row > row[ids[i]]).sum()) + 1
            assert isinstance(actual["decoded_token"], str)
            top = row.topk(k).indices.tolist() if k else []
            assert set(entry) == {str(ids[i])} | {str(t) for t in top}
            for rank, token in enumerate(top, start=1):
                assert entry[str(token)]["rank"] == rank


def test_vllm_without_prompt_logprobs(client: httpx.Client, sequences: list[list[int]]) -> None:
    body = client.post("/v1/completions", json={"prompt": sequences[2], "max_tokens": 1}).json()
    assert body["choices"][0]["prompt_logprobs"] is None
    bad = client.post("/v1/completions", json={"prompt": sequences[2], "max_tokens": 5})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def test_request_counter_counts_calls_and_sequences(
    client: httpx.Client, server: ReferenceServer, sequences: list[list[int]]
) -> None:
    requests, scored = server.requests, server.sequences
    _generate(
        client, input_ids=sequences, return_logprob=True, logprob_start_len=0, sampling_params={"max_new_tokens": 0}
    )
    client.post("/v1/completions", json={"prompt": sequences[0], "max_tokens": 1, "prompt_logprobs": 1})
    assert server.requests == requests + 2
    assert server.sequences == scored + len(sequences) + 1


def test_concurrent_requests_are_consistent(
    server: ReferenceServer, sequences: list[list[int]], full_logprobs: FullLogprobs
) -> None:
    def one(ids: list[int]) -> dict[str, Any]:
        response = httpx.post(
            f"{server.url}/generate",
            content=json.dumps(
                {
                    "input_ids": ids,
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "sampling_params": {"max_new_tokens": 0},
                }
            ),
            timeout=60,
        )
        return response.json()

    work = sequences * 3
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(one, work))
    for item, ids in zip(results, work):
        _check_input_logprobs(item, ids, 0, full_logprobs(ids))
