"""One self-contained HTML page about a credit run: distributions, subtask credit, coverage.

Charts are inline SVG generated here (no plotting dependency, nothing fetched when the
page is opened): histograms of mean logprob, pi_hind, rho (clip bounds marked), Q_H and
smoothed Q_H; mean Q_H per subtask position (planning its own bar); scoring coverage per
scorer; failure kinds; and the run's hyperparameters.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import text

from hcapo_store.clock import utcnow
from hcapo_store.credits.diagnose import diagnose_run
from hcapo_store.credits.lookup import RunInfo, get_run, resolve_run
from hcapo_store.errors import ExportError
from hcapo_store.outputs.files import atomic_write, check_output
from hcapo_store.scoring.scorer import scorer_counts
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

W, H = 560, 250  # chart size in px
PAD_L, PAD_R, PAD_T, PAD_B = 56, 16, 28, 42
BAR = "#4c78a8"
# Okabe–Ito: told apart with any colour vision (red/green are not)
COLORS = {"scored": "#0072b2", "failed": "#d55e00", "leased": "#e69f00", "missing": "#bbbbbb"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666;font-size:13px} .grid{display:flex;flex-wrap:wrap;gap:16px}
.verdict{font-size:15px;padding:8px 12px;border-left:4px solid #555;background:#f5f5f5}
figure{margin:0;border:1px solid #e5e5e5;border-radius:6px;padding:6px;background:#fff}
figcaption{font-size:12px;color:#555;padding:2px 6px}
table{border-collapse:collapse;font-size:13px;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 10px;text-align:right}
th{background:#f5f5f5} td:first-child,th:first-child{text-align:left}
svg text{font-family:system-ui,Helvetica,Arial,sans-serif}
"""


# ---- SVG primitives ------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) < 0.01:
        return f"{x:.2g}"
    return f"{x:.3g}"


def _tick_step(span: float, n: int, integer: bool) -> float:
    """A 1/2/5 x 10^k step giving about ``n`` intervals over ``span`` (at least 1 for counts)."""
    raw = (span or 1.0) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if raw <= m * mag * (1 + 1e-9))
    return max(1.0, round(step)) if integer else step


def _ticks(lo: float, hi: float, *, n: int = 5, integer: bool = False) -> tuple[list[float], int]:
    """Multiples of a round step inside [lo, hi], and the decimals that print them all distinct."""
    step = _tick_step(hi - lo, n, integer)
    first = math.ceil(lo / step - 1e-9)
    ticks = [(first + i) * step for i in range(int(math.floor(hi / step + 1e-9)) - first + 1)]
    return ticks, 0 if integer else max(0, -math.floor(math.log10(step) + 1e-9))


def _tick_label(v: float, decimals: int) -> str:
    return f"{v:,.{decimals}f}" if abs(v) >= 1000 else f"{v:.{decimals}f}"


