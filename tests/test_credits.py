"""Credit runs: exact Eq. 5–7 against the plain-Python reference through the DB path,
idempotency and naming, incomplete episodes, suffix re-aggregation, list/show/diff."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from hcapo_store.credits.compare import diff_runs, iter_step_deltas, show_run
from hcapo_store.credits.compute import compute_credits, scoped_run_hash
from hcapo_store.credits.equations import CreditParams
from hcapo_store.credits.lookup import get_run, list_runs
from hcapo_store.devkit.original_math import compute_ratios_and_qh
from hcapo_store.errors import CreditError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

NOW = "2025-01-01T00:00:00+00:00"


# ---- helpers shared with test_export / test_report ------------------------------------------


def add_scorer(store: Store, scorer_id: str, label: str = "test", spec: dict | None = None) -> None:
    with db.write(store.engine) as conn:
        conn.execute(
            text("INSERT INTO scorers (id, label, spec, created_at) VALUES (:i, :l, :s, :t)"),
            {"i": scorer_id, "l": label, "s": json.dumps(spec or {}), "t": NOW},
        )


def add_scores(
    store: Store, scorer_id: str, seed: int = 0, *, skip: set[tuple[str, int]] = frozenset(), extreme: bool = False
) -> int:
    """Score every current step (except ``skip`` = {(episode name, step_index)}) with random
    per-token logprobs; ``extreme`` mixes in -80 and 0 means. Returns the number of scores."""
    rng = random.Random(seed)
    with db.write(store.engine) as conn:
        steps = conn.execute(
            text(
                "SELECT s.id, e.name, s.step_index FROM steps s JOIN episodes e ON e.id = s.episode_id "
                "WHERE e.is_current IS TRUE ORDER BY s.id"
            )
        ).all()
        rows = []
        for step_id, name, idx in steps:
            if (name, idx) in skip:
                continue
            n = rng.randint(1, 40)
            lps = [rng.uniform(-6.0, 0.0) for _ in range(n)]
            if extreme and rng.random() < 0.15:
                lps = [rng.choice([-80.0, 0.0])] * n
            lps = list(struct.unpack(f"<{n}f", struct.pack(f"<{n}f", *lps)))  # what float32 keeps
            rows.append(
                {
                    "step": step_id,
                    "scorer": scorer_id,
                    "blob": struct.pack(f"<{n}f", *lps),
                    "n": n,
                    "mean": sum(lps) / n,
                    "at": NOW,
                }
            )
        if rows:
            conn.execute(
                text(
                    "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob, "
                    "total_action_tokens, skipped_action_tokens, truncated_prefix_tokens, input_tokens, "
                    "logprob_start_len, flattened, created_at) VALUES (:step, :scorer, :blob, :n, :mean, :n, 0, 0, "
                    "1000, 900, :f, :at)"
                ),
                [{**r, "f": False} for r in rows],
            )
    return len(rows)


def add_synthetic_episodes(
    store: Store, count: int, seed: int = 0, *, max_len: int = 300, tags: dict[str, list[str]] | None = None
) -> None:
    """Episodes with random lengths 1..max_len, planning then subtasks (some revisited, some
    with a NULL or empty subtask_id), rewards incl. 0 and NULL, and matching messages."""
    rng = random.Random(seed)
    with db.write(store.engine) as conn:
        for e in range(count):
            length = rng.randint(1, max_len) if e else 1
            steps: list[tuple[str, str | None, float | None]] = []
            sub_rewards = {f"S{i}": rng.choice([0.0, 0.25, rng.random(), None]) for i in range(1, 6)}
            plan_score = rng.choice([0.0, rng.random(), None])
            while len(steps) < length:
                if not steps and rng.random() < 0.8:
                    steps += [("planning", None, plan_score)] * rng.randint(1, 4)
                    continue
                sid = rng.choice(["S1", "S2", "S3", "S4", "S5", None, ""])
                steps += [("executing", sid, sub_rewards.get(sid or "", rng.choice([0.0, None])))] * rng.randint(1, 30)
            steps = steps[:length]
            ep_id = conn.execute(
                text(
                    "INSERT INTO episodes (source_key, version, is_current, content_hash, source_format, "
                    "external_id, name, reward, frozen_scores, reward_backfilled, include_thinking, "
                    "max_tool_result_chars, num_messages, num_steps, raw_source, ingested_at) VALUES "
                    "(:k, 1, :cur, 'h', 'jsonl', :x, :name, :r, :fs, :f, :t, 4000, :nm, :ns, :raw, :at) RETURNING id"
                ),
                {
                    "k": f"synth/{seed}/{e}",
                    "cur": True,
                    "x": str(1000 + e),
                    "name": f"synth_{seed}_{e:04d}",
                    "r": rng.choice([0.0, round(rng.random(), 4), 1.0]),
                    "f": False,
                    "t": True,
                    "fs": json.dumps({k: v for k, v in sub_rewards.items() if v is not None}),
                    "nm": 1 + 2 * length,
                    "ns": length,
                    "raw": b"",
                    "at": NOW,
                },
            ).scalar_one()
            msgs = [{"i": 0, "role": "user", "c": "task", "tc": None, "n": None, "tcid": None}]
            for t in range(length):
                call = [
                    {"id": f"c{t}", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
                ]
                msgs.append(
                    {
                        "i": 1 + 2 * t,
                        "role": "assistant",
                        "c": f"step {t}",
                        "tc": json.dumps(call),
                        "n": None,
                        "tcid": None,
                    }
                )
                msgs.append({"i": 2 + 2 * t, "role": "tool", "c": "ok", "tc": None, "n": "bash", "tcid": f"c{t}"})
            conn.execute(
                text(
                    "INSERT INTO messages (episode_id, message_index, role, content, tool_calls, name, tool_call_id) "
                    "VALUES (:e, :i, :role, :c, :tc, :n, :tcid)"
                ),
                [{**m, "e": ep_id} for m in msgs],
            )
            conn.execute(
                text(
                    "INSERT INTO steps (episode_id, step_index, message_index, phase, subtask_id, subtask_reward) "
                    "VALUES (:e, :t, :m, :p, :s, :r)"
                ),
                [{"e": ep_id, "t": t, "m": 1 + 2 * t, "p": p, "s": s, "r": r} for t, (p, s, r) in enumerate(steps)],
            )
            for key, values in (tags or {}).items():
                conn.execute(
                    text("INSERT INTO tags (episode_id, key, value) VALUES (:e, :k, :v)"),
                    {"e": ep_id, "k": key, "v": values[e % len(values)]},
                )


def read_credits(store: Store, run: str) -> dict[str, list[dict[str, Any]]]:
    """The run's credits with their step inputs, per episode name, in step order."""
    cols, rows = store.query(
        "SELECT sc.episode, sc.reward, sc.phase, sc.subtask_id, sc.subtask_reward, sc.mean_logprob, "
        "sc.token_count, sc.pi_hind, sc.rho_raw, sc.rho, sc.r_t, sc.discount, sc.q_h, sc.q_h_smoothed "
        "FROM step_credits sc WHERE sc.run = :run ORDER BY sc.episode_id, sc.step_index",
        {"run": run},
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        d = dict(zip(cols, r))
        out.setdefault(d["episode"], []).append(d)
    return out


def assert_matches_reference(store: Store, run: str, p: CreditParams) -> int:
    n = 0
    for steps in read_credits(store, run).values():
        ref = [
            {
                "mean_logprob": s["mean_logprob"],
                "subtask_id": s["subtask_id"],
                "phase": s["phase"],
                "subtask_reward": s["subtask_reward"],
            }
            for s in steps
        ]
        compute_ratios_and_qh(
            ref, steps[0]["reward"], p.t_temp, p.gamma, p.c_min, p.c_max, p.alpha, p.smooth, p.uses_dense
        )
        for got, want in zip(steps, ref):
            for key in ("pi_hind", "rho", "q_h", "q_h_smoothed"):
                assert got[key] == pytest.approx(want[key], abs=1e-12, rel=0), (key, got, want)
            n += 1
    return n


def current_steps(store: Store, *, except_episode: str = "") -> int:
    """Steps of the current episodes as ingested (the samples differ between ../shared and examples/)."""
    return store.query(
        "SELECT COUNT(*) FROM steps s JOIN episodes e ON e.id = s.episode_id WHERE e.is_current AND e.name <> :x",
        {"x": except_episode},
    )[1][0][0]


@pytest.fixture
def scored(store: Store, samples: Path) -> Store:
    ingest(store, [samples])
    add_scorer(store, "scorer-a", "model-a")
    add_scores(store, "scorer-a", seed=1)
    return store


# ---- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("smooth", [True, False])
@pytest.mark.parametrize("dense", [True, False])
def test_randomized_episodes_match_reference(store: Store, smooth: bool, dense: bool) -> None:
    add_synthetic_episodes(store, 40, seed=7)
    add_scorer(store, "s1")
    add_scores(store, "s1", seed=3, extreme=True)
    p = CreditParams(t_temp=3.0, gamma=0.9, c_min=0.7, c_max=1.4, alpha=0.3, smooth=smooth, dense=dense)
    result = compute_credits(store, p, name="r")
    assert result.created and result.run.episodes == 40 and result.run.incomplete_episodes == 0
    assert assert_matches_reference(store, "r", p) == result.run.steps
    nulls = store.query("SELECT COUNT(*) FROM steps WHERE subtask_reward IS NULL")[1][0][0]
    assert result.null_reward_steps == (nulls if dense else 0)
    assert nulls > 0


def test_defaults_on_samples_match_reference(scored: Store) -> None:
    result = compute_credits(scored)
    assert result.run.name == "default" and result.run.episodes == 4
    assert assert_matches_reference(scored, "default", CreditParams()) == result.run.steps == current_steps(scored)


def test_rho_raw_and_columns(scored: Store) -> None:
    p = CreditParams(c_min=0.95, c_max=1.05, dense=False)
    compute_credits(scored, p, name="tight")
    for steps in read_credits(scored, "tight").values():
        T = len(steps)
        for t, s in enumerate(steps):
            assert s["rho"] == min(max(s["rho_raw"], 0.95), 1.05)
            assert s["r_t"] == s["reward"]
            assert s["discount"] == pytest.approx(0.95 ** (T - 1 - t), abs=1e-15)
    clipped = scored.query("SELECT COUNT(*) FROM step_credits WHERE run = 'tight' AND rho <> rho_raw")[1][0][0]
    assert clipped > 0


def test_group_discount_uses_last_occurrence_of_key(store: Store) -> None:
    # S1, S1, S2, S1 → step 0's group (S1) ends at index 3, not at index 1.
    with db.write(store.engine) as conn:
        ep = conn.execute(
            text(
                "INSERT INTO episodes (source_key, version, is_current, content_hash, source_format, name, reward, "
                "frozen_scores, reward_backfilled, include_thinking, max_tool_result_chars, num_messages, num_steps, "
                "raw_source, ingested_at) VALUES ('k', 1, :t, 'h', 'jsonl', 'ep', 1.0, '{}', :f, :t, 4000, 4, 4, :b, :at) "
                "RETURNING id"
            ),
            {"t": True, "f": False, "b": b"", "at": NOW},
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO steps (episode_id, step_index, message_index, phase, subtask_id, subtask_reward) "
                "VALUES (:e, :i, :i, 'executing', :s, 1.0)"
            ),
            [{"e": ep, "i": i, "s": s} for i, s in enumerate(["S1", "S1", "S2", "S1"])],
        )
    add_scorer(store, "s")
    add_scores(store, "s")
    compute_credits(store, CreditParams(gamma=0.5), name="g")
    discounts = [s["discount"] for s in read_credits(store, "g")["ep"]]
    assert discounts == [0.125, 0.25, 1.0, 1.0]


