"""hcapo-store diagnose: every number against an independent computation, warnings exactly when due."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from scipy import stats as sps
from sqlalchemy import text
from test_credit_variants import _store_with, add_score

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.diagnose import (
    CLIPPED_SHARE,
    INERT_STD,
    LENGTH_CORR,
    NO_WARNING,
    diagnose_run,
    spearman,
)
from hcapo_store.credits.equations import CreditParams
from hcapo_store.errors import CreditError
from hcapo_store.storage import db


def _trajs(seed: int, *, spread: float, length_slope: float = 0.0, groups: int = 2) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for k in range(24):
        n = rng.randint(3, 15)
        tokens = [rng.randint(5, 300) for _ in range(n)]
        logprobs = [-1.0 + rng.gauss(0, spread) + length_slope * t for t in tokens]
        out.append({"group": k % groups, "reward": rng.choice([0.3, 0.6, 1.0]), "logprobs": logprobs, "tokens": tokens})
    return out


def _rho_raw(trajs: list[dict], t_temp: float = 5.0) -> tuple[list[float], list[int], list[float]]:
    """Eq. 6-7 written out: ρ_raw = π_hind / mean over the trajectory; with tokens and positions."""
    rho, tokens, position = [], [], []
    for tr in trajs:
        pis = [math.exp(lp / t_temp) for lp in tr["logprobs"]]
        mean = sum(pis) / len(pis)
        rho += [p / mean for p in pis]
        tokens += tr["tokens"]
        position += [t / len(pis) for t in range(len(pis))]
    return rho, tokens, position


def _codes(result: dict) -> set[str]:
    return {w["code"] for w in result["warnings"]}


def test_healthy_run_numbers_and_no_warning(tmp_path):
    trajs = _trajs(1, spread=0.4)
    store = _store_with(tmp_path, trajs)
    compute_credits(store, name="r")
    got = diagnose_run(store, "r")
    rho, tokens, position = _rho_raw(trajs)
    rho_a = np.asarray(rho)
    assert got["steps"] == len(rho)
    assert got["rho_raw_std"] == pytest.approx(float(np.std(rho_a)), rel=1e-9)
    assert got["rho_raw_quantiles"]["p50"] == pytest.approx(float(np.median(rho_a)), rel=1e-9)
    assert got["clipped_low"] == pytest.approx(sum(r < 0.8 for r in rho) / len(rho))
    assert got["clipped_high"] == pytest.approx(sum(r > 1.2 for r in rho) / len(rho))
    assert got["corr_rho_action_tokens"] == pytest.approx(sps.pearsonr(rho, tokens)[0], abs=1e-9)
    for d in range(10):
        members = [r for r, p in zip(rho, position) if int(p * 10) == d]
        want = sum(members) / len(members) if members else None
        assert got["rho_raw_by_position_decile"][d] == (pytest.approx(want, rel=1e-9) if want else None)
    micro = store.query("SELECT micro, a_macro FROM step_credits WHERE run = 'r' AND micro IS NOT NULL")[1]
    ratio = np.mean([abs(m) for m, _ in micro]) / np.mean([abs(a) for _, a in micro])
    assert got["micro_macro_ratio"] == pytest.approx(float(ratio), rel=1e-9)
    flips = [np.sign(a + m) != np.sign(a) for m, a in micro if a != 0]
    assert got["micro_sign_flips"] == pytest.approx(sum(flips) / len(flips))
    assert got["rho_raw_std"] > INERT_STD and got["clipped_low"] + got["clipped_high"] < CLIPPED_SHARE
    assert abs(got["corr_rho_action_tokens"]) < LENGTH_CORR and got["warnings"] == []
    assert got["verdict"] == f"verdict: usable: {NO_WARNING}"
    json.dumps(got, allow_nan=False)  # valid JSON: no NaN anywhere


def test_inert_ratio_warns(tmp_path):
    trajs = _trajs(2, spread=0.0)  # every step of an episode has the same logprob: ρ_raw = 1
    store = _store_with(tmp_path, trajs)
    compute_credits(store, name="r")
    got = diagnose_run(store, "r")
    assert got["rho_raw_std"] == pytest.approx(0.0, abs=1e-12) and got["corr_rho_action_tokens"] is None
    assert _codes(got) == {"inert"}
    assert "hindsight template" in got["warnings"][0]["message"]
    assert got["verdict"] == (
        f"verdict: inert: ρ_raw hardly varies (std 0.0000 < {INERT_STD}): the hindsight ratio carries almost no "
        "information, so the credit is GRPO plus a positional discount"
    )


def test_length_channel_warns(tmp_path):
    trajs = _trajs(3, spread=0.05, length_slope=0.004)  # longer actions get higher logprobs
    store = _store_with(tmp_path, trajs)
    compute_credits(store, name="r")
    got = diagnose_run(store, "r")
    assert got["corr_rho_action_tokens"] > LENGTH_CORR
    assert "length_channel" in _codes(got) and "clipped" not in _codes(got)
    assert "s_final" in next(w["message"] for w in got["warnings"] if w["code"] == "length_channel")


def test_mostly_clipped_warns(tmp_path):
    trajs = _trajs(4, spread=3.0)
    store = _store_with(tmp_path, trajs)
    compute_credits(store, name="r")
    got = diagnose_run(store, "r")
    assert got["clipped_low"] + got["clipped_high"] > CLIPPED_SHARE and "clipped" in _codes(got)
    assert "--t-temp" in next(w["message"] for w in got["warnings"] if w["code"] == "clipped")


def test_groups_second_run_and_baseline(tmp_path):
    trajs = _trajs(5, spread=0.4)
    store = _store_with(tmp_path, trajs)
    compute_credits(store, CreditParams(group_by="grp"), name="o")
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp"), name="p")
    got = diagnose_run(store, "o", other_run="p", group_by="grp")
    assert set(got["groups"]) == {"0", "1"} and sum(g["steps"] for g in got["groups"].values()) == got["steps"]
    rows = store.query(
        "SELECT a.advantage, b.advantage FROM step_credits a JOIN step_credits b ON a.step_id = b.step_id "
        "WHERE a.run = 'o' AND b.run = 'p' ORDER BY a.step_id"
    )[1]
    assert got["comparison"]["compared"] == "advantage" and got["comparison"]["common_steps"] == len(rows)
    want = sps.spearmanr([r[0] for r in rows], [r[1] for r in rows]).statistic
    assert got["comparison"]["spearman"] == pytest.approx(float(want), abs=1e-9)

    # A baseline scorer of every step: the lift is the difference of the two means.
    rng = random.Random(9)
    with db.write(store.engine) as conn:
        steps = conn.execute(text("SELECT step_id, token_count FROM scores WHERE scorer_id = 'sc'")).all()
        conn.execute(text("INSERT INTO scorers (id, label, spec, created_at) VALUES ('base', 'b', '{}', '2026-11-25')"))
        for sid, n in steps:
            add_score(conn, "base", sid, -1.0 + rng.gauss(0, 0.3), n)
    got = diagnose_run(store, "o", baseline_scorer="base")
    pairs = store.query(
        "SELECT a.mean_logprob - b.mean_logprob, c.rho_raw FROM scores a JOIN scores b ON a.step_id = b.step_id "
        "JOIN step_credits c ON c.step_id = a.step_id WHERE a.scorer_id = 'sc' AND b.scorer_id = 'base' "
        "AND c.run = 'o'"
    )[1]
    assert got["baseline"]["steps"] == len(pairs)
    assert got["baseline"]["lift_mean"] == pytest.approx(float(np.mean([p[0] for p in pairs])), abs=1e-9)
    want = sps.pearsonr([p[0] for p in pairs], [p[1] for p in pairs])[0]
    assert got["baseline"]["corr_lift_rho"] == pytest.approx(float(want), abs=1e-9)

    with db.write(store.engine) as conn:  # the baseline no longer covers the run
        conn.execute(text("DELETE FROM scores WHERE scorer_id = 'base' AND step_id = :s"), {"s": steps[0][0]})
    with pytest.raises(CreditError, match="--baseline base: .* no score for 1 of the run's"):
        diagnose_run(store, "o", baseline_scorer="base")


def test_spearman_with_ties_matches_scipy():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 200).astype(float), rng.integers(0, 7, 200).astype(float)
    assert spearman(a, b) == pytest.approx(float(sps.spearmanr(a, b).statistic), abs=1e-12)
    assert spearman(np.ones(5), np.arange(5.0)) is None


def test_cli_json_and_one_line_errors(tmp_path, runner):
    store = _store_with(tmp_path, _trajs(6, spread=0.4))
    compute_credits(store, name="r")
    db_path = str(tmp_path / "s.db")
    r = runner.invoke(cli, ["--db", db_path, "diagnose", "r", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    for key in ("rho_raw_std", "clipped_low", "clipped_high", "corr_rho_action_tokens", "warnings"):
        assert key in data
    r = runner.invoke(cli, ["--db", db_path, "diagnose", "r"], catch_exceptions=False)
    assert r.exit_code == 0 and "ρ_raw" in r.output and "no warning" in r.output
    assert r.output.splitlines()[0] == data["verdict"] == f"verdict: usable: {NO_WARNING}"  # the answer first
    for args, needle in (
        (["nope"], "nope"),
        (["r", "--group-by", "nope"], "--group-by nope"),
        (["r", "--baseline", "zzz"], "zzz"),
    ):
        r = runner.invoke(cli, ["--db", db_path, "diagnose", *args])
        assert r.exit_code != 0 and needle in r.output and "Traceback" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_report_shows_the_diagnostics_panel(tmp_path):
    from hcapo_store.outputs.report import write_report

    store = _store_with(tmp_path, _trajs(2, spread=0.0))
    compute_credits(store, name="r")
    write_report(store, tmp_path / "r.html", "r")
    page = (tmp_path / "r.html").read_text()
    assert 'id="diagnostics"' in page and "<strong>inert</strong>" in page
    assert "Mean rho_raw by position in the episode" in page
    (tmp_path / "h").mkdir()
    healthy = _store_with(tmp_path / "h", _trajs(1, spread=0.4))
    compute_credits(healthy, name="r")
    write_report(healthy, tmp_path / "h.html", "r")
    assert "No warning: rho has spread" in (tmp_path / "h.html").read_text()
