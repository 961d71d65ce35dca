"""Grouped requests: exactness checked per step on the ids, and grouped == per-step values on
the reference server (SGLang and vLLM protocols) and the in-process backend, with the demo
tokenizer and with the real Qwen2.5 (prefix-stable) and Qwen3 (not prefix-stable) tokenizers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _tokenizers import SHARED_TOKENIZERS, episode, real_tokenizer
from faultserver import stored_scores

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.devkit.tiny_model import build_tiny_model
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.prompts import PromptBuilder, hindsight_text
from hcapo_store.rendering.requests import GroupPrompt, PromptFailure, StepPrompt
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.scoring.backends.inprocess import InProcessBackend
from hcapo_store.scoring.backends.sglang import SGLangBackend
from hcapo_store.scoring.backends.vllm import VLLMBackend
from hcapo_store.scoring.grouping import group_prompts
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.scoring.scorer import scorer_label
from hcapo_store.storage.store import Store

TOL = 1e-5


def _prompts(tokenizer: Any, seed: int, *, max_context: int = 1 << 20, **kw: Any) -> list[StepPrompt]:
    messages, outcome, steps = episode(seed, **kw)
    built = PromptBuilder(tokenizer, max_context=max_context).build_episode(messages, outcome, steps)
    # Qwen3 fails some steps with `alignment` (its template rewrites the last turn): they are
    # not scored at all, grouped or not.
    return [p for p in built if isinstance(p, StepPrompt)]


def _hindsight_keys(seed: int, **kw: Any) -> list[str]:
    messages, outcome, steps = episode(seed, **kw)
    return [hindsight_text(outcome, s) for s in steps]


def _assert_exact(groups: list[GroupPrompt | PromptFailure]) -> list[GroupPrompt]:
    """Every member's ids equal the request's ids up to its end; spans are disjoint, in order."""
    out = []
    for g in groups:
        assert isinstance(g, GroupPrompt)
        for m in g.members:
            assert g.input_ids[: len(m.input_ids)] == m.input_ids
        ends = [0] + [end for _, end in g.spans]
        assert all(ends[i] <= start < end for i, (start, end) in enumerate(g.spans))
        out.append(g)
    return out


# --- exactness, on the ids -------------------------------------------------------------------


def _demo_tokenizer(demo_tokenizer_dir: Path) -> Any:
    return load_tokenizer(demo_tokenizer_dir)


@pytest.mark.parametrize("name", ["demo", "qwen2.5"])
def test_prefix_stable_templates_group_each_subtask(name, demo_tokenizer_dir):
    tokenizer = _demo_tokenizer(demo_tokenizer_dir) if name == "demo" else real_tokenizer(name)
    prompts = _prompts(tokenizer, 3, steps=16)
    groups = _assert_exact(group_prompts(prompts))
    keys = [_hindsight_keys(3, steps=16)[p.step_index] for p in prompts]
    # One request per run of steps with the same hindsight block, exactly.
    runs = 1 + sum(a != b for a, b in zip(keys, keys[1:]))
    assert len(groups) == runs < len(prompts)
    assert [m.step_index for g in groups for m in g.members] == [p.step_index for p in prompts]
    per_step = _assert_exact(group_prompts(prompts, grouping="per-step"))
    assert [len(g.members) for g in per_step] == [1] * len(prompts)


def test_qwen3_splits_where_the_template_rewrites_history():
    tokenizer = real_tokenizer("qwen3")
    prompts = _prompts(tokenizer, 3, steps=16)
    groups = _assert_exact(group_prompts(prompts))
    keys = _hindsight_keys(3, steps=16)
    kept = [keys[p.step_index] for p in prompts]
    runs = 1 + sum(a != b for a, b in zip(kept, kept[1:]))
    # Qwen3 drops the reasoning of assistant turns before the last user turn: a step after
    # a user turn does not extend the previous step's ids, so the group splits there.
    assert len(groups) > runs
    previous = {b.step_index: a for a, b in zip(prompts, prompts[1:])}
    split = [g.members[0] for g in groups[1:]]
    same_block = [p for p in split if keys[p.step_index] == keys[previous[p.step_index].step_index]]
    assert same_block
    for p in same_block:
        before = previous[p.step_index]
        assert p.input_ids[: len(before.input_ids)] != before.input_ids  # the split was needed


def test_truncated_steps_go_alone_and_groups_respect_max_tokens(demo_tokenizer_dir):
    tokenizer = _demo_tokenizer(demo_tokenizer_dir)
    full = _prompts(tokenizer, 5, steps=16)
    limit = sorted(len(p.input_ids) for p in full)[len(full) // 2]
    prompts = _prompts(tokenizer, 5, steps=16, max_context=limit)
    assert any(p.truncated_prefix_tokens for p in prompts)
    groups = _assert_exact(group_prompts(prompts))
    for g in groups:
        assert len(g.input_ids) <= limit
        if any(m.truncated_prefix_tokens for m in g.members):
            assert len(g.members) == 1
    assert any(len(g.members) > 1 for g in groups)
    # A smaller request budget than the prompts' own splits the groups further.
    small = max(len(p.input_ids) for p in prompts if not p.truncated_prefix_tokens) - 1
    capped = _assert_exact(group_prompts(prompts, max_tokens=small))
    assert len(capped) > len(groups)
    assert all(len(g.input_ids) <= small or len(g.members) == 1 for g in capped)


# --- grouped == per-step, on real backends ---------------------------------------------------


async def _compare(backend: Any, groups: list[GroupPrompt]) -> int:
    """Score every multi-step group in one request and each member alone; returns how many
    steps were compared."""
    compared = 0
    for g in groups:
        if len(g.members) < 2:
            continue
        together = await backend.score_group(g)
        assert len(together) == len(g.members)
        for member, grouped in zip(g.members, together):
            alone = await backend.score(member)
            assert len(grouped.logprobs) == len(alone.logprobs) == member.scored_tokens
            np.testing.assert_allclose(grouped.logprobs, alone.logprobs, atol=TOL, rtol=0)
            compared += 1
    return compared


async def _compare_all(
    ref: ReferenceServer, model_dir: Path, groups: list[GroupPrompt], vllm_groups: int | None = None
) -> None:
    """``vllm_groups``: the vLLM backend on the first N multi-step groups only. vLLM's
    ``prompt_logprobs`` score every position of a prompt, with its rank: over a 152k vocabulary
    the reference server spends ~2 s a request on that, the other backends ~0.1 s."""
    backends = [SGLangBackend(ref.url), VLLMBackend(ref.url), InProcessBackend(model_dir)]
    multi = [g for g in groups if len(g.members) > 1]
    for backend in backends:
        await backend.start()
        try:
            before = ref.requests
            some = multi[:vllm_groups] if backend.kind == "vllm" and vllm_groups is not None else groups
            compared = await _compare(backend, some)
            assert compared >= (3 if some is not groups else 4), backend.kind
            if backend.kind != "transformers":  # one request per group, one per member
                assert ref.requests - before == compared + sum(len(g.members) > 1 for g in some)
        finally:
            await backend.close()


@pytest.fixture(scope="module")
def demo_ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


def test_grouped_equals_per_step_demo_tokenizer(demo_ref, tiny_model_dir):
    groups = _assert_exact(group_prompts(_prompts(load_tokenizer(tiny_model_dir), 11, steps=12)))
    asyncio.run(_compare_all(demo_ref, tiny_model_dir, groups))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_grouped_equals_per_step_qwen_tokenizers(name, tmp_path_factory):
    if not (SHARED_TOKENIZERS / name).is_dir():
        pytest.skip(f"real tokenizer directory {SHARED_TOKENIZERS / name} is absent")
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp(name) / "model",
        SHARED_TOKENIZERS / name,
        layers=1,
        hidden=32,
        heads=2,
        kv_heads=1,
        intermediate=64,
    )
    groups = _assert_exact(group_prompts(_prompts(load_tokenizer(model_dir), 4, steps=8, tool_chars=120)))
    with make_server(model_dir) as ref:
        asyncio.run(_compare_all(ref, model_dir, groups, vllm_groups=1))


# --- end to end: the runner stores the same values either way --------------------------------


@pytest.mark.parametrize("backend", ["sglang", "transformers"])
def test_runs_grouped_and_per_step_store_the_same_scores(tmp_path, demo_ref, tiny_model_dir, backend):
    write_standard_episodes(tmp_path / "eps", 2, seed=5, steps_per_subtask=2, output_words=20)
    cfg = ScoreConfig(
        backend=backend,
        server=demo_ref.url if backend == "sglang" else None,
        model=None if backend == "sglang" else str(tiny_model_dir),
        tokenizer=str(tiny_model_dir),
        max_context=2048,
    )
    results, requests = {}, {}
    for grouping in ("per-step", "grouped"):
        store = Store.open(str(tmp_path / f"{grouping}.db"))
        ingest(store, [tmp_path / "eps"])
        prep = prepare(store, cfg)
        before = demo_ref.requests
        report = run_scoring(store, prep, RunOptions(concurrency=2, grouping=grouping))
        assert report.failed == 0 and report.scored == store.query("SELECT COUNT(*) FROM steps")[1][0][0]
        requests[grouping] = demo_ref.requests - before
        results[grouping] = (prep.scorer_id, stored_scores(store, prep.scorer_id), _columns(store))
        store.close()
    (sid_a, a, cols_a), (sid_b, b, cols_b) = results["per-step"], results["grouped"]
    assert sid_a == sid_b  # grouping is not part of the scorer identity
    assert cols_a == cols_b  # same ids, spans and truncation per step
    assert a.keys() == b.keys()
    for key, (mean, blob, n) in a.items():
        assert b[key][2] == n
        np.testing.assert_allclose(np.frombuffer(b[key][1], "<f4"), np.frombuffer(blob, "<f4"), atol=TOL, rtol=0)
        assert b[key][0] == pytest.approx(mean, abs=TOL)
    if backend == "sglang":
        assert requests["per-step"] == len(a) > requests["grouped"] > 0


def _columns(store: Store) -> dict[tuple[str, int], tuple]:
    rows = store.query(
        "SELECT e.name, st.step_index, s.token_count, s.total_action_tokens, s.skipped_action_tokens, "
        "s.truncated_prefix_tokens, s.input_tokens, s.logprob_start_len, s.flattened FROM scores s "
        "JOIN steps st ON st.id = s.step_id JOIN episodes e ON e.id = st.episode_id"
    )[1]
    return {(r[0], r[1]): tuple(r[2:]) for r in rows}


# --- --truncation window ---------------------------------------------------------------------


def test_window_truncation_shares_a_start_and_keeps_half_the_tail(demo_tokenizer_dir):
    tokenizer = _demo_tokenizer(demo_tokenizer_dir)
    messages, outcome, steps = episode(8, steps=80, extra_user_turns=False)
    ctx = 4000
    sliding = PromptBuilder(tokenizer, max_context=ctx).build_episode(messages, outcome, steps)
    window = PromptBuilder(tokenizer, max_context=ctx, truncation="window").build_episode(messages, outcome, steps)
    anchor_builder = PromptBuilder(tokenizer, max_context=ctx)
    truncated = 0
    for s, w in zip(sliding, window):
        assert isinstance(s, StepPrompt) and isinstance(w, StepPrompt)
        assert len(w.input_ids) <= ctx and w.total_action_tokens == s.total_action_tokens
        assert w.input_ids[w.first_scored :] == s.input_ids[s.first_scored :]  # the same action tokens
        if not s.truncated_prefix_tokens:
            assert w == s  # untruncated steps are untouched
            continue
        truncated += 1
        # Same anchor + marker head; the window keeps a tail of at least half the sliding one.
        head = _head_len(s, anchor_builder)
        assert head == _head_len(w, anchor_builder) and w.input_ids[:head] == s.input_ids[:head]
        assert w.truncated_prefix_tokens >= s.truncated_prefix_tokens
        assert _tail_len(w, anchor_builder) >= _tail_len(s, anchor_builder) / 2
    assert truncated >= 10
    sliding_groups = _assert_exact(group_prompts(sliding))
    window_groups = _assert_exact(group_prompts(window))
    # Truncated steps go alone under sliding truncation; under window they share requests.
    assert all(len(g.members) == 1 for g in sliding_groups if g.members[0].truncated_prefix_tokens)
    assert any(len(g.members) > 1 for g in window_groups if g.members[0].truncated_prefix_tokens)
    assert len(window_groups) < len(sliding_groups)
    assert sum(len(g.input_ids) for g in window_groups) < sum(len(g.input_ids) for g in sliding_groups) / 2


def _tail_len(prompt: StepPrompt, builder: PromptBuilder) -> int:
    """Prefix tokens kept after the anchor and the marker."""
    return len(prompt.input_ids) - prompt.total_action_tokens - _head_len(prompt, builder)


def _head_len(prompt: StepPrompt, builder: PromptBuilder) -> int:
    marker = builder._marker_ids
    ids = prompt.input_ids
    for i in range(len(ids) - len(marker) + 1):
        if ids[i : i + len(marker)] == marker:
            return i + len(marker)
    raise AssertionError("no truncation marker in a truncated prompt")


def test_window_truncation_is_another_scorer_and_scores_like_per_step(tmp_path, demo_ref, tiny_model_dir):
    write_standard_episodes(tmp_path / "eps", 1, seed=9, steps_per_subtask=3, output_words=30)
    results = {}
    for grouping in ("per-step", "grouped"):
        store = Store.open(str(tmp_path / f"{grouping}.db"))
        ingest(store, [tmp_path / "eps"])
        sliding = prepare(
            store, ScoreConfig(backend="sglang", server=demo_ref.url, tokenizer=str(tiny_model_dir), max_context=1024)
        )
        window = prepare(
            store,
            ScoreConfig(
                backend="sglang",
                server=demo_ref.url,
                tokenizer=str(tiny_model_dir),
                max_context=1024,
                truncation="window",
            ),
        )
        assert "truncation" not in sliding.spec and window.spec["truncation"] == "window"
        # prepare() writes nothing; the label is what run_scoring() registers
        assert window.scorer_id != sliding.scorer_id and "trunc=window" in scorer_label(window.spec)
        before = demo_ref.requests
        assert run_scoring(store, window, RunOptions(concurrency=1, grouping=grouping)).failed == 0
        results[grouping] = (demo_ref.requests - before, stored_scores(store, window.scorer_id), _columns(store))
        store.close()
    (n_a, a, cols_a), (n_b, b, cols_b) = results["per-step"], results["grouped"]
    assert cols_a == cols_b and any(c[3] for c in cols_a.values())  # some steps were truncated
    assert n_b < n_a == len(a)
    for key, (_mean, blob, _n) in a.items():
        np.testing.assert_allclose(np.frombuffer(b[key][1], "<f4"), np.frombuffer(blob, "<f4"), atol=TOL, rtol=0)


def test_in_process_group_runs_the_lm_head_on_the_spans_only_in_chunks(tiny_model_dir):
    from hcapo_store.scoring.forward import LogprobModel

    model = LogprobModel(tiny_model_dir, chunk_size=7)
    rows: list[int] = []
    head = model._target_logprobs  # the LM head and its logsumexp, on the rows it is given
    model._target_logprobs = lambda hidden, targets: (rows.append(hidden.shape[0]), head(hidden, targets))[1]  # type: ignore[method-assign]
    ids = [(i * 37) % 1800 + 3 for i in range(300)]
    spans = [(40, 52), (120, 121), (200, 230), (290, 300)]
    values = model.score_spans(ids, spans)
    assert sum(rows) == sum(e - s for s, e in spans) and max(rows) <= 7  # never a row outside a span
    for (start, end), got in zip(spans, values):
        np.testing.assert_allclose(got, model.score(ids[:end], start), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="span"):
        model.score_spans(ids, [(290, 301)])
