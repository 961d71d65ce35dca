"""Exports: hindsight_scores.json in the original schema, Eq. 8 rows against the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_credits import add_scorer, add_scores, add_synthetic_episodes, read_credits

from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.devkit.original_math import build_hcapo_rows
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.export import export_dataset, export_hindsight_json
from hcapo_store.storage.store import Store

TOP_KEYS = [
    "episode_id",
    "reward",
    "frozen_scores",
    "dense_rewards_used",
    "num_steps",
    "num_subtasks_covered",
    "subtask_reward_range",
    "steps",
    "pi_hind_mean",
    "hyperparams",
]
STEP_KEYS = [
    "mean_logprob",
    "action_token_count",
    "total_action_tokens",
    "skipped_action_tokens",
    "logprob_start_len",
    "step_index",
    "message_index",
    "subtask_id",
    "subtask_reward",
    "phase",
    "pi_hind",
    "rho",
    "q_h",
    "q_h_smoothed",
]


@pytest.fixture
def scored(store: Store, samples: Path) -> Store:
    ingest(store, [samples])
    add_scorer(store, "sc", spec={"max_logprob_tokens": 2048})
    add_scores(store, "sc", seed=5)
    return store


def test_hindsight_json_schema_and_values(scored: Store, tmp_path: Path) -> None:
    compute_credits(scored, CreditParams(dense=False), name="sparse")
    out = export_hindsight_json(scored, tmp_path / "hs", "sparse")
    assert out.episodes == 4
    credits = read_credits(scored, "sparse")
    for name, steps in credits.items():
        doc = json.loads((tmp_path / "hs" / name / "hindsight_scores.json").read_text())
        assert list(doc) == TOP_KEYS
        assert doc["episode_id"] == int(name.split("_")[1])  # external id "1" → 1
        assert doc["dense_rewards_used"] is False  # truthful, unlike the original
        assert doc["hyperparams"] == {
            "t_temp": 5.0,
            "gamma": 0.95,
            "c_min": 0.8,
            "c_max": 1.2,
            "alpha": 0.5,
            "smooth": True,
            "dense_rewards": False,
            "max_logprob_tokens": 2048,
        }
        assert doc["num_steps"] == len(steps) == len(doc["steps"])
        assert doc["num_subtasks_covered"] == len({s["subtask_id"] or s["phase"] for s in steps})
        rewards = [s["subtask_reward"] for s in steps]
        assert doc["subtask_reward_range"] == [min(rewards), max(rewards)]
        for got, want in zip(doc["steps"], steps):
            assert list(got) == STEP_KEYS
            assert got["q_h_smoothed"] == want["q_h_smoothed"] and got["rho"] == want["rho"]
            assert got["action_token_count"] == want["token_count"] and got["skipped_action_tokens"] == 0
        assert doc["pi_hind_mean"] == pytest.approx(sum(s["pi_hind"] for s in steps) / len(steps))
    assert not list((tmp_path / "hs").rglob("*.tmp"))


def test_hindsight_json_reaggregated_span(scored: Store, tmp_path: Path) -> None:
    compute_credits(scored, CreditParams(max_logprob_tokens=3), name="m3")
    export_hindsight_json(scored, tmp_path, "m3")
    doc = json.loads((tmp_path / "trajectories" / "episode_001" / "hindsight_scores.json").read_text())
    assert doc["hyperparams"]["max_logprob_tokens"] == 3
    for s in doc["steps"]:
        assert s["action_token_count"] <= 3
        assert s["action_token_count"] + s["skipped_action_tokens"] == s["total_action_tokens"]


def _reference_inputs(store: Store, run: str) -> list[dict]:
    """What the original builder reads: loader messages, reward, and the per-step q values."""
    from hcapo_store.storage.episodes import loader_message

    cols, rows = store.query(
        "SELECT e.name, e.external_id, e.reward, m.role, m.content, m.tool_calls, m.name, "
        "m.tool_call_id FROM messages m JOIN episodes e ON e.id = m.episode_id "
        "ORDER BY e.name, e.id, m.message_index"
    )
    msgs: dict[str, list] = {}
    meta = {}
    for name, ext, reward, *m in rows:
        msgs.setdefault(name, []).append(loader_message(*m))
        meta[name] = (int(ext), reward)
    return [
        {"episode_id": meta[name][0], "reward": meta[name][1], "messages": msgs[name], "steps": steps}
        for name, steps in sorted(read_credits(store, run).items())
    ]


@pytest.mark.parametrize("use_smoothed", [True, False])
def test_dataset_matches_reference(store: Store, tmp_path: Path, use_smoothed: bool) -> None:
    add_synthetic_episodes(store, 30, seed=11, max_len=60)
    add_scorer(store, "s")
    add_scores(store, "s", seed=4)
    compute_credits(store, name="r")
    out = tmp_path / "hcapo_train.jsonl"
    summary = export_dataset(store, out, "r", omega=0.7, min_reward=0.2, use_smoothed=use_smoothed)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ref_rows, ref_summary = build_hcapo_rows(
        _reference_inputs(store, "r"), omega=0.7, min_reward=0.2, use_smoothed=use_smoothed
    )
    assert len(rows) == len(ref_rows) == summary.episodes_in_dataset > 0
    assert summary.total_episodes_loaded == ref_summary["total_episodes_loaded"]
    for got, want in zip(rows, ref_rows):
        assert list(got) == [
            "messages",
            "step_advantages",
            "step_message_indices",
            "_episode_id",
            "_reward",
            "_grpo_advantage",
            "_num_steps",
        ]
        assert got["_episode_id"] == want["_episode_id"] and got["_reward"] == want["_reward"]
        assert got["messages"] == want["messages"]
        assert got["step_message_indices"] == want["step_message_indices"]
        assert got["_grpo_advantage"] == pytest.approx(want["_grpo_advantage"], abs=1.01e-6)
        assert got["step_advantages"] == pytest.approx(want["step_advantages"], abs=1.01e-6)
    for key in ("total_steps", "nonzero_steps"):
        assert getattr(summary, key) == ref_summary[key]
    for key, value in ref_summary["advantage_stats"].items():
        assert summary.advantage_stats[key] == pytest.approx(value, abs=1e-5)
    positive = [w for r in rows for w in r["step_advantages"] if w > 0]
    assert sum(positive) / len(positive) == pytest.approx(1.0, abs=1e-5)
    on_disk = json.loads((tmp_path / "hcapo_train.jsonl.summary.json").read_text())  # one per output
    assert on_disk["config"]["omega"] == 0.7 and on_disk["config"]["credits"] == "r"
    assert on_disk["config"]["use_smoothed"] is use_smoothed


def test_dataset_group_by_tag(store: Store, tmp_path: Path) -> None:
    add_synthetic_episodes(store, 24, seed=3, max_len=40, tags={"task": ["pg", "tc", "nb"]})
    add_scorer(store, "s")
    add_scores(store, "s", seed=9)
    compute_credits(store, name="r")
    export_dataset(store, tmp_path / "g.jsonl", "r", min_reward=0.0, group_by="task")
    rows = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    inputs = _reference_inputs(store, "r")
    group_of = {e["episode_id"]: ["pg", "tc", "nb"][(e["episode_id"] - 1000) % 3] for e in inputs}
    ref_rows, _ = build_hcapo_rows(inputs, min_reward=0.0, group_of=group_of)
    ungrouped, _ = build_hcapo_rows(inputs, min_reward=0.0)
    assert [r["_grpo_advantage"] for r in rows] == pytest.approx([r["_grpo_advantage"] for r in ref_rows], abs=1.01e-6)
    assert [r["_grpo_advantage"] for r in ref_rows] != [r["_grpo_advantage"] for r in ungrouped]


def test_dataset_steps_align_with_assistant_messages(scored: Store, tmp_path: Path) -> None:
    compute_credits(scored)
    export_dataset(scored, tmp_path / "d.jsonl", min_reward=0.0)
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert rows
    for row in rows:
        assert len(row["step_advantages"]) == len(row["step_message_indices"]) == row["_num_steps"]
        assistant = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        assert row["step_message_indices"] == assistant
        for m in row["messages"]:
            for call in m.get("tool_calls", []):
                assert isinstance(call["function"]["arguments"], str)
            if m["role"] == "tool":
                assert list(m) == ["role", "name", "tool_call_id", "content"]


def test_parquet_round_trip(scored: Store, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    compute_credits(scored)
    export_dataset(scored, tmp_path / "d.jsonl", min_reward=0.0)
    export_dataset(scored, tmp_path / "d.parquet", min_reward=0.0, fmt="parquet")
    jsonl = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    table = pq.read_table(tmp_path / "d.parquet").to_pylist()
    assert len(table) == len(jsonl)
    for a, b in zip(table, jsonl):
        assert a["step_advantages"] == b["step_advantages"] and a["_episode_id"] == b["_episode_id"]
        for ma, mb in zip(a["messages"], b["messages"]):
            assert {k: v for k, v in ma.items() if v is not None} == mb


def test_datasets_loads_jsonl(scored: Store, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    compute_credits(scored)
    export_dataset(scored, tmp_path / "d.jsonl", min_reward=0.0)
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "d.jsonl"), split="train")
    assert len(ds) > 0 and "step_advantages" in ds.column_names
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [r["step_advantages"] for r in rows] == ds["step_advantages"]
    export_dataset(scored, tmp_path / "d.parquet", min_reward=0.0, fmt="parquet")
    pq = datasets.load_dataset("parquet", data_files=str(tmp_path / "d.parquet"), split="train")
    assert pq["step_advantages"] == ds["step_advantages"] and pq["_episode_id"] == ds["_episode_id"]


def test_default_export_reads_the_runs_stored_advantages(store, samples, tmp_path):
    """A run computed now stores Eq. 8 with its parts; the default export writes them, and the
    file is byte-identical to the one computed as before revision 0003 (advantages NULL)."""
    import filecmp

    from sqlalchemy import text as sql

    ingest(store, [samples])
    add_scorer(store, "sc")
    add_scores(store, "sc", seed=11)
    compute_credits(store, name="r")
    stored = export_dataset(store, tmp_path / "stored.jsonl", "r")
    assert stored.config["advantages"] == "stored" and stored.config["variant"] == "original"
    rows = store.query(
        "SELECT COUNT(*), COUNT(advantage), COUNT(a_macro), COUNT(micro) FROM step_credits WHERE reward >= 0.2"
    )[1][0]
    assert rows[0] > 0 and rows[0] == rows[1] == rows[2] == rows[3]
    with store.engine.begin() as conn:  # what a run from before revision 0003 looks like
        conn.execute(sql("UPDATE credits SET advantage = NULL, a_macro = NULL, micro = NULL"))
    computed = export_dataset(store, tmp_path / "computed.jsonl", "r")
    assert computed.config["advantages"] == "computed"
    assert filecmp.cmp(tmp_path / "stored.jsonl", tmp_path / "computed.jsonl", shallow=False)
