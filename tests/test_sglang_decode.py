"""The flat decoding of /generate answers gives the verdict of decoding them whole, on every shape."""

from __future__ import annotations

import math
import random
from typing import Any

import orjson
import pytest

from hcapo_store.errors import InferenceError
from hcapo_store.rendering.requests import StepPrompt
from hcapo_store.scoring.backends.sglang import FlatEntries, decode_generate, parse_response

IDS = [random.Random(7).randrange(1, 150_000) for _ in range(40)]
PROMPT = StepPrompt(
    step_index=0,
    input_ids=IDS,
    first_scored=25,
    total_action_tokens=15,
    skipped_action_tokens=0,
    truncated_prefix_tokens=0,
    flattened=False,
)
START = PROMPT.first_scored - 1


def _entries() -> list[list[Any]]:
    rng = random.Random(3)
    return [[None, IDS[START], None]] + [[-rng.random() * 4, i, None] for i in IDS[START + 1 :]]


def _body(entries: Any, **meta: Any) -> bytes:
    info = {"id": "x", "prompt_tokens": len(IDS), "cached_tokens": 0, "input_token_logprobs": entries, **meta}
    return orjson.dumps({"text": "", "meta_info": info})


def _verdict(body: bytes, decode) -> Any:
    try:
        return parse_response(PROMPT, decode(body)).logprobs
    except InferenceError as exc:
        return ("error", exc.kind, str(exc))


def _cases() -> dict[str, bytes]:
    good = _entries()
    cases = {"honest": _body(good)}
    cases["with text"] = _body([[lp, i, "tok]]"] for lp, i, _ in good])
    cases["an entry of two"] = _body([*good[:5], good[5][:2], *good[6:]])
    cases["two and four"] = _body([*good[:5], [good[5][0], None], [good[6][0], good[6][1], 0, None], *good[7:]])
    cases["a wrong id"] = _body([*good[:9], [good[9][0], good[9][1] + 1, None], *good[10:]])
    cases["a bool id"] = _body([*good[:9], [good[9][0], True, None], *good[10:]])
    cases["a null logprob"] = _body([*good[:9], [None, good[9][1], None], *good[10:]])
    cases["a positive logprob"] = _body([*good[:9], [0.5, good[9][1], None], *good[10:]])
    cases["an absurd logprob"] = _body([*good[:9], [-1e300, good[9][1], None], *good[10:]])
    cases["one short"] = _body(good[:-1])
    cases["empty"] = _body([])
    cases["not a list"] = _body({"a": 1})
    cases["nested deeper"] = _body([[[-0.1], i, None] for _, i, _ in good])
    cases["key twice"] = orjson.dumps({"meta_info": {"input_token_logprobs": good}, "x": {"input_token_logprobs": []}})
    cases["a list of answers"] = orjson.dumps([orjson.loads(_body(good))])
    cases["key outside meta_info"] = orjson.dumps({"input_token_logprobs": good, "meta_info": {}})
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_flat_decoding_agrees_with_whole_decoding(name):
    body = _cases()[name]
    assert _verdict(body, decode_generate) == _verdict(body, orjson.loads)


def test_an_honest_answer_is_decoded_flat_and_exactly():
    body = _cases()["honest"]
    decoded = decode_generate(body)
    entries = decoded["meta_info"]["input_token_logprobs"]
    assert isinstance(entries, FlatEntries) and len(entries) == len(IDS) - START
    assert entries.as_list() == orjson.loads(body)["meta_info"]["input_token_logprobs"]
    values = parse_response(PROMPT, decoded).logprobs
    assert values == [e[0] for e in _entries()[1:]] and all(math.isfinite(v) for v in values)
