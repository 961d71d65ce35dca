"""Does the hindsight signal carry information? Numbers from a credit run's stored values.

docs/PAPER.md §2: an online implementation needed several evaluation rounds to find that its
ratio was inert (the spread of ρ collapsed) and that its micro term tracked action length.
``diagnose_run`` computes, from one SQL pass over the run (no model call), the spread of ρ_raw,
the share clipped at each bound, the correlations of ρ_raw and of the micro term with the
action's token count, ρ_raw by position decile, the size of the micro term against the macro
term and how often it flips the sign of the advantage; per group (a tag) when asked; with a
second run, the rank agreement of the two runs' step advantages; with a baseline scorer
(``score --no-hindsight``), the per-step lift log π_hind − log π and its correlation with
ρ_raw — a diagnostic, never an estimator. Warnings name what a number means and what to try.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.credits.lookup import RunInfo, get_run, resolve_run
from hcapo_store.credits.signal import CreditSignal
from hcapo_store.errors import CreditError
from hcapo_store.ingestion import fields
from hcapo_store.scoring.scorer import resolve_scorer
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

# Thresholds of the warnings (docs/CREDITS.md "diagnose").
INERT_STD = 0.02  # std of ρ_raw below this: the ratio hardly moves
LENGTH_CORR = 0.3  # |Pearson r| of ρ_raw or micro with the action's token count above this
CLIPPED_SHARE = 0.5  # share of steps with ρ_raw outside [c_min, c_max] above this

FETCH_ROWS = 100_000

STEPS_SQL = """
SELECT c.step_id, c.rho_raw, COALESCE(sc.mean_logprob, c.mean_logprob), c.micro, c.a_macro, c.advantage, c.q_h_smoothed,
       s.step_index, e.num_steps, COALESCE(sc.total_action_tokens, c.token_count), {group}, sc.token_count
FROM credits c
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
LEFT JOIN scores sc ON sc.step_id = c.step_id AND sc.scorer_id = :scorer
{join}
WHERE c.run_id = :run
ORDER BY c.step_id
"""

_FLOATS = ("rho_raw", "mean_logprob", "micro", "a_macro", "advantage", "q_h_smoothed")


@dataclass
class _Steps:
    step_id: np.ndarray
    rho_raw: np.ndarray
    mean_logprob: np.ndarray
    micro: np.ndarray  # NaN where not stored (runs from before revision 0003)
    a_macro: np.ndarray
    advantage: np.ndarray
    q_h_smoothed: np.ndarray
    position: np.ndarray  # step_index / episode length, in [0, 1)
    tokens: np.ndarray
    group: np.ndarray | None  # object array of tag values (None: untagged)
    scored_tokens: np.ndarray  # the run's scorer's token_count per step (-1: no score row)

    def subset(self, mask: np.ndarray) -> _Steps:
        fields: dict[str, Any] = {k: (None if v is None else v[mask]) for k, v in vars(self).items()}
        return _Steps(**fields)


def _load(conn: Connection, run: RunInfo, group_by: str | None) -> _Steps:
    group = "e.id" if group_by else "NULL"  # each episode's value: ingestion.fields, below
    result = conn.execute(text(STEPS_SQL.format(group=group, join="")), {"run": run.id, "scorer": run.scorer_id})
    cols: list[list[Any]] = [[] for _ in range(12)]
    for block in result.partitions(FETCH_ROWS):
        for i, col in enumerate(zip(*block)):
            cols[i].extend(col)

    def floats(values: list[Any]) -> np.ndarray:
        return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)

    index, length = np.asarray(cols[7], dtype=np.float64), np.asarray(cols[8], dtype=np.float64)
    return _Steps(
        step_id=np.asarray(cols[0], dtype=np.int64),
        **{name: floats(cols[1 + i]) for i, name in enumerate(_FLOATS)},
        position=np.divide(index, length, out=np.zeros_like(index), where=length > 0),
        tokens=np.asarray(cols[9], dtype=np.float64),
        group=_group_values(conn, cols[10], group_by),
        scored_tokens=np.asarray([-1 if v is None else v for v in cols[11]], dtype=np.int64),
    )


def _group_values(conn: Connection, episode_ids: list[Any], group_by: str | None) -> np.ndarray | None:
    if not group_by:
        return None
    unique = sorted(set(episode_ids))
    value = dict(zip(unique, fields.group_values(conn, unique, group_by), strict=True))
    return np.asarray([value[e] for e in episode_ids], dtype=object)


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    if len(x) < 2 or _constant(x) or _constant(y):
        return None  # a constant has no correlation (null, not NaN)
    return float(np.corrcoef(x, y)[0, 1])


def _constant(x: np.ndarray) -> bool:
    """Constant up to rounding (ρ_raw = 1 ± 1e-16 when an episode's logprobs are equal)."""
    return bool(x.std() <= 1e-12 * (1.0 + float(np.abs(x).max())))


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), as Spearman's rho needs."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_x[1:] != sorted_x[:-1])))
    ends = np.append(starts[1:], len(x))
    avg = (starts + ends - 1) / 2.0
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    return _pearson(_ranks(x), _ranks(y)) if len(x) >= 2 else None


