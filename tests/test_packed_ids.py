"""PackedIds (rendering/requests.py): the ids worker processes send back as one buffer
(scoring/preparing.py ``packed``) read exactly as the list they were made from, go out on the
wire as the same JSON text, and score the same numbers through SGLang's and vLLM's paths
against the reference server and in process; and the default choice of worker processes
against a server."""

from __future__ import annotations

import asyncio
import pickle
from array import array
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from _hypothesis import session_settings
from hypothesis import given
from hypothesis import strategies as st

from hcapo_store.devkit.refserver import make_server
from hcapo_store.rendering.requests import GroupPrompt, IdsPrefix, PackedIds, PromptFailure, StepPrompt
from hcapo_store.scoring import defaults, preparing
from hcapo_store.scoring.backends.http import _DUMPS_OPTIONS, wire_ids
from hcapo_store.scoring.backends.inprocess import InProcessBackend
from hcapo_store.scoring.backends.sglang import SGLangBackend, build_payload
from hcapo_store.scoring.backends.vllm import VLLMBackend

IDS = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=300)
INDEX = st.integers(min_value=-310, max_value=310)
SLICE = st.builds(slice, st.none() | INDEX, st.none() | INDEX, st.none() | st.integers(1, 7) | st.integers(-7, -1))


@given(ids=IDS, index=INDEX, part=SLICE)
@session_settings(300)
def test_packed_ids_read_as_their_list(ids: list[int], index: int, part: slice) -> None:
    packed = PackedIds.of(ids)
    assert isinstance(packed, PackedIds)
    assert len(packed) == len(ids) and list(packed) == ids and bool(packed) == bool(ids)
    if -len(ids) <= index < len(ids):
        assert packed[index] == ids[index]
    else:
        with pytest.raises(IndexError):
            packed[index]
    assert packed[part] == ids[part] and type(packed[part]) is list
    assert packed == ids and ids == packed and not (packed != ids)
    assert pickle.loads(pickle.dumps(packed, protocol=5)) == packed
    assert orjson.dumps(wire_ids(packed), option=_DUMPS_OPTIONS) == orjson.dumps(ids)
    if ids:
        other = [*ids[:-1], ids[-1] ^ 1]
        assert packed != other and other != packed and packed != PackedIds.of(other)
        assert packed != ids[:-1] and packed == IdsPrefix([*ids, 7], len(ids)) == packed


@given(ids=st.lists(st.integers(min_value=-(2**33), max_value=2**33) | st.booleans(), max_size=40))
@session_settings(300)
def test_packing_equals_arrays_own_constructor(ids: list[int]) -> None:
    """``PackedIds.of`` packs through struct: the plain rule is ``array("i", ids)``."""
    try:
        rule: array | None = array("i", ids)
    except OverflowError:
        rule = None
    packed = PackedIds.of(ids)
    if rule is None:
        assert packed is ids
    else:
        assert isinstance(packed, PackedIds) and packed.as_array == rule and packed.as_array.tobytes() == rule.tobytes()


def test_ids_beyond_32_bits_stay_a_list() -> None:
    ids = [1, 2**31, 3]
    assert PackedIds.of(ids) is ids
    assert PackedIds.of([2**31 - 1]) == [2**31 - 1] and PackedIds.of([-(2**31)]) == [-(2**31)]


def _step(ids: list[int], first: int, index: int = 0) -> StepPrompt:
    return StepPrompt(index, ids, first, len(ids) - first, 0, 0, False, routing_key="ep")


def test_packed_requests_equal_the_lists_and_keep_windows_and_failures() -> None:
    window = list(range(10, 40))
    requests = [
        GroupPrompt((_step(list(range(5, 20)), 12), _step(list(range(5, 25)), 20, 1))),
        PromptFailure(2, "template", "refused"),
        GroupPrompt((StepPrompt(3, IdsPrefix(window, 30), 25, 5, 0, 0, False),)),
    ]
    sent = preparing.packed(requests)
    assert sent == requests
    assert all(type(m.input_ids) is PackedIds for m in sent[0].members)  # type: ignore[union-attr]
    assert sent[1] is requests[1] and sent[2].members[0] is requests[2].members[0]  # type: ignore[union-attr]
    assert pickle.loads(pickle.dumps(sent)) == requests


def test_the_sglang_payload_is_the_same_text() -> None:
    ids = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198, 13048, 0, 151645]
    as_list, as_packed = (build_payload(_step(x, 9)) for x in (ids, PackedIds.of(ids)))
    as_packed["rid"] = as_list["rid"]  # fresh per attempt
    assert orjson.dumps(as_packed, option=_DUMPS_OPTIONS) == orjson.dumps(as_list)


def test_packed_prompts_score_the_lists_numbers_through_sglang_vllm_and_in_process(
    tiny_model_dir: Path, chat_ids
) -> None:
    ids = list(chat_ids)
    prompts = [_step(ids, len(ids) - 4), _step(ids[:-3], 5, 1)]

    async def scores(backend) -> list[tuple[list[float], int | None]]:
        await backend.start()
        try:
            out = []
            for prompt in prompts:
                for input_ids in (list(prompt.input_ids), PackedIds.of(list(prompt.input_ids))):
                    got = await backend.score(replace(prompt, input_ids=input_ids))
                    out.append((got.logprobs, got.prompt_tokens))
            return out
        finally:
            await backend.close()

    with make_server(tiny_model_dir) as server:
        # in process: a worker's PackedIds become the model's tensor through their buffer
        for backend in (SGLangBackend(server.url), VLLMBackend(server.url), InProcessBackend(tiny_model_dir)):
            got = asyncio.run(scores(backend))
            for a, b in zip(got[0::2], got[1::2]):
                assert a == b and len(a[0]) > 0, backend.kind  # the same floats, bit for bit


def test_against_a_server_a_large_run_prepares_in_processes_by_default() -> None:
    backend = SGLangBackend("http://127.0.0.1:9")  # never started: a server's backend
    big = defaults.PREPARE_PROCESSES_FROM_STEPS
    assert preparing.default_prepare_workers(backend, big - 1, cpus=2) == 0
    assert preparing.default_prepare_workers(backend, big, cpus=2) == defaults.PREPARE_PROCESSES
    assert preparing.default_prepare_workers(backend, big, cpus=1) == 0  # one CPU: processes would only queue
    assert preparing.usable_cpus() >= 1