# ---- max_logprob_tokens ----------------------------------------------------------------------


def test_max_logprob_tokens_reaggregates_suffix(scored: Store) -> None:
    compute_credits(scored, CreditParams(max_logprob_tokens=5), name="last5")
    compute_credits(scored, CreditParams(max_logprob_tokens=0), name="all")  # ≤ 0 means all tokens
    _, rows = scored.query(
        "SELECT sc.token_logprobs, sc.token_count, sc.mean_logprob, c.mean_logprob, c.token_count "
        "FROM scores sc JOIN credits c ON c.step_id = sc.step_id JOIN credit_runs r ON r.id = c.run_id "
        "WHERE r.name = 'last5'"
    )
    reaggregated = 0
    for blob, count, stored, used, used_count in rows:
        values = struct.unpack(f"<{count}f", blob)
        if count > 5:
            assert used == pytest.approx(sum(values[-5:]) / 5, abs=1e-12) and used_count == 5
            reaggregated += 1
        else:
            assert used == stored and used_count == count
    assert 0 < reaggregated < len(rows)
    assert get_run(scored, "all").params["max_logprob_tokens"] is None
    all_means = scored.query(
        "SELECT c.mean_logprob, sc.mean_logprob FROM credits c JOIN credit_runs r ON "
        "r.id = c.run_id JOIN scores sc ON sc.step_id = c.step_id WHERE r.name = 'all'"
    )[1]
    assert all(a == b for a, b in all_means)
    assert assert_matches_reference(scored, "last5", CreditParams(max_logprob_tokens=5)) == current_steps(scored)


