"""``score --top-k K`` sends one request per step (or per episode, in the episode layout): the
logprobs and the top-k come from the same request, the stored logprobs are the ones scored
without ``--top-k``, and the reference server counts the requests. SGLang's ``/generate``,
vLLM's ``/v1/completions`` and the in-process model (one forward per request) alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_log_ratio import _episodes

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store
from hcapo_store.storage.topk import TopK

K = 4


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        server.start()
        yield server


def _stored(store: Store, scorer: str) -> tuple[dict[int, bytes], dict[int, TopK]]:
    scores = dict(store.query("SELECT step_id, token_logprobs FROM scores WHERE scorer_id = :s", {"s": scorer})[1])
    tops = {
        int(step): TopK.decode(ids, lps, n, k)
        for step, k, n, ids, lps in store.query(
            "SELECT step_id, k, token_count, ids, logprobs FROM topk_scores WHERE scorer_id = :s", {"s": scorer}
        )[1]
    }
    return {int(k): bytes(v) for k, v in scores.items()}, tops


def _score(store: Store, cfg: ScoreConfig, counter, grouping: str = "grouped") -> tuple[str, int]:
    """Score every step; the requests (or forwards) it took."""
    prep = prepare(store, cfg)
    before = counter(prep)
    report = run_scoring(store, prep, RunOptions(concurrency=2, grouping=grouping))  # type: ignore[arg-type]
    assert report.failed == 0 and report.retried == 0 and report.scored > 0, (report.summary(), report.first_errors)
    return prep.scorer_id, counter(prep) - before


def _check(store: Store, base: str, top: str, steps: int) -> None:
    plain, none = _stored(store, base)
    with_k, tops = _stored(store, top)
    assert not none and len(plain) == len(with_k) == len(tops) == steps
    for step, blob in plain.items():
        assert with_k[step] == blob  # the same float32 bytes with and without --top-k
        values = np.frombuffer(blob, dtype="<f4")
        top = tops[step]
        assert top.ids.shape == (len(values), K)
        # the sampled token's logprob is at most the top-1's (float16 storage: its rounding)
        assert (values <= top.logprobs[:, 0] + 2e-3).all()
        assert (np.diff(top.logprobs, axis=1) <= 1e-6).all()  # ranked


@pytest.mark.parametrize(
    ("backend", "layout", "grouping"),
    [
        ("sglang", "per-step", "per-step"),
        ("vllm", "per-step", "grouped"),
        ("sglang", "episode", "grouped"),
        ("vllm", "episode", "grouped"),
    ],
)
def test_one_request_per_step_or_episode_and_the_same_logprobs(
    tmp_path: Path, ref: ReferenceServer, tiny_model_dir: Path, backend: str, layout: str, grouping: str
) -> None:
    with Store.open(str(tmp_path / "s.db")) as store:
        assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=2)]).failed == 0
        steps = store.query("SELECT COUNT(*) FROM steps")[1][0][0]
        cfg = ScoreConfig(
            backend=backend, server=ref.url, tokenizer=str(tiny_model_dir), max_context=2048, prompt_layout=layout
        )
        counter = lambda _prep: len(ref.requests_seen)  # noqa: E731  (the requests that ask for logprobs)
        base, sent = _score(store, cfg, counter, grouping)
        cfg.top_k = K
        top, sent_k = _score(store, cfg, counter, grouping)
        # one request per step (per-step grouping), per group of steps sharing a prefix, or per episode
        assert sent_k == sent == (steps if grouping == "per-step" else 2)
        _check(store, base, top, steps)


def test_in_process_one_forward_carries_the_top_k(tmp_path: Path, tiny_model_dir: Path) -> None:
    seen: dict[int, list] = {}

    def forwards(prep) -> int:  # the model's forwards (LogprobModel.timings: one entry per forward)
        if id(prep) not in seen:  # before scoring: the loaded model records its forwards from here
            seen[id(prep)] = prep.backend.scorer.timings = []
        return len(seen[id(prep)])

    with Store.open(str(tmp_path / "s.db")) as store:
        assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=2)]).failed == 0
        steps = store.query("SELECT COUNT(*) FROM steps")[1][0][0]
        cfg = ScoreConfig(backend="transformers", model=str(tiny_model_dir), prompt_layout="episode")
        base, passes = _score(store, cfg, forwards)
        cfg.top_k = K
        top, passes_k = _score(store, cfg, forwards)
        assert passes_k == passes <= 2  # one forward per episode (or fewer, packed), with or without the top-k
        _check(store, base, top, steps)
        # and they are torch.topk of the model's own log-softmax over the episode's rendering
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        prep = prepare(store, cfg)
        _, tops = _stored(store, top)
        step_ids = {
            (int(e), int(i)): int(s) for s, e, i in store.query("SELECT id, episode_id, step_index FROM steps")[1]
        }
        with db.read(store.engine) as conn:
            for ep in {e for e, _ in step_ids}:
                episode = load_episode(conn, ep)
                from hcapo_store.scoring.grouping import plan_requests_and_floor

                requests, _ = plan_requests_and_floor(
                    prep.builder, episode.messages, episode.outcome, episode.steps, episode.steps
                )
                for group in requests:
                    ids = torch.tensor([list(group.input_ids)])
                    with torch.inference_mode():
                        logp = model(ids).logits[0].float().log_softmax(-1)
                    for member, (a, b) in zip(group.members, group.spans):
                        values, indices = torch.topk(logp[a - 1 : b - 1], K, dim=-1)
                        got = tops[step_ids[(ep, member.step_index)]]
                        assert np.array_equal(got.ids, indices.numpy())
                        assert got.logprobs == pytest.approx(values.numpy(), abs=2e-3, rel=1e-3)
