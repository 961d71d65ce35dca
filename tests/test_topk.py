"""``score --top-k K`` (in-process) against torch.topk of the tiny model's own log-softmax, the
compact storage, and the two exports (docs/FAMILY.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_log_ratio import _episodes

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.params import CreditParams
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.job import ScoreConfig, prepare
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store
from hcapo_store.storage.topk import TopK

K = 5


def test_in_process_top_k_is_torch_topk_of_the_log_softmax(tmp_path, tiny_model_dir, demo_tokenizer_dir, runner):
    from transformers import AutoModelForCausalLM

    db_ = str(tmp_path / "s.db")
    store = Store.open(db_)
    assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=2)]).failed == 0
    argv = ["--db", db_, "score", "--backend", "transformers", "--model", str(tiny_model_dir)]
    r = runner.invoke(cli, [*argv, "--action-span", "policy", "--top-k", str(K), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["scored"] == 6 and out["top_k"] == {"k": K, "stored": 6, "failed": 0, "failures": {}}
    prep = prepare(store, ScoreConfig(backend="transformers", model=str(tiny_model_dir), action_span="policy", top_k=K))
    stored = store.query(
        "SELECT s.episode_id, s.step_index, t.k, t.token_count, t.ids, t.logprobs FROM topk_scores t "
        "JOIN steps s ON s.id = t.step_id WHERE t.scorer_id = :s",
        {"s": prep.scorer_id},
    )[1]
    assert len(stored) == 6
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    by_step = {(e, i): TopK.decode(ids, lps, n, k) for e, i, k, n, ids, lps in stored}
    with db.read(store.engine) as conn:
        episodes = {e for e, _ in by_step}
        for ep in episodes:
            episode = load_episode(conn, ep)
            for prompt in prep.builder.build_episode(episode.messages, episode.outcome, episode.steps):
                ids = torch.tensor([list(prompt.input_ids)])
                with torch.inference_mode():
                    logp = model(ids).logits[0].float().log_softmax(-1)
                rows = logp[prompt.first_scored - 1 : len(prompt.input_ids) - 1]
                values, indices = torch.topk(rows, K, dim=-1)
                got = by_step[(ep, prompt.step_index)]
                assert got.token_count == len(rows) and got.k == K
                assert np.array_equal(got.ids, indices.numpy())
                assert got.logprobs == pytest.approx(values.numpy(), abs=2e-3, rel=1e-3)  # float16
    # compact: ids int32 + logprobs float16 = 6 bytes per entry
    sizes = store.query("SELECT SUM(LENGTH(ids) + LENGTH(logprobs)), SUM(token_count) FROM topk_scores")[1][0]
    assert sizes[0] == sizes[1] * K * 6
    # again: nothing left to do, nothing doubled
    r = runner.invoke(cli, [*argv, "--action-span", "policy", "--top-k", str(K), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["top_k"]["stored"] == 0
    # export scores --top-k: the same values as Parquet lists
    import pyarrow.parquet as pq

    r = runner.invoke(
        cli, ["--db", db_, "export", "scores", str(tmp_path / "topk.parquet"), "--scorer", prep.scorer_id, "--top-k"]
    )
    assert r.exit_code == 0, r.output
    table = pq.read_table(tmp_path / "topk.parquet").to_pylist()
    assert len(table) == 6
    for row in table:
        top = by_step[(row["episode_id"], row["step_index"])]
        assert np.array_equal(np.asarray(row["topk_token_ids"]), top.ids)
        assert np.asarray(row["topk_logprobs"]) == pytest.approx(top.logprobs)
    # export dataset --tokenized --top-k: aligned to token_ids, None outside the steps' tokens
    compute_credits(store, CreditParams(variant="paper"), name="r", scorer=prep.scorer_id)  # every episode kept
    r = runner.invoke(
        cli,
        ["--db", db_, "export", "dataset", str(tmp_path / "tok.jsonl"), "--credits", "r", "--tokenized"]
        + ["--tokenizer", str(tiny_model_dir), "--top-k", "--json"],
    )
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "tok.jsonl").read_text().splitlines()]
    assert rows
    ep_of = dict(store.query("SELECT name, id FROM episodes")[1])
    placed = 0
    for row in rows:
        n = len(row["token_ids"])
        assert len(row["topk_token_ids"]) == len(row["topk_logprobs"]) == len(row["actual_logprobs"]) == n
        inside = set()
        for index, (a, b) in zip(row["step_indices"], row["step_spans"]):
            top = by_step[(ep_of[row["episode"]], index)]
            assert row["topk_token_ids"][a:b] == top.ids.tolist()
            # the actual token's logprob is at most the top-1's, and the top-1 row starts each list
            assert all(lp <= t[0] + 1e-2 for lp, t in zip(row["actual_logprobs"][a:b], row["topk_logprobs"][a:b]))
            inside.update(range(a, b))
            placed += 1
        assert all(row["topk_token_ids"][i] is None for i in range(n) if i not in inside)
    assert placed >= 4
    r = runner.invoke(cli, ["--db", db_, "export", "dataset", str(tmp_path / "x.jsonl"), "--top-k"])
    assert r.exit_code != 0 and "--top-k goes with --tokenized" in r.output


def test_vllm_top_k_equals_the_in_process_one_and_the_cap_is_refused_up_front(tmp_path, tiny_model_dir, runner):
    """The reference server speaks vLLM's /v1/completions (prompt_logprobs K, ranks) and caps K at
    its --max-logprobs (20, vLLM's default) with vLLM's own error."""
    from hcapo_store.devkit.refserver import make_server

    db_ = str(tmp_path / "s.db")
    store = Store.open(db_)
    assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=1)]).failed == 0
    with make_server(tiny_model_dir) as server:
        server.start()
        argv = ["--db", db_, "score", "--backend", "vllm", "--server", server.url, "--tokenizer", str(tiny_model_dir)]
        r = runner.invoke(cli, [*argv, "--top-k", "21"])
        assert r.exit_code != 0
        assert "--top-k 21 is above the vLLM server's --max-logprobs 20" in r.output
        assert store.query("SELECT COUNT(*) FROM scores")[1][0][0] == 0  # refused before anything was scored
        r = runner.invoke(cli, [*argv, "--top-k", str(K), "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["top_k"]["stored"] == 3
    _assert_served_top_k_is_the_in_process_one(store, tiny_model_dir)


def test_sglang_top_k_equals_the_in_process_one(tmp_path, tiny_model_dir, runner):
    """The reference server's /generate answers top_logprobs_num as SGLang does (input_top_logprobs)."""
    from hcapo_store.devkit.refserver import make_server

    db_ = str(tmp_path / "s.db")
    store = Store.open(db_)
    assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=1)]).failed == 0
    with make_server(tiny_model_dir) as server:
        server.start()
        argv = ["--db", db_, "score", "--server", server.url, "--tokenizer", str(tiny_model_dir)]
        r = runner.invoke(cli, [*argv, "--top-k", str(K), "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["top_k"] == {"k": K, "stored": 3, "failed": 0, "failures": {}}
    _assert_served_top_k_is_the_in_process_one(store, tiny_model_dir)


def test_top_k_out_of_range_is_refused_up_front(tmp_path, runner):
    db_ = str(tmp_path / "s.db")
    r = runner.invoke(cli, ["--db", db_, "score", "--backend", "transformers", "--model", "x", "--top-k", "5000"])
    assert r.exit_code != 0 and "--top-k must be in [1, 1024]" in r.output
    # (the episode layout takes --top-k: tests/test_topk_one_request.py)
    assert not Path(db_).exists()  # refused before the store was created


def test_topk_round_trip_and_size():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 151_000, size=(7, 20), dtype=np.int32)
    lps = np.sort(rng.uniform(-20, 0, size=(7, 20)).astype(np.float32), axis=1)[:, ::-1]
    blob_ids, blob_lps = TopK(ids, lps).encode()
    assert len(blob_ids) + len(blob_lps) == 7 * 20 * 6  # 120 bytes per token at K = 20
    back = TopK.decode(blob_ids, blob_lps, 7, 20)
    assert np.array_equal(back.ids, ids)
    assert back.logprobs == pytest.approx(lps, abs=1e-2)


def _assert_served_top_k_is_the_in_process_one(store: Store, tiny_model_dir: Path) -> None:
    """Episode 1's stored top-K (from a server) equals the in-process scorer's own, step by step:
    the same token ids in the same order, the same logprobs within float16's storage."""
    prep = prepare(store, ScoreConfig(backend="transformers", model=str(tiny_model_dir), top_k=K))
    with db.read(store.engine) as conn:
        episode = load_episode(conn, 1)
    served = {
        i: TopK.decode(ids, lps, n, k)
        for i, k, n, ids, lps in store.query(
            "SELECT s.step_index, t.k, t.token_count, t.ids, t.logprobs FROM topk_scores t JOIN steps s ON s.id = t.step_id"
        )[1]
    }
    prompts = list(prep.builder.build_episode(episode.messages, episode.outcome, episode.steps))
    assert prompts and set(served) == {p.step_index for p in prompts}
    for prompt in prompts:
        own = prep.backend.scorer.score_positions(prompt.input_ids, prompt.first_scored, top_k=K).top
        assert served[prompt.step_index].ids.tolist() == [[t for t, _ in row] for row in own]
        assert served[prompt.step_index].logprobs == pytest.approx(
            np.asarray([[v for _, v in row] for row in own]), abs=2e-3, rel=1e-3
        )
