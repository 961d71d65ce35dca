"""credits compute --variant paper against an independent implementation of Algorithm 1.

The reference below is written from docs/PAPER.md §1 with plain Python
loops over lists of trajectories (no numpy, no code from hcapo_store.credits), then the stored
run is compared with it to 1e-12.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as hs
from sqlalchemy import text
from test_credits import add_scorer

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams, grpo_advantages
from hcapo_store.credits.lookup import get_run
from hcapo_store.errors import CreditError, InvalidCreditParams
from hcapo_store.outputs.export import export_dataset
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

# ---- the reference ------------------------------------------------------------------------------


def _pop_std(xs: list[float]) -> float:
    """Exact, then rounded (``statistics``); 0, or a spread at rounding's size against the values
    (equations.NOISE_SPREAD) or subnormal (SMALLEST_SPREAD), → 1."""
    s = statistics.pstdev(xs)
    return s if s > 1e-12 * max(map(abs, xs)) and s >= sys.float_info.min else 1.0


def reference_paper(
    trajs: list[dict], *, t_temp=5.0, gamma=0.95, c_min=0.8, c_max=1.2, alpha=0.5, omega=1.0, success=1.0, smooth=True
) -> list[list[dict]]:
    """trajs: {"group", "reward", "logprobs": [mean logprob per step]} → per step dict."""
    out = []
    for tr in trajs:
        xs = [lp / t_temp for lp in tr["logprobs"]]
        # pi / mean(pi) as exp(x - log(mean(exp(x)))), the log of the mean exact (fsum of exps
        # taken about the largest x): no underflow where every pi is 0 in floating point
        top = max(xs)
        log_mean = top + math.log(math.fsum(math.exp(x - top) for x in xs) / len(xs))
        T = len(xs)
        steps = []
        for t, x in enumerate(xs):
            rho = min(max(math.exp(x - log_mean), c_min), c_max)
            steps.append({"pi": math.exp(x), "rho": rho, "q": rho * gamma ** (T - 1 - t) * tr["reward"]})
        for t, st in enumerate(steps):
            nxt = steps[t + 1]["q"] if t + 1 < T else None
            st["qs"] = st["q"] if (nxt is None or not smooth) else alpha * st["q"] + (1 - alpha) * nxt
        out.append(steps)
    by_group: dict = {}
    for i, tr in enumerate(trajs):
        by_group.setdefault(tr["group"], []).append(i)
    for members in by_group.values():
        rewards = [trajs[i]["reward"] for i in members]
        mu_r = Fraction(statistics.mean(map(Fraction, rewards)))  # exact
        sd_r = _pop_std(rewards)
        qs = [st["qs"] for i in members for st in out[i]]
        mu_h = statistics.mean(map(Fraction, qs))
        sd_h = _pop_std(qs)
        for i in members:
            a = float(Fraction(trajs[i]["reward"]) - mu_r) / sd_r
            for st in out[i]:
                micro = float(Fraction(st["qs"]) - mu_h) / sd_h
                if trajs[i]["reward"] >= success and micro < 0:
                    micro = 0.0
                st.update(a_macro=a, micro=micro, advantage=a + omega * micro)
    return out


# ---- a store with chosen logprobs ----------------------------------------------------------------


def _store_with(tmp_path, trajs: list[dict]) -> Store:
    """Episodes with the given rewards, group tags and per-step mean logprobs, scored by "sc"
    (``tokens``: each step's action length, default 1)."""
    lines = []
    for k, tr in enumerate(trajs):
        messages = [{"role": "user", "content": f"task {k}"}]
        for t in range(len(tr["logprobs"])):
            messages.append({"role": "assistant", "content": f"step {t} of {k}"})
            messages.append({"role": "user", "content": "go on"})
        lines.append(json.dumps({"episode_id": f"e{k:03d}", "reward": tr["reward"], "messages": messages[:-1]}))
    path = tmp_path / "eps.jsonl"
    path.write_text("\n".join(lines) + "\n")
    store = Store.open(str(tmp_path / "s.db"))
    from hcapo_store.ingestion.pipeline import ingest

    assert ingest(store, [path]).failed == 0
    add_scorer(store, "sc")
    with db.write(store.engine) as conn:
        eps = dict(conn.execute(text("SELECT external_id, id FROM episodes")).all())
        for k, tr in enumerate(trajs):
            ep = eps[f"e{k:03d}"]
            if tr["group"] is not None:
                conn.execute(
                    text("INSERT INTO tags (episode_id, key, value) VALUES (:e, 'grp', :v)"),
                    {"e": ep, "v": str(tr["group"])},
                )
            steps = conn.execute(
                text("SELECT id, step_index FROM steps WHERE episode_id = :e ORDER BY step_index"), {"e": ep}
            ).all()
            assert len(steps) == len(tr["logprobs"])
            for (sid, _t), lp, n in zip(steps, tr["logprobs"], tr.get("tokens") or [1] * len(steps)):
                add_score(conn, "sc", sid, lp, n)
    return store


def add_score(conn, scorer: str, step_id: int, mean: float, tokens: int = 1) -> None:
    """One stored score of ``tokens`` equal per-token values (so the mean is ``mean``)."""
    import struct

    conn.execute(
        text(
            "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob, "
            "total_action_tokens, skipped_action_tokens, truncated_prefix_tokens, input_tokens, "
            "logprob_start_len, flattened, created_at) VALUES (:s, :sc, :b, :n, :m, :n, 0, 0, :i, 1, "
            "FALSE, '2026-11-25')"
        ),
        {
            "s": step_id,
            "sc": scorer,
            "b": struct.pack(f"<{tokens}f", *[mean] * tokens),
            "n": tokens,
            "m": mean,
            "i": tokens + 1,
        },
    )


def _stored(store: Store, run: str) -> dict[tuple[str, int], dict]:
    rows = store.query(
        "SELECT external_id, step_index, pi_hind, rho, q_h, q_h_smoothed, a_macro, micro, advantage "
        "FROM step_credits WHERE run = :r",
        {"r": run},
    )[1]
    keys = ("pi", "rho", "q", "qs", "a_macro", "micro", "advantage")
    return {(r[0], r[1]): dict(zip(keys, r[2:])) for r in rows}


def _compare(store: Store, run: str, trajs: list[dict], ref: list[list[dict]]) -> None:
    got = _stored(store, run)
    assert len(got) == sum(len(t["logprobs"]) for t in trajs)
    for k, steps in enumerate(ref):
        for t, want in enumerate(steps):
            have = got[(f"e{k:03d}", t)]
            for key, value in want.items():
                assert have[key] == pytest.approx(value, abs=1e-12, rel=1e-12), (k, t, key)


def _random_trajs(rng: random.Random, n: int, groups: int) -> list[dict]:
    return [
        {
            "group": rng.randrange(groups),
            "reward": rng.choice([0.0, 1.0, round(rng.random(), 3)]),
            "logprobs": [-rng.random() * 4 for _ in range(rng.randint(1, 12))],
        }
        for _ in range(n)
    ]


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_paper_variant_equals_the_reference(tmp_path, seed):
    rng = random.Random(seed)
    trajs = _random_trajs(rng, 14, 3)
    store = _store_with(tmp_path, trajs)
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp"), name="p")
    _compare(store, "p", trajs, reference_paper(trajs))
    p = CreditParams(
        variant="paper", dense=False, group_by="grp", alpha=0.2, omega=0.3, t_temp=2.0, success_threshold=0.5
    )
    compute_credits(store, p, name="p2")
    _compare(store, "p2", trajs, reference_paper(trajs, alpha=0.2, omega=0.3, t_temp=2.0, success=0.5))
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp", smooth=False), name="p3")
    _compare(store, "p3", trajs, reference_paper(trajs, smooth=False))


@pytest.mark.parametrize(
    "case",
    [
        "single",  # a group of one trajectory: A_i = 0, sigma_R = 0 -> 1
        "equal",  # equal rewards and equal logprobs: both sigmas 0 -> 1
        "all_success",
        "all_failed",
        "one_step",
    ],
)
def test_paper_variant_edge_cases(tmp_path, case):
    rng = random.Random(7)
    if case == "single":
        trajs = [{"group": "a", "reward": 0.4, "logprobs": [-1.0, -2.0, -0.5]}] + _random_trajs(rng, 4, 1)
        for t in trajs[1:]:
            t["group"] = "b"
    elif case == "equal":
        trajs = [{"group": 0, "reward": 0.5, "logprobs": [-1.0] * 3} for _ in range(3)]
    elif case == "all_success":
        trajs = [dict(t, reward=1.0, group=0) for t in _random_trajs(rng, 5, 1)]
    elif case == "all_failed":
        trajs = [dict(t, reward=0.0, group=0) for t in _random_trajs(rng, 5, 1)]
    else:
        trajs = [dict(t, logprobs=t["logprobs"][:1], group=0) for t in _random_trajs(rng, 6, 1)]
    store = _store_with(tmp_path, trajs)
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp"), name="p")
    ref = reference_paper(trajs)
    _compare(store, "p", trajs, ref)
    advantages = [st["advantage"] for steps in ref for st in steps]
    if case == "all_success":
        assert all(st["micro"] >= 0 for steps in ref for st in steps)
    if case == "all_failed":  # R = 0: Q^H = 0 and A_i = 0, so no step gets a signal
        assert advantages == [0.0] * len(advantages)
    if case in ("equal", "single"):  # sigma_R = 0 -> 1: the macro term is exactly 0, not NaN
        members = ref if case == "equal" else ref[:1]
        assert [st["a_macro"] for steps in members for st in steps] == [0.0] * sum(map(len, members))


def test_untagged_episodes_form_one_group_with_a_warning(tmp_path):
    trajs = _random_trajs(random.Random(3), 8, 2)
    for t in trajs[:3]:
        t["group"] = None
    store = _store_with(tmp_path, trajs)
    result = compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp"), name="p")
    assert "3 of 8 episode(s) lack this tag" in result.message
    _compare(store, "p", trajs, reference_paper(trajs))  # None is a group key like any other


def test_missing_tag_and_bad_options_are_one_line_errors(tmp_path, runner):
    store = _store_with(tmp_path, _random_trajs(random.Random(4), 3, 1))
    with pytest.raises(CreditError, match="--group-by nope: no credited episode has this tag"):
        compute_credits(store, CreditParams(variant="paper", group_by="nope"))
    assert store.query("SELECT COUNT(*) FROM credit_runs")[1] == [(0,)]
    with pytest.raises(InvalidCreditParams, match="--variant"):
        CreditParams(variant="papr")
    with pytest.raises(InvalidCreditParams, match="--success-threshold"):
        CreditParams(variant="paper", success_threshold=float("nan"))
    db_path = str(tmp_path / "s.db")
    for args, needle in (
        (["--variant", "papr"], "'papr' is not one of"),
        (["--variant", "paper", "--success-threshold", "nan"], "--success-threshold"),
        (["--variant", "paper", "--group-by", "nope"], "no credited episode has this tag"),
        (["--success-threshold", "0.5"], "applies to --variant paper only"),
        (["--variant", "paper", "--min-reward", "0.5"], "applies to --variant original only"),
    ):
        r = runner.invoke(cli, ["--db", db_path, "credits", "compute", *args])
        assert r.exit_code != 0 and needle in r.output and "Traceback" not in r.output, (args, r.output)


def test_paper_run_exports_signed_advantages_and_keeps_every_episode(tmp_path):
    rng = random.Random(5)
    trajs = _random_trajs(rng, 10, 2)
    trajs[0]["reward"] = 0.0  # below the original's min_reward: the paper keeps it
    store = _store_with(tmp_path, trajs)
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp"), name="p")
    assert get_run(store, "p").variant == "paper"
    summary = export_dataset(store, tmp_path / "p.jsonl", "p")
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert summary.config["advantages"] == "stored" and summary.config["variant"] == "paper"
    assert len(rows) == len(trajs) and summary.episodes_dropped == {}
    ref = reference_paper(trajs)
    by_id = {r["_episode_id"]: r for r in rows}
    for k, steps in enumerate(ref):
        row = by_id[f"e{k:03d}"]
        assert row["step_advantages"] == pytest.approx([st["advantage"] for st in steps], abs=1e-6)
        assert row["_grpo_advantage"] == pytest.approx(steps[0]["a_macro"], abs=1e-6)
    assert any(a < 0 for r in rows for a in r["step_advantages"])
    from hcapo_store.errors import ExportError

    with pytest.raises(ExportError, match="paper run"):
        export_dataset(store, tmp_path / "q.jsonl", "p", omega=0.5)


def test_original_run_stores_the_eq8_parts(tmp_path):
    """For the original variant the stored advantage is the default export's weight, and its parts
    recombine: weight = max(a_macro + ω·micro, 0) / mean of the positive values."""
    trajs = _random_trajs(random.Random(6), 12, 1)
    store = _store_with(tmp_path, trajs)
    compute_credits(store, CreditParams(omega=0.7), name="o")
    rows = store.query("SELECT reward, a_macro, micro, advantage FROM step_credits WHERE run = 'o' ORDER BY step_id")[1]
    kept = [r for r in rows if r[0] >= 0.2]
    assert all(r[3] is None for r in rows if r[0] < 0.2) and kept
    clamped = [max(a + 0.7 * m, 0.0) for _, a, m, _ in kept]
    positive = [c for c in clamped if c > 0]
    scale = sum(positive) / len(positive)
    for (_, a, m, w), c in zip(kept, clamped):
        assert w == pytest.approx(c / scale, abs=1e-12)
        if a > 0:
            assert m >= 0  # do-no-harm, the original's way


@pytest.mark.parametrize("variant", ["paper", "original"])
@pytest.mark.parametrize("reward", [0.1, 0.7, 0.3])
def test_equal_rewards_give_no_macro_term_also_where_their_float_mean_is_off(tmp_path, variant, reward):
    """Three equal rewards of 0.1: numpy's mean is 0.1 + 1.4e-17 and its std 1.4e-17, which divided
    made A = ±1 on every step (a signal the data does not have). Equal rewards are no spread:
    A = 0 exactly, and the hindsight term still carries the logprobs' signal."""
    trajs = [{"group": 0, "reward": reward, "logprobs": lps} for lps in ([-0.5, -3.0], [-2.0, -0.1], [-1.0, -1.5])]
    trajs += [{"group": 1, "reward": reward, "logprobs": [-1.0]} for _ in range(3)]  # identical members
    store = _store_with(tmp_path, trajs)
    compute_credits(store, CreditParams(variant=variant, dense=False, group_by="grp", min_reward=0.0), name="r")
    got = _stored(store, "r")
    assert [v["a_macro"] for v in got.values()] == [0.0] * len(got)
    identical = [v for (ep, _t), v in got.items() if ep >= "e003"]
    assert [(v["micro"], v["advantage"]) for v in identical] == [(0.0, 0.0)] * 3 or variant == "original"
    if variant == "paper":
        _compare(store, "r", trajs, reference_paper(trajs))
        first_group = [v["advantage"] for (ep, _t), v in got.items() if ep < "e003"]
        assert len({round(a, 9) for a in first_group}) == len(first_group) and min(map(abs, first_group)) > 0.01
    else:  # A = 0, so each weight is its step's own clamped micro term (not A = ±1 shifting all)
        clamped = {k: max(v["micro"], 0.0) for k, v in got.items()}
        scale = statistics.mean(c for c in clamped.values() if c > 0)
        assert all(v["advantage"] == pytest.approx(clamped[k] / scale, abs=1e-12) for k, v in got.items())
        first_group = [v["advantage"] for (ep, _t), v in got.items() if ep < "e003"]
        assert max(first_group) > 0 and min(first_group) == 0.0


def test_pi_hind_underflow_keeps_the_ratio_and_the_order(tmp_path):
    """Mean logprobs of -4000, -4002, -4010 at T = 5 put every π_hind under float64's smallest
    number (exp(-800) = 0). The ratio π_t / mean π is well defined (e^0.4 ... ): taken in log
    space it is, and the steps keep their order; before, every ρ was c_min."""
    trajs = [
        {"group": 0, "reward": 1.0, "logprobs": [-4000.0, -4002.0, -4010.0]},
        {"group": 0, "reward": 0.0, "logprobs": [-4001.0, -4000.0, -4003.0]},
    ]
    store = _store_with(tmp_path, trajs)
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp", smooth=False), name="p")
    _compare(store, "p", trajs, reference_paper(trajs, smooth=False))
    rows = store.query(
        "SELECT step_index, pi_hind, rho_raw, rho FROM step_credits WHERE run = 'p' AND external_id = 'e000' "
        "ORDER BY step_index"
    )[1]
    assert [r[1] for r in rows] == [0.0, 0.0, 0.0]  # the stored π_hind is exp(x) as it is
    x = [-800.0, -800.4, -802.0]
    log_mean = -800.0 + math.log(sum(math.exp(v + 800.0) for v in x) / 3)
    assert [r[2] for r in rows] == pytest.approx([math.exp(v - log_mean) for v in x], rel=1e-12)
    assert rows[0][2] > rows[1][2] > rows[2][2] and rows[0][3] == 1.2 and rows[2][3] == 0.8


@settings(max_examples=200, deadline=None)
@given(
    value=hs.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    n=hs.integers(1, 40),
    groups=hs.integers(1, 3),
)
def test_grpo_of_equal_rewards_is_zero_for_any_value(value, n, groups):
    """A_i of equal rewards is exactly 0 whatever the value and group size (the log-ratio run's
    --grpo term and both credit variants take it from here)."""
    a = grpo_advantages(np.full(n, value), [k % groups for k in range(n)])
    assert a.tolist() == [0.0] * n


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=2, max_size=30))
@example([0.0, 5e-324])  # a subnormal spread: no spread (its mean rounds to one end)
def test_grpo_equals_exact_arithmetic(rewards):
    """Against exact rational arithmetic (the std rounded once), where the rewards spread."""
    exact_mean = statistics.mean(map(Fraction, rewards))
    sd = statistics.pstdev(rewards)
    got = grpo_advantages(np.asarray(rewards))
    if sd <= 1e-12 * max(map(abs, rewards)) or sd < sys.float_info.min:
        assert np.all(np.abs(got) <= 1e-9 * max(1.0, max(map(abs, rewards))))
    else:
        want = [float(Fraction(r) - exact_mean) / sd for r in rewards]
        assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-9)