# ---- identity, names, scorers ------------------------------------------------------------------


def test_same_params_return_existing_run(scored: Store) -> None:
    first = compute_credits(scored)
    again = compute_credits(scored, name="other-name")
    assert not again.created and again.run.id == first.run.id and again.run.name == "default"
    assert "other-name" in again.message and "already" in again.message
    assert scored.query("SELECT COUNT(*) FROM credit_runs")[1][0][0] == 1
    custom = compute_credits(scored, CreditParams(gamma=0.9))
    assert custom.run.name == f"run-{custom.run.run_hash[:8]}"
    with pytest.raises(CreditError, match="already used"):
        compute_credits(scored, CreditParams(gamma=0.8), name="default")
    redo = compute_credits(scored, replace=True)
    assert redo.created and redo.run.name == "default" and redo.run.steps == current_steps(scored)


def test_scorer_choice(scored: Store) -> None:
    add_scorer(scored, "scorer-b", "model-b")
    add_scores(scored, "scorer-b", seed=2)
    with pytest.raises(CreditError, match="pick one with --scorer.*scorer-a.*scorer-b"):
        compute_credits(scored)
    a = compute_credits(scored, scorer="scorer-a")
    b = compute_credits(scored, scorer="model-b")  # a label works too
    assert a.run.scorer_id == "scorer-a" and b.run.scorer_id == "scorer-b"
    assert b.run.name.startswith("run-")  # "default" is taken by scorer-a's run
    with pytest.raises(CreditError, match="matches no scorer"):
        compute_credits(scored, scorer="zzz")


