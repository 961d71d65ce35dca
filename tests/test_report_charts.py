"""Readable report charts: whole-number count axes, distinct tick labels, Q_H from 0, subtask ids, full labels."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
from test_credits import add_scorer, add_scores

from hcapo_store.credits.compute import compute_credits
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.report import (
    PAD_L,
    _ticks,
    svg_bars,
    svg_histogram,
    svg_stacked,
    write_report,
)
from hcapo_store.storage.store import Store

NS = "{http://www.w3.org/2000/svg}"


def _labels(svg: str, *, anchor: str) -> list[str]:
    """Tick labels: the y axis is right-aligned ("end"), the x axis centred ("middle")."""
    root = ET.fromstring(svg)
    return [
        t.text or ""
        for t in root.iter(f"{NS}text")
        if t.get("text-anchor") == anchor
        and t.get("font-size") == "10"
        and (anchor != "end" or t.get("x") == str(PAD_L - 4))
    ]


def test_count_axes_have_whole_number_ticks() -> None:
    rng = np.random.default_rng(0)
    for n in (3, 7, 11, 65, 1234):
        svg = svg_histogram(rng.normal(size=n), "t", "x")
        ys = _labels(svg, anchor="end")
        assert ys and all(re.fullmatch(r"[\d,]+", y) for y in ys), ys
        assert len(set(ys)) == len(ys)
    bars = svg_bars(["http_503", "timeout"], [7.0, 3.0], "t", "attempts", integer=True)
    assert all(re.fullmatch(r"\d+", y) for y in _labels(bars, anchor="end"))


def test_tick_labels_are_distinct_on_narrow_ranges() -> None:
    for lo, hi in ((0.2184, 0.2213), (-7.61, -7.54), (0.0, 1e-5), (1000.0, 1000.3), (0.9, 1.1)):
        ticks, decimals = _ticks(lo, hi, n=6)
        labels = [f"{v:.{decimals}f}" for v in ticks]
        assert len(ticks) >= 2 and len(set(labels)) == len(labels), (lo, hi, labels)
        assert all(lo - 1e-12 <= v <= hi + 1e-12 for v in ticks)
    svg = svg_histogram(np.linspace(0.2184, 0.2213, 50), "pi_hind", "pi_hind")
    xs = _labels(svg, anchor="middle")[:-1]  # the last centred text is the axis title
    assert len(set(xs)) == len(xs) >= 2


def test_q_h_histogram_starts_at_zero() -> None:
    svg = svg_histogram(np.linspace(0.3, 0.9, 40), "Q_H", "q_h", from_zero=True)
    xs = _labels(svg, anchor="middle")
    assert xs[0] in ("0", "0.0", "0.00")


def test_long_scorer_labels_are_not_cut() -> None:
    label = "sglang:/models/Qwen3-8B-Instruct ctx=32768 lp=2048"
    svg = svg_stacked([(label, {"scored": 10, "failed": 1, "leased": 0, "missing": 2})], "coverage")
    texts = [t.text for t in ET.fromstring(svg).iter(f"{NS}text")]
    assert label in texts and "missing" in texts
    width = float(ET.fromstring(svg).get("width"))
    legend_x = [float(r.get("x")) for r in ET.fromstring(svg).iter(f"{NS}rect") if r.get("width") == "12"]
    assert max(legend_x) + 80 < width  # the last legend entry fits


def test_report_labels_subtasks_by_id(store: Store, samples: Path, tmp_path: Path) -> None:
    ingest(store, [samples])
    add_scorer(store, "s")
    add_scores(store, "s")
    compute_credits(store)
    page = write_report(store, tmp_path / "r.html").path.read_text()
    ids = [
        r[0] for r in store.query("SELECT DISTINCT subtask_id FROM steps WHERE subtask_id IS NOT NULL ORDER BY 1")[1]
    ]
    # the subtask chart: the one whose x labels name subtasks (its position moves as charts are added)
    charts = [_labels(svg, anchor="middle") for svg in re.findall(r"<svg.*?</svg>", page, flags=re.DOTALL)]
    by_subtask = [xs for xs in charts if "planning" in xs]
    assert len(by_subtask) == 1
    xs = by_subtask[0]
    assert xs[0] == "planning" and set(ids) <= set(xs)


def test_histogram_statistics_name_their_quantity() -> None:
    svg = svg_histogram(np.array([0.5, 0.7, 0.9]), "pi_hind = exp(mean logprob / T)", "pi_hind (T = 1.0)")
    texts = [t.text or "" for t in ET.fromstring(svg).iter(f"{NS}text")]
    assert "3 steps · mean pi_hind 0.7 · median pi_hind 0.7" in texts
    assert not any(t.startswith("n=") or " mean=" in t for t in texts)


def test_the_diverging_scale_reads_for_everyone() -> None:
    """Every heat-map background has a text colour at WCAG AA (4.5:1) on it, message tints keep
    the body text at AA, and the scale's ends are not red/green."""
    from hcapo_store.outputs.colors import HIGH, LOW, PAGE_TEXT, contrast, diverging, diverging_rgb, text_on, tint

    for x in np.linspace(-1, 1, 401):
        bg = diverging_rgb(float(x))
        assert contrast(text_on(bg), bg) >= 4.5, (x, bg)
        rgb = tuple(int(tint(float(x))[i : i + 2], 16) for i in (1, 3, 5))
        assert contrast(PAGE_TEXT, rgb) >= 4.5, (x, rgb)
    assert diverging(0.0) == ("#ffffff", "#000000") and diverging(1.0)[1] == "#ffffff"
    for r, g, b in (LOW, HIGH):  # orange and purple: neither end is a green
        assert not (g > r and g > b)
    # the ends stay apart in lightness, which survives any colour-vision deficiency
    assert contrast(LOW, HIGH) >= 2.0