def _number(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _stats(steps: _Steps, c_min: float, c_max: float, omega: float) -> dict[str, Any]:
    rho = steps.rho_raw
    n = len(rho)
    out: dict[str, Any] = {"steps": n}
    if n == 0:
        return out
    q = np.quantile(rho, [0.05, 0.25, 0.5, 0.75, 0.95])
    decile = np.minimum((steps.position * 10).astype(np.int64), 9)
    sums = np.bincount(decile, weights=rho, minlength=10)
    counts = np.bincount(decile, minlength=10)
    stored = not np.isnan(steps.micro).all()
    out.update(
        rho_raw_mean=float(rho.mean()),
        rho_raw_std=float(rho.std()),
        rho_raw_quantiles=dict(zip(("p05", "p25", "p50", "p75", "p95"), map(float, q))),
        clipped_low=float((rho < c_min).mean()),
        clipped_high=float((rho > c_max).mean()),
        corr_rho_action_tokens=_pearson(rho, steps.tokens),
        corr_micro_action_tokens=_pearson(steps.micro, steps.tokens) if stored else None,
        rho_raw_by_position_decile=[float(s / c) if c else None for s, c in zip(sums.tolist(), counts.tolist())],
    )
    if stored:
        ok = ~(np.isnan(steps.micro) | np.isnan(steps.a_macro))
        micro, macro = omega * steps.micro[ok], steps.a_macro[ok]
        macro_size = float(np.abs(macro).mean()) if len(macro) else 0.0
        signed = macro != 0
        out.update(
            micro_macro_ratio=_number(float(np.abs(micro).mean()) / macro_size) if macro_size else None,
            micro_sign_flips=float((np.sign(macro[signed] + micro[signed]) != np.sign(macro[signed])).mean())
            if signed.any()
            else None,
        )
    else:
        out.update(micro_macro_ratio=None, micro_sign_flips=None)
    return out


def _warnings(
    s: dict[str, Any], c_min: float, c_max: float, signal: CreditSignal | None = None
) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    if not s.get("steps"):
        return out
    zero = signal is not None and signal.hindsight_nonzero_steps == 0 and signal.steps > 0  # rho = 1 is "inert"
    if zero:
        assert signal is not None
        out.append(
            {
                "code": "zero",
                "message": f"the hindsight term is zero on all {signal.steps} steps: the advantage is "
                + ("GRPO's group term alone" if signal.plain_grpo else "0 everywhere (no reward spread)")
                + ". On outcome-only rollouts recompute with terminal rewards (--no-dense-rewards or "
                "--variant paper); with dense rewards the steps need subtask rewards; --omega 0 removes the term.",
            }
        )
    if s["rho_raw_std"] < INERT_STD and not zero:
        out.append(
            {
                "code": "inert",
                "message": f"ρ_raw hardly varies (std {s['rho_raw_std']:.4f} < {INERT_STD}): the hindsight "
                "ratio carries almost no information, so the credit is GRPO plus a positional discount. "
                "Try another hindsight template (a shorter, more telling outcome), a lower --t-temp, or "
                "--action-span policy so template tokens do not dilute the mean.",
            }
        )
    for key, what in (("corr_rho_action_tokens", "ρ_raw"), ("corr_micro_action_tokens", "the micro term")):
        r = s.get(key)
        if r is not None and abs(r) > LENGTH_CORR:
            out.append(
                {
                    "code": "length_channel",
                    "message": f"{what} correlates with the action's token count (r = {r:+.2f}, |r| > "
                    f"{LENGTH_CORR}): action length, not the outcome, drives the credit. Try a shorter "
                    "s_final (outcome text) in the hindsight template, --action-span policy, and compare "
                    "with a baseline scorer (score --no-hindsight, then diagnose --baseline).",
                }
            )
            break
    clipped = s["clipped_low"] + s["clipped_high"]
    if clipped > CLIPPED_SHARE:
        out.append(
            {
                "code": "clipped",
                "message": f"{clipped:.0%} of the steps have ρ_raw outside [{c_min:g}, {c_max:g}] and are "
                "clipped: the ratio mostly saturates at a bound. Raise --t-temp to flatten π_hind, or "
                "widen --c-min/--c-max.",
            }
        )
    return out


NO_WARNING = "ρ has spread, is not tied to action length and is not mostly clipped"


def verdict(d: dict[str, Any]) -> str:
    """``diagnose``'s answer in one line: is the hindsight signal usable, and if not, why
    (the first warning's first sentence; the others are counted, their advice is in diagnose)."""
    if not d.get("steps"):
        return f"verdict: credit run {d['run']!r} has no credited step: nothing to judge"
    warnings = d["warnings"]
    if not warnings:
        return f"verdict: usable: {NO_WARNING}"
    first = warnings[0]["message"].split(". ", 1)[0].rstrip(".")
    more = f" (and {len(warnings) - 1} more warning(s): hcapo-store diagnose)" if len(warnings) > 1 else ""
    return f"verdict: {warnings[0]['code']}: {first}{more}"


def diagnose_run(
    store: Store,
    run_name: RunInfo | str | None,
    *,
    other_run: str | None = None,
    group_by: str | None = None,
    baseline_scorer: str | None = None,
) -> dict[str, Any]:
    """The numbers of the module doc for one credit run, as one JSON-ready dict."""
    run = resolve_run(store, run_name)
    params = run.credit_params
    with db.read(store.engine) as conn:
        steps = _load(conn, run, group_by)
        overall = _stats(steps, params.c_min, params.c_max, params.omega)
        result: dict[str, Any] = {
            "run": run.name,
            "variant": run.variant,
            "scorer_id": run.scorer_id,
            "scorer_label": run.scorer_label,
            "params": run.params,
            **overall,
            "signal": run.signal,  # credits/signal.py: is the hindsight term in the advantages at all
            "warnings": _warnings(overall, params.c_min, params.c_max, run.credit_signal),
        }
        if np.isnan(steps.micro).all() and len(steps.micro):
            result["note"] = (
                "this run was computed before advantages were stored (schema revision 0003): micro/macro "
                "numbers are null; `credits compute --recompute` with its parameters stores them"
            )
        result["verdict"] = verdict(result)
        if group_by:
            result["groups"] = _by_group(steps, group_by, params)
        if other_run:
            result["comparison"] = _compare(conn, steps, store, other_run)
        if baseline_scorer:
            result["baseline"] = _baseline(conn, steps, baseline_scorer)
    return result


def _by_group(steps: _Steps, group_by: str, params: Any) -> dict[str, Any]:
    assert steps.group is not None
    if all(g is None for g in steps.group):
        raise CreditError(
            f"--group-by {group_by}: no episode of this run has this {fields.kind(group_by)}; "
            "tag episodes at ingest (--tag KEY=VALUE) or pick another tag or field:NAME"
        )
    labels = np.asarray(["(untagged)" if g is None else str(g) for g in steps.group], dtype=object)
    out = {}
    for label in sorted(set(labels.tolist())):
        stats = _stats(steps.subset(labels == label), params.c_min, params.c_max, params.omega)
        out[label] = {**stats, "warnings": _warnings(stats, params.c_min, params.c_max)}
    return out


def _compare(conn: Connection, steps: _Steps, store: Store, other_name: str) -> dict[str, Any]:
    other = get_run(store, other_name)
    rows = conn.execute(
        text("SELECT step_id, advantage, q_h_smoothed FROM credits WHERE run_id = :r ORDER BY step_id"),
        {"r": other.id},
    ).all()
    other_ids = np.asarray([r[0] for r in rows], dtype=np.int64)
    common, mine, theirs = np.intersect1d(steps.step_id, other_ids, return_indices=True)
    b_adv = np.asarray([np.nan if r[1] is None else r[1] for r in rows], dtype=np.float64)[theirs]
    a_adv = steps.advantage[mine]
    stored = not (np.isnan(a_adv).any() or np.isnan(b_adv).any()) and len(common) > 0
    if stored:
        a, b, what = a_adv, b_adv, "advantage"
    else:  # a run from before 0003 (or an original run's steps below min_reward): compare q_h_smoothed
        a = steps.q_h_smoothed[mine]
        b = np.asarray([r[2] for r in rows], dtype=np.float64)[theirs]
        what = "q_h_smoothed"
    return {
        "run": other.name,
        "common_steps": int(len(common)),
        "compared": what,
        "spearman": spearman(a, b),
    }


def _baseline(conn: Connection, steps: _Steps, scorer: str) -> dict[str, Any]:
    scorer_id, label = resolve_scorer(conn, scorer)
    rows = conn.execute(
        text("SELECT step_id, mean_logprob, token_count FROM scores WHERE scorer_id = :s ORDER BY step_id"),
        {"s": scorer_id},
    ).all()
    ids = np.asarray([r[0] for r in rows], dtype=np.int64)
    common, mine, theirs = np.intersect1d(steps.step_id, ids, return_indices=True)
    missing = len(steps.step_id) - len(common)
    if missing:
        raise CreditError(
            f"--baseline {scorer}: scorer {scorer_id[:12]} has no score for {missing} of the run's "
            f"{len(steps.step_id)} step(s); score them with that scorer first (same options plus --no-hindsight)"
        )
    counts = np.asarray([r[2] for r in rows], dtype=np.int64)[theirs]
    differ = int((counts != steps.scored_tokens[mine]).sum())
    if differ:
        raise CreditError(
            f"--baseline {scorer}: scorer {scorer_id[:12]} scored other tokens than the run's scorer for {differ} "
            "step(s) (another --action-span, --max-context or --max-logprob-tokens); score a baseline with the "
            "run's scorer options plus --no-hindsight"
        )
    base = np.asarray([r[1] for r in rows], dtype=np.float64)[theirs]
    lift = steps.mean_logprob[mine] - base
    q = np.quantile(lift, [0.05, 0.5, 0.95]) if len(lift) else [np.nan] * 3
    return {
        "scorer_id": scorer_id,
        "scorer_label": label,
        "steps": int(len(lift)),
        "lift_mean": _number(float(lift.mean())) if len(lift) else None,
        "lift_std": _number(float(lift.std())) if len(lift) else None,
        "lift_quantiles": {k: _number(float(v)) for k, v in zip(("p05", "p50", "p95"), q)},
        "corr_lift_rho": _pearson(lift, steps.rho_raw[mine]),
        "note": "lift = log π_hind − log π per step (mean over the scored tokens): how much the outcome "
        "changes the policy's view of the action; a diagnostic, not the estimator (docs/PAPER.md §2)",
    }
