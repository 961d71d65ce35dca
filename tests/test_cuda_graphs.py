"""The CUDA-graph strategy of the in-process forward (scoring/graphs.py), on the CPU: what a graph
replays is the padded forward with the causal masks given (no mask built on the host), and that
must equal the plain rule, each request alone and unpadded with the model's own mask; a
disagreement turns the strategy off and is counted as every fast path's fallback. The capture
itself needs a GPU: bench/gpu.py runs it there, every replay shape checked by the same code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hcapo_store.rendering import verify
from hcapo_store.scoring import graphs
from hcapo_store.scoring.forward import InFlight, LogprobModel, _fill

TOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LogprobModel:
    return LogprobModel(tiny_model_dir, chunk_size=64)


@given(st.integers(1, 1 << 20))
def test_a_bucket_holds_its_length_with_little_padding(n: int) -> None:
    width = graphs.bucket(n)
    assert n <= width <= max(n + graphs.WIDTH_FLOOR - 1, int(n * (1 + 1 / graphs.WIDTH_PARTS)) + 1)
    assert graphs.bucket(width) == width  # a bucket is its own bucket
    assert graphs.bucket(n + 1) >= width  # and they grow with the length


def test_which_models_can_be_graphed(model: LogprobModel) -> None:
    assert graphs.why_not(model.model) is None  # SDPA, every layer full attention
    config = model.model.config
    kept = (config._attn_implementation, list(config.layer_types))
    try:
        config._attn_implementation = "eager"
        assert "not 'sdpa'" in (graphs.why_not(model.model) or "")
        config._attn_implementation = "sdpa"
        config.layer_types = ["sliding_attention"] * len(config.layer_types)
        assert "full causal attention" in (graphs.why_not(model.model) or "")
    finally:
        config._attn_implementation, config.layer_types = kept[0], kept[1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_graphed_forward_equals_the_plain_rule(
    model: LogprobModel, chat_ids: list[int], data: st.DataObject
) -> None:
    """What a graph of the shape replays (right-padded to the buckets, the causal masks given, the
    rows padded with row 0) scores each request as the plain forward does alone: unpadded, the
    model's own mask; and so does a larger shape's graph that replays it (graphs.larger_graph:
    padded up to the borrowing bounds)."""
    count = data.draw(st.integers(1, 3), label="sequences")
    requests = []
    for _ in range(count):
        length = data.draw(st.integers(2, len(chat_ids)), label="length")
        starts = data.draw(st.lists(st.integers(1, length), min_size=1, max_size=3), label="span starts")
        spans = [(s, data.draw(st.integers(s, length), label="end")) for s in sorted(starts)]
        requests.append((chat_ids[:length], spans))
    prepared = [model.prepare(ids, spans) for ids, spans in requests]
    width = max(r.length for r in prepared)
    scored = sum(len(r.rows) for r in prepared)
    key = graphs.shape_key(len(prepared), width, scored, model.chunk_size)
    wider = data.draw(st.integers(0, key[1] // graphs.BORROW_WIDTH_PARTS), label="a larger graph's extra width")
    more = data.draw(st.integers(0, max(graphs.ROWS_FLOOR, key[2] // graphs.BORROW_ROWS_PARTS)), label="extra rows")
    tokens = torch.full((key[0], key[1] + wider), 7, dtype=torch.long)  # stale values: _fill must clear them
    rows = torch.full((key[2] + more,), 5, dtype=torch.long)
    _fill(tokens, rows, prepared)
    with torch.inference_mode():
        got = model._picks(tokens, rows, graphs.causal_masks(model.model))[:scored].tolist()
    want = [v for ids, spans in requests for span in model.score_spans(ids, spans) for v in span]
    assert got == pytest.approx(want, abs=TOL)


def test_a_shape_without_its_own_graph_replays_the_smallest_that_holds_it() -> None:
    captured = {(2, 9216, 8192, 512): 1, (2, 9280, 8192, 512): 2, (2, 9216, 8704, 512): 3, (1, 9216, 4096, 512): 4}
    assert graphs.larger_graph(captured, (2, 9152, 7680, 512)) == (2, 9216, 8192, 512)
    assert graphs.larger_graph(captured, (2, 9216, 8192, 512)) == (2, 9216, 8192, 512)  # its own, when there
    assert graphs.larger_graph(captured, (2, 9216, 8448, 512)) == (2, 9216, 8704, 512)  # more rows than 8192
    assert graphs.larger_graph(captured, (1, 9152, 4000, 512)) == (1, 9216, 4096, 512)
    assert graphs.larger_graph(captured, (3, 9152, 7680, 512)) is None  # as many sequences, no fewer
    assert graphs.larger_graph(captured, (2, 9152, 7680, 256)) is None  # the same LM-head chunk
    assert graphs.larger_graph(captured, (2, 8192, 7680, 512)) is None  # 9216 is 12.5 % wider: too much padding
    assert graphs.larger_graph(captured, (2, 9152, 4096, 512)) is None  # twice the rows
    assert graphs.larger_graph(captured, (2, 9344, 7680, 512)) is None  # none is wide enough
    assert graphs.larger_graph({}, (2, 9152, 7680, 512)) is None


@given(
    st.sets(
        st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.sampled_from([256, 512])), max_size=12
    ),
    st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.sampled_from([256, 512])),
)
def test_the_graph_borrowed_holds_the_forward_within_the_bounds_and_is_the_smallest(
    captured: set[tuple[int, int, int, int]], key: tuple[int, int, int, int]
) -> None:
    scale = lambda k: (k[0], k[1] * 64, k[2] * 64, k[3])  # noqa: E731 - widths and rows on a 64-token grid
    keys = {scale(k) for k in captured}
    want = scale(key)
    fits = [
        k
        for k in keys
        if k[0] == want[0]
        and k[3] == want[3]
        and want[1] <= k[1] <= want[1] * (1 + 1 / graphs.BORROW_WIDTH_PARTS)
        and want[2] <= k[2] <= want[2] + max(graphs.ROWS_FLOOR, want[2] / graphs.BORROW_ROWS_PARTS)
    ]
    got = graphs.larger_graph(keys, want)
    assert got == (min(fits, key=lambda k: (k[1], k[2])) if fits else None)


@pytest.fixture
def graphs_state(monkeypatch: pytest.MonkeyPatch) -> graphs.ModelGraphs:
    """A model's graph state on the CPU (no stream, no pool: nothing is captured), the process's
    off switch fresh for the test."""
    monkeypatch.setattr(graphs, "_OFF", [])
    return graphs.ModelGraphs(torch.device("cpu"), None, None)


def test_a_disagreement_turns_the_graphs_off_and_counts_a_fallback(
    model: LogprobModel, chat_ids: list[int], graphs_state: graphs.ModelGraphs
) -> None:
    request = model.prepare(chat_ids[:20], [(10, 13)])
    values = torch.tensor([-1.0, -2.0, -3.0])
    before = verify.fallbacks()

    agreeing = (torch.tensor(0), torch.tensor(1e-7), torch.tensor(3))
    assert model.finish(InFlight((request,), values, None, agreeing, graphs_state)) == [[[-1.0, -2.0, -3.0]]]
    assert graphs.off() is None and graphs_state.stats.checked == 1

    differing = (torch.tensor(2), torch.tensor(0.5), torch.tensor(3))
    assert model.finish(InFlight((request,), values, None, differing, graphs_state)) == [[[-1.0, -2.0, -3.0]]]
    assert "2 of 3 logprobs differ" in (graphs.off() or "")
    assert graphs_state.stats.max_abs_diff == 0.5
    assert verify.since(before) == {"cuda_graphs": 1}
    assert model._graph_state([request]) is None  # off for the process: every forward runs eager


def test_an_eager_forward_is_launched_then_read(model: LogprobModel, chat_ids: list[int]) -> None:
    """launch/finish (what the model's thread pipelines) give score_spans' values."""
    requests = [model.prepare(chat_ids[:n], [(2, 5), (n - 6, n)]) for n in (40, 33)]
    flights = [model.launch([r]) for r in requests]
    got = [model.finish(f)[0] for f in flights]
    assert got == [model.score_spans(chat_ids[:n], [(2, 5), (n - 6, n)]) for n in (40, 33)]


def test_the_model_thread_launches_the_next_forward_before_reading_the_last(
    tiny_model_dir: Path, chat_ids: list[int]
) -> None:
    """With requests waiting, the queue's thread launches the next forward before it waits for
    the current one's values (so a GPU never idles for it between them); every caller still
    gets its own values."""
    from hcapo_store.scoring.forward import ForwardQueue

    model = LogprobModel(tiny_model_dir, chunk_size=64, pack_tokens=0)
    lengths = [len(chat_ids) - k for k in range(0, 10, 2)]
    expected = [model.score_spans(chat_ids[:n], [(n - 8, n)]) for n in lengths]
    calls: list[str] = []
    launch, finish = model.launch, model.finish
    model.launch = lambda batch: (calls.append("launch"), launch(batch))[1]  # type: ignore[method-assign]
    model.finish = lambda flight: (calls.append("finish"), finish(flight))[1]  # type: ignore[method-assign]
    queue = ForwardQueue(model)
    with model._lock:  # busy: every request waits in the queue until the thread can launch
        futures = [queue.submit(model.prepare(chat_ids[:n], [(n - 8, n)])) for n in lengths]
    results = [f.result(timeout=60) for f in futures]
    queue.close()
    assert results == expected
    assert calls[:3] == ["launch", "launch", "finish"]  # the second launched before the first is read
    assert calls.count("launch") == calls.count("finish") == len(lengths)


class Replayed:
    """Stands in for ``torch.cuda.CUDAGraph`` on the CPU: replaying runs again what was captured,
    on the same static buffers, into the same output (what a CUDA graph's replay does)."""

    def __init__(self, fn: Any, tokens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        self.fn, self.tokens, self.rows, self.out = fn, tokens, rows, out
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.fn(self.tokens, self.rows))


def test_a_forward_without_its_own_graph_replays_a_larger_one(
    model: LogprobModel, chat_ids: list[int], graphs_state: graphs.ModelGraphs
) -> None:
    """The model's forward (``_graphed``) given a captured graph a little wider than its own shape,
    and with more rows: it replays that graph (counted as borrowed), nothing is captured, and the
    values are each request's own, as the plain rule scores it alone."""
    n = len(chat_ids)
    asked = [(chat_ids[: n - 3], [(5, 9), (n - 9, n - 3)]), (chat_ids, [(n - 6, n)])]
    requests = [model.prepare(ids, spans) for ids, spans in asked]
    width, scored = n, sum(len(r.rows) for r in requests)
    key = graphs.shape_key(2, width, scored, model.chunk_size)
    big = (2, key[1] + key[1] // graphs.BORROW_WIDTH_PARTS, key[2] + graphs.ROWS_FLOOR, model.chunk_size)
    assert big[1] > key[1] and graphs.larger_graph([big], key) == big
    masks = graphs.causal_masks(model.model)
    tokens, rows = torch.zeros(big[:2], dtype=torch.long), torch.zeros(big[2], dtype=torch.long)
    with torch.inference_mode():
        out = model._picks(tokens, rows, masks)
        graph = Replayed(lambda t, r: model._picks(t, r, masks), tokens, rows, out)
        graphs_state.graphs[big] = graphs._Graph(graph, tokens, rows, out)
        values, check, how = model._graphed(graphs_state, requests, width)
    assert graph.replays == 1 and graphs_state.stats.borrowed == 1 and graphs_state.stats.captured == 0
    assert how in ("replay", "check") and key not in graphs_state.seen  # never counted toward its own capture
    want = [v for ids, spans in asked for span in model.score_spans(ids, spans) for v in span]
    assert values.tolist() == pytest.approx(want, abs=TOL)
    if check is not None:  # a checked replay: the plain forward on the same buffers agreed
        assert int(check[0]) == 0