def test_no_scorer(store: Store) -> None:
    with pytest.raises(CreditError, match="no scorer"):
        compute_credits(store)


# ---- incomplete and superseded episodes ------------------------------------------------------


def test_incomplete_episodes_get_no_credits(store: Store, samples: Path) -> None:
    ingest(store, [samples])
    add_scorer(store, "s")
    add_scores(store, "s", skip={("trajectories/episode_002", 3)})
    result = compute_credits(store)
    assert result.run.incomplete == ["trajectories/episode_002"] and result.run.incomplete_episodes == 1
    assert result.run.episodes == 3 and result.run.steps == current_steps(
        store, except_episode="trajectories/episode_002"
    )
    assert "trajectories/episode_002" not in read_credits(store, "default")


def test_superseded_versions_are_ignored(scored: Store) -> None:
    with db.write(scored.engine) as conn:
        conn.execute(text("UPDATE episodes SET is_current = :f WHERE name = 'trajectories/episode_001'"), {"f": False})
    result = compute_credits(scored)
    assert result.run.episodes == 3 and "trajectories/episode_001" not in read_credits(scored, "default")


# ---- list, show, diff --------------------------------------------------------------------------


def test_list_show_diff(scored: Store) -> None:
    compute_credits(scored)
    compute_credits(scored, CreditParams(alpha=0.9, c_max=1.5), name="b")
    runs = list_runs(scored)
    assert [r.name for r in runs] == ["default", "b"]
    assert runs[1].params["alpha"] == 0.9 and runs[0].scorer_label == "model-a"

    steps = current_steps(scored)
    shown = show_run(scored, "default")
    assert shown.run.steps == steps and shown.run.params["t_temp"] == 5.0
    by_subtask = {r.subtask: r for r in shown.subtasks}
    assert shown.subtasks[0].subtask == "planning"
    _, per_subtask = scored.query(
        "SELECT COALESCE(s.subtask_id, 'planning'), COUNT(*), COUNT(DISTINCT s.episode_id) "
        "FROM steps s JOIN episodes e ON e.id = s.episode_id WHERE e.is_current GROUP BY 1"
    )
    assert {r.subtask: (r.steps, r.episodes) for r in shown.subtasks} == {
        name: (n, eps) for name, n, eps in per_subtask
    }
    assert {"planning", "S1", "S2"} <= set(by_subtask) and by_subtask["S1"].episodes == 4
    assert sum(r.steps for r in shown.subtasks) == steps
    assert shown.clipped_low == sum(r.clipped_low for r in shown.subtasks)

    d = diff_runs(scored, "default", "b")
    assert d.common_steps == steps and d.only_a == d.only_b == 0
    assert len(d.top_moved) == 10
    assert d.delta_q_h_smoothed["min"] <= d.delta_q_h_smoothed["p50"] <= d.delta_q_h_smoothed["max"]
    moves = [abs(m.delta_q_h_smoothed) for m in d.top_moved]
    assert moves == sorted(moves, reverse=True)
    all_steps = list(iter_step_deltas(scored, "default", "b"))
    assert len(all_steps) == steps
    assert max(abs(s["delta_q_h_smoothed"]) for s in all_steps) == moves[0]
    top = d.top_moved[0]
    assert top.episode.startswith("trajectories/episode_") and isinstance(top.step_index, int)

    same = diff_runs(scored, "default", "default")
    assert same.delta_rho["max"] == 0 and same.delta_q_h_smoothed["min"] == 0
    with pytest.raises(CreditError, match="no credit run named 'nope'"):
        show_run(scored, "nope")