def _frame(title: str, body: list[str], *, xlabel: str = "", ylabel: str = "") -> str:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        f'role="img" aria-label="{html.escape(title)}">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="17" text-anchor="middle" font-size="13" font-weight="600">{html.escape(title)}</text>',
        *body,
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" stroke="#333"/>',
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#333"/>',
    ]
    if xlabel:
        parts.append(
            f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{H - 6}" text-anchor="middle" font-size="11">'
            f"{html.escape(xlabel)}</text>"
        )
    if ylabel:
        parts.append(
            f'<text x="12" y="{(PAD_T + H - PAD_B) / 2}" text-anchor="middle" font-size="11" '
            f'transform="rotate(-90 12 {(PAD_T + H - PAD_B) / 2})">{html.escape(ylabel)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def _y_axis(top: float, bottom: float = 0.0, *, integer: bool = False) -> tuple[list[str], Any]:
    """Horizontal grid lines at round values (whole numbers for counts), the axis widened to
    the nearest ones; returns (svg parts, value → y pixel)."""
    step = _tick_step((top - bottom) or 1.0, 4, integer)
    top, bottom = math.ceil(top / step - 1e-9) * step, math.floor(bottom / step + 1e-9) * step
    span = (top - bottom) or 1.0
    plot_h = H - PAD_T - PAD_B

    def y(v: float) -> float:
        return H - PAD_B - (v - bottom) / span * plot_h

    parts = []
    ticks, decimals = _ticks(bottom, top, n=4, integer=integer)
    for v in ticks:
        parts.append(f'<line x1="{PAD_L}" y1="{y(v):.1f}" x2="{W - PAD_R}" y2="{y(v):.1f}" stroke="#eee"/>')
        parts.append(
            f'<text x="{PAD_L - 4}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="10">'
            f"{_tick_label(v, decimals)}</text>"
        )
    return parts, y


def svg_histogram(
    values: np.ndarray,
    title: str,
    xlabel: str,
    *,
    bins: int = 40,
    markers: Sequence[tuple[float, str]] = (),
    from_zero: bool = False,
) -> str:
    """A histogram with optional vertical markers (e.g. the clip bounds of rho); ``from_zero``
    starts the x axis at 0 (or below, for negative values)."""
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return _frame(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>'])
    lo, hi = float(values.min()), float(values.max())
    for at, _ in markers:
        lo, hi = min(lo, at), max(hi, at)
    if from_zero:
        lo = min(lo, 0.0)
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.02
    lo, hi = (lo if from_zero and lo == 0 else lo - pad), hi + pad
    counts, edges = np.histogram(values, bins=bins, range=(lo, hi))
    parts, y = _y_axis(float(counts.max()) * 1.1, integer=True)  # headroom for the stats line
    plot_w = W - PAD_L - PAD_R

    def x(v: float) -> float:
        return PAD_L + (v - lo) / (hi - lo) * plot_w

    for c, a, b in zip(counts, edges[:-1], edges[1:]):
        if c:
            parts.append(
                f'<rect x="{x(a):.1f}" y="{y(c):.1f}" width="{max(x(b) - x(a) - 1, 1):.1f}" '
                f'height="{y(0) - y(c):.1f}" fill="{BAR}"/>'
            )
    ticks, decimals = _ticks(lo, hi, n=6)
    for v in ticks:
        parts.append(f'<line x1="{x(v):.1f}" y1="{H - PAD_B}" x2="{x(v):.1f}" y2="{H - PAD_B + 4}" stroke="#333"/>')
        parts.append(
            f'<text x="{x(v):.1f}" y="{H - PAD_B + 15}" text-anchor="middle" font-size="10">'
            f"{_tick_label(v, decimals)}</text>"
        )
    mid = (lo + hi) / 2
    for v, label in markers:
        parts.append(
            f'<line x1="{x(v):.1f}" y1="{PAD_T}" x2="{x(v):.1f}" y2="{H - PAD_B}" stroke="#d55e00" '
            f'stroke-width="2" stroke-dasharray="5,3"/>'
        )
        # Label on the inner side of the line so that it stays inside the plot.
        dx, anchor = (4, "start") if v <= mid else (-4, "end")
        parts.append(
            f'<text x="{x(v) + dx:.1f}" y="{PAD_T + 26}" text-anchor="{anchor}" font-size="10" '
            f'fill="#d55e00">{html.escape(label)}</text>'
        )
    # the statistics name their quantity, as precisely as the x axis does
    quantity = xlabel.split(" (")[0]
    stats = (
        f"{len(values):,} steps · mean {quantity} {_fmt(float(values.mean()))} · "
        f"median {quantity} {_fmt(float(np.median(values)))}"
    )
    parts.append(f'<text x="{W - PAD_R}" y="{PAD_T + 10}" text-anchor="end" font-size="10" fill="#555">{stats}</text>')
    return _frame(title, parts, xlabel=xlabel, ylabel="steps")


def svg_bars(
    labels: Sequence[str],
    values: Sequence[float],
    title: str,
    ylabel: str,
    notes: Sequence[str] = (),
    *,
    integer: bool = False,
) -> str:
    """Vertical bars (values may be negative) with a label under each bar; ``integer``: counts."""
    if not labels:
        return _frame(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>'])
    top, bottom = max(max(values), 0.0), min(min(values), 0.0)
    span = (top - bottom) or 1.0
    parts, y = _y_axis(top + 0.12 * span, bottom, integer=integer)  # headroom for the value labels
    slot = (W - PAD_L - PAD_R) / len(labels)
    for i, (label, v) in enumerate(zip(labels, values)):
        x0 = PAD_L + i * slot + slot * 0.15
        y0, y1 = sorted((y(v), y(0)))
        parts.append(
            f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{slot * 0.7:.1f}" height="{max(y1 - y0, 0.5):.1f}" fill="{BAR}"/>'
        )
        parts.append(
            f'<text x="{x0 + slot * 0.35:.1f}" y="{H - PAD_B + 14}" text-anchor="middle" font-size="10">'
            f"{html.escape(label)}</text>"
        )
        note = notes[i] if i < len(notes) else ""
        parts.append(
            f'<text x="{x0 + slot * 0.35:.1f}" y="{y0 - 3:.1f}" text-anchor="middle" font-size="9" '
            f'fill="#555">{html.escape(_fmt(v) + note)}</text>'
        )
    return _frame(title, parts, ylabel=ylabel)


def svg_stacked(rows: Sequence[tuple[str, dict[str, int]]], title: str) -> str:
    """One horizontal stacked bar per row (e.g. scored / failed / leased / missing per scorer),
    its label above it at full width so that long scorer labels are not cut."""
    row_h = 44
    h = PAD_T + row_h * max(len(rows), 1) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" '
        f'role="img" aria-label="{html.escape(title)}">',
        f'<rect width="{W}" height="{h}" fill="white"/>',
        f'<text x="{W / 2}" y="17" text-anchor="middle" font-size="13" font-weight="600">{html.escape(title)}</text>',
    ]
    left, width = 12, W - 12 - PAD_R
    for i, (label, parts_count) in enumerate(rows):
        total = sum(parts_count.values()) or 1
        y0, x0 = PAD_T + row_h * i + 16, float(left)
        counts = ", ".join(f"{k} {n:,}" for k, n in parts_count.items() if n)
        shown = label if len(label) <= 60 else label[:59] + "…"
        parts.append(
            f'<text x="{left}" y="{y0 - 4}" font-size="11">{html.escape(shown)}'
            f"<title>{html.escape(label)}: {html.escape(counts)}</title></text>"
        )
        for key, n in parts_count.items():
            w = n / total * width
            if w > 0:
                parts.append(
                    f'<rect x="{x0:.1f}" y="{y0}" width="{w:.1f}" height="20" fill="{COLORS.get(key, BAR)}">'
                    f"<title>{key}: {n}</title></rect>"
                )
            x0 += w
    legend_y = PAD_T + row_h * max(len(rows), 1) + 14
    for j, key in enumerate(COLORS):
        parts.append(f'<rect x="{left + 100 * j}" y="{legend_y - 10}" width="12" height="12" fill="{COLORS[key]}"/>')
        parts.append(f'<text x="{left + 100 * j + 16}" y="{legend_y}" font-size="11">{key}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# ---- data ------------------------------------------------------------------------------------------

POSITION_SQL = """
SELECT CASE WHEN s.phase = 'planning' THEN -1 ELSE t.position END AS pos,
       AVG(c.q_h) AS q_h, AVG(c.q_h_smoothed) AS q_h_smoothed, COUNT(*) AS steps,
       MIN(s.subtask_id) AS first_id, MAX(s.subtask_id) AS last_id
FROM credits c
JOIN steps s ON s.id = c.step_id
LEFT JOIN subtasks t ON t.episode_id = s.episode_id AND t.subtask_id = s.subtask_id
WHERE c.run_id = :run
GROUP BY CASE WHEN s.phase = 'planning' THEN -1 ELSE t.position END
"""

FAILURES_SQL = """
SELECT a.scorer_id, ae.kind, COUNT(*) AS n
FROM attempt_errors ae JOIN attempts a ON a.id = ae.attempt_id
GROUP BY a.scorer_id, ae.kind
ORDER BY COUNT(*) DESC, ae.kind
"""


def _credit_arrays(store: Store, run_id: int) -> dict[str, np.ndarray]:
    cols = ("mean_logprob", "pi_hind", "rho", "q_h", "q_h_smoothed", "advantage")
    with db.read(store.engine) as conn:
        result = conn.execution_options(stream_results=True).execute(
            text(f"SELECT {', '.join(cols)} FROM credits WHERE run_id = :run"), {"run": run_id}
        )
        blocks = [np.asarray(b, dtype=np.float64).reshape(-1, len(cols)) for b in result.partitions(100_000)]
    data = np.concatenate(blocks) if blocks else np.zeros((0, len(cols)))
    return {c: data[:, i] for i, c in enumerate(cols)}


def _positions(store: Store, run_id: int) -> list[dict[str, Any]]:
    with db.read(store.engine) as conn:
        rows = [dict(r) for r in conn.execute(text(POSITION_SQL), {"run": run_id}).mappings()]
    rows.sort(key=lambda r: (r["pos"] is None, r["pos"] if r["pos"] is not None else 0))
    for r in rows:
        r["position"] = "" if r["pos"] in (-1, None) else str(r["pos"])
        r["label"] = "planning" if r["pos"] == -1 else "unmapped" if r["pos"] is None else _subtask_label(r)
    return rows


def _subtask_label(r: dict[str, Any]) -> str:
    """The subtask id at a plan position (``S1/S3`` when episodes' plans differ there)."""
    first, last = r["first_id"], r["last_id"]
    if first is None:
        return f"#{r['pos']}"
    return first if first == last else f"{first}/{last}"


def _failures(store: Store) -> list[dict[str, Any]]:
    with db.read(store.engine) as conn:
        return [dict(r) for r in conn.execute(text(FAILURES_SQL)).mappings()]


# ---- page --------------------------------------------------------------------------------------------


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return _fmt(v)
    return "" if v is None else str(v)


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _diagnostics_html(d: dict[str, Any]) -> str:
    """The numbers of ``hcapo-store diagnose`` (analysis/diagnose.py) with its warnings."""
    if not d.get("steps"):
        return "<p>No credited step.</p>"
    q = d["rho_raw_quantiles"]

    def num(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    rows = [
        ["std of rho_raw (spread of the hindsight ratio)", num(d["rho_raw_std"], ".4f")],
        ["rho_raw 5 % / 50 % / 95 % quantiles", f"{q['p05']:.3f} / {q['p50']:.3f} / {q['p95']:.3f}"],
        ["share of steps with rho_raw < c_min / > c_max", f"{d['clipped_low']:.1%} / {d['clipped_high']:.1%}"],
        ["Pearson r of rho_raw with the action's token count", num(d["corr_rho_action_tokens"], "+.2f")],
        ["Pearson r of the micro term with the action's token count", num(d["corr_micro_action_tokens"], "+.2f")],
        ["mean |omega · micro| / mean |A_i|", num(d["micro_macro_ratio"], ".2f")],
        ["share of steps whose advantage sign the micro term flips", num(d["micro_sign_flips"], ".1%")],
    ]
    deciles = d["rho_raw_by_position_decile"]
    labels = [f"{10 * i}–{10 * i + 10} %" for i in range(10)]
    bars = svg_bars(
        [lab for lab, v in zip(labels, deciles) if v is not None],
        [float(v) for v in deciles if v is not None],
        "Mean rho_raw by position in the episode (deciles)",
        "mean rho_raw",
    )
    warnings = "".join(
        f"<li><strong>{html.escape(w['code'])}</strong>: {html.escape(w['message'])}</li>" for w in d["warnings"]
    )
    verdict = (
        f'<ul class="warnings">{warnings}</ul>'
        if warnings
        else "<p>No warning: rho has spread, is not tied to action length and is not mostly clipped.</p>"
    )
    note = f'<p class="meta">{html.escape(d["note"])}</p>' if d.get("note") else ""
    return (
        verdict
        + note
        + _table(["statistic", "value"], rows)
        + f'<div class="grid">{_figure(bars, "A ratio that falls or rises with position is a positional discount, not evidence from the outcome.")}</div>'
    )


def build_report(store: Store, run_name: RunInfo | str | None = None, extra: str | None = None) -> str:
    """The report's HTML text (``extra``: HTML appended at the end, e.g. the episode index)."""
    run = resolve_run(store, run_name)
    if run.variant == "log-ratio":  # the page draws HCAPO's quantities (pi_hind, the clipped ratio, Q_H)
        raise ExportError(
            f"credit run {run.name!r} is a log-ratio run: the report draws HCAPO's quantities; its numbers are in "
            "the step_credits and episode_log_ratios views and `diagnose` (docs/FAMILY.md)"
        )
    p = run.params
    arrays = _credit_arrays(store, run.id)
    positions = _positions(store, run.id)
    coverage = scorer_counts(store)
    failures = _failures(store)
    clipped = int(((arrays["rho"] <= p["c_min"]) | (arrays["rho"] >= p["c_max"])).sum())

    dist = [
        _figure(
            svg_histogram(arrays["mean_logprob"], "Mean logprob per step", "mean logprob"),
            "Mean of the aggregated action-token logprobs under the hindsight prompt.",
        ),
        _figure(
            svg_histogram(arrays["pi_hind"], "pi_hind = exp(mean logprob / T)", f"pi_hind (T = {p['t_temp']})"),
            "Hindsight likelihood of each step.",
        ),
        _figure(
            svg_histogram(
                arrays["rho"],
                "rho (clipped ratio to the episode mean)",
                "rho",
                markers=[(p["c_min"], f"c_min {p['c_min']}"), (p["c_max"], f"c_max {p['c_max']}")],
            ),
            f"{clipped:,} of {len(arrays['rho']):,} steps sit on a clip bound.",
        ),
        _figure(svg_histogram(arrays["q_h"], "Q_H per step", "q_h", from_zero=True), "rho · discount · r_t."),
        _figure(
            svg_histogram(arrays["q_h_smoothed"], "Smoothed Q_H per step", "q_h_smoothed", from_zero=True),
            f"Backward smoothing, alpha = {p['alpha']} ({'on' if p['smooth'] else 'off'}).",
        ),
        _figure(
            svg_histogram(arrays["advantage"], "Advantage per step (what the trainer receives)", "advantage"),
            f"{int(np.count_nonzero(np.nan_to_num(arrays['advantage']))):,} of {len(arrays['advantage']):,} "
            "steps non-zero" + (" (signed: the paper's per-group statistics)." if p.get("variant") == "paper" else "."),
        ),
    ]
    pos_svg = svg_bars(
        [r["label"] for r in positions],
        [float(r["q_h"]) for r in positions],
        "Mean Q_H by subtask (plan order)",
        "mean q_h",
        notes=[f" (n={r['steps']})" for r in positions],
    )
    cov_svg = svg_stacked(
        [(c["label"] or c["scorer_id"][:12], {k: int(c.get(k) or 0) for k in COLORS}) for c in coverage],
        "Scoring coverage per scorer (current episodes)",
    )
    fail_svg = (
        svg_bars(
            [f["kind"] for f in failures[:12]],
            [float(f["n"]) for f in failures[:12]],
            "Failed attempts by kind",
            "attempts",
            integer=True,
        )
        if failures
        else ""
    )

    diag = diagnose_run(store, run)  # its verdict says "zero" when the hindsight term is
    hyper = [(k, json.dumps(v)) for k, v in p.items()]
    sections = [
        f"<h1>hcapo-store credit report: {html.escape(run.name)}</h1>",
        f'<p class="meta">database {html.escape(store.display)} · scorer {html.escape(run.scorer_id)} '
        f"({html.escape(run.scorer_label or '')}) · run created {html.escape(run.created_at)} · "
        f"report generated {utcnow().isoformat(timespec='seconds')}</p>",
        # the answer first: diagnose's one line, before the numbers it is drawn from
        f'<p class="verdict" id="verdict"><strong>{html.escape(diag["verdict"])}</strong> '
        '(<a href="#diagnostics">details</a>)</p>',
        '<h2 id="run">Credit run</h2>',
        _table(
            ["episodes", "steps", "incomplete episodes", "run hash"],
            [[run.episodes, run.steps, run.incomplete_episodes, run.run_hash[:16]]],
        ),
        # whether HCAPO's hindsight term is in the advantages at all (credits/signal.py)
        f'<p class="meta" id="signal">{html.escape(_signal_line(run))}</p>',
        '<h2 id="hyperparameters">Hyperparameters</h2>',
        _table(["parameter", "value"], hyper),
        '<h2 id="distributions">Distributions</h2>',
        f'<div class="grid">{"".join(dist)}</div>',
        '<h2 id="diagnostics">Does the hindsight signal carry information?</h2>',
        _diagnostics_html(diag),
        '<h2 id="subtasks">Q_H per subtask</h2>',
        f'<div class="grid">{_figure(pos_svg, "Planning is its own bar; unmapped = executing steps whose subtask is not in the plan.")}</div>',
        _table(
            ["subtask", "position", "steps", "mean q_h", "mean q_h_smoothed"],
            [[r["label"], r["position"], r["steps"], float(r["q_h"]), float(r["q_h_smoothed"])] for r in positions],
        ),
        '<h2 id="coverage">Scoring coverage</h2>',
        f'<div class="grid">{_figure(cov_svg, "Steps of current episodes per scorer.")}</div>',
        _table(
            ["scorer", "label", "scored", "failed", "leased", "missing"],
            [[c["scorer_id"][:16], c["label"], c["scored"], c["failed"], c["leased"], c["missing"]] for c in coverage],
        ),
        '<h3 id="floor">Tokens against the prefill floor</h3>',
        "<p>Over each scorer's fully scored episodes: the floor is the conversation's tokens (each token "
        "of each episode's conversation prefilled once); sent and prefilled (sent minus the tokens the "
        "server reported cached) as multiples of it.</p>",
        _table(
            ["scorer", "episodes", "floor tokens", "sent tokens", "sent / floor", "prefilled / floor"],
            [
                [
                    c["scorer_id"][:16],
                    c["floor_episodes"],
                    c["conversation_tokens"],
                    c["sent_tokens"],
                    "" if c["sent_per_floor"] is None else f"{c['sent_per_floor']:.2f}×",
                    "" if c["prefilled_per_floor"] is None else f"{c['prefilled_per_floor']:.2f}×",
                ]
                for c in coverage
            ],
        ),
        '<h2 id="failures">Failure reasons</h2>',
        (
            f'<div class="grid">{_figure(fail_svg, "Every failed attempt, by kind (all scorers).")}</div>'
            + _table(["scorer", "kind", "attempts"], [[f["scorer_id"][:16], f["kind"], f["n"]] for f in failures])
            if failures
            else "<p>No failed attempts recorded.</p>"
        ),
    ]
    if run.incomplete:
        shown = ", ".join(run.incomplete[:50]) + (" …" if len(run.incomplete) > 50 else "")
        sections.insert(4, f"<p>Incomplete (not credited): {html.escape(shown)}</p>")
    if run.stale:
        sections.insert(2, f'<p class="meta"><strong>Warning: {html.escape(run.stale)}</strong></p>')
    if extra:
        sections.append(extra)
    body = "\n".join(sections)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>hcapo-store report: {html.escape(run.name)}</title><style>{CSS}</style></head>"
        f"<body>\n{body}\n</body></html>\n"
    )


@dataclass(frozen=True)
class ReportResult:
    """What ``write_report`` wrote; ``as_dict()`` is its former dict."""

    path: Path
    run: str  # the credit run it describes
    bytes: int  # the page's size
    warnings: list[str]  # e.g. the run is stale

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "run": self.run, "bytes": self.bytes, "warnings": self.warnings}


def write_report(
    store: Store,
    out_html: Path | str,
    run_name: str | None = None,
    *,
    episode_pages: bool = False,
    tokenizer: str | Path | None = None,
) -> ReportResult:
    """Write the report atomically (never over the database or another SQLite file);
    returns the path, the run it describes, its size and warnings (a stale run).

    ``episode_pages``: also one page per credited episode in ``<stem>_episodes/`` beside the
    report, linked from an Episodes section (``tokenizer``: the scorer's, for heat maps).
    """
    out = Path(out_html)
    check_output(out, store.files)
    run = get_run(store, run_name)  # once: the pages and the report share it
    extra = None
    if episode_pages:
        from hcapo_store.outputs.episode_view import episode_index_html, write_episode_pages

        folder = f"{out.stem}_episodes"
        rows = write_episode_pages(store, out.parent / folder, run, tokenizer=tokenizer, back_link=f"../{out.name}")
        extra = '<h2 id="episodes">Episodes</h2>' + episode_index_html(rows, folder)
    page = build_report(store, run, extra).encode()
    atomic_write(out, lambda f: f.write(page), inputs=store.files)
    return ReportResult(out, run.name, len(page), [run.stale] if run.stale else [])


def _signal_line(run: Any) -> str:
    signal = run.credit_signal
    if signal is None:
        return "hindsight term: not measured (the run has no stored advantages)"
    return ("warning: " if signal.zero and signal.steps else "") + signal.text()