# ---- batch run names -------------------------------------------------------------------------


def test_a_batch_run_name_names_the_same_episodes_in_every_database(tmp_path: Path, samples: Path) -> None:
    """The name hashed database-local ids: batch-f574620f4f91 named other episodes in three
    databases. Two stores ingest the same episodes in opposite orders (ids differ) and one
    other episode first: the same episodes give the same run hash and name, other ones do not."""
    episodes = sorted(p for p in samples.iterdir() if p.is_dir())
    assert len(episodes) >= 3
    stores = []
    for db_name, order in (("a.db", episodes), ("b.db", episodes[::-1])):
        store = Store.open(str(tmp_path / db_name), create=True)
        for episode in order:
            ingest(store, [episode])
        add_scorer(store, "scorer-a", "model-a")
        add_scores(store, "scorer-a", seed=1)
        stores.append(store)

    def ids_of(store: Store, names: list[str]) -> list[int]:
        rows = store.query("SELECT id, name FROM episodes WHERE is_current")[1]
        by_name = {name: i for i, name in rows}
        return [by_name[n] for n in names]

    names = sorted(n for (n,) in stores[0].query("SELECT name FROM episodes WHERE is_current")[1])
    shared = names[:2]
    a_ids, b_ids = ids_of(stores[0], shared), ids_of(stores[1], shared)
    assert sorted(a_ids) != sorted(b_ids)  # the ids differ, so the old hash differed too
    hashes = []
    for store, ids in zip(stores, (a_ids, b_ids)):
        with db.read(store.engine) as conn:
            hashes.append(scoped_run_hash(conn, "scorer-a", CreditParams(), ids))
        run = compute_credits(store, CreditParams(), scorer="scorer-a", episodes=ids).run
        assert run.run_hash == hashes[-1] and run.episodes == 2
    assert hashes[0] == hashes[1]
    other = ids_of(stores[0], names[1:3])
    with db.read(stores[0].engine) as conn:
        assert scoped_run_hash(conn, "scorer-a", CreditParams(), other) != hashes[0]
        with pytest.raises(CreditError, match="not in this store"):
            scoped_run_hash(conn, "scorer-a", CreditParams(), [10**6])
