"""The HTML report: one self-contained file with its sections and inline charts."""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from sqlalchemy import text
from test_credits import add_scorer, add_scores

from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.diagnose import diagnose_run
from hcapo_store.credits.equations import CreditParams
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.report import write_report
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


def _failures(store: Store, scorer: str, episode: str, kinds: list[str]) -> None:
    with db.write(store.engine) as conn:
        step = conn.execute(
            text(
                "SELECT s.id, s.episode_id, s.step_index FROM steps s JOIN episodes e ON "
                "e.id = s.episode_id WHERE e.name = :n AND s.step_index = 0"
            ),
            {"n": episode},
        ).one()
        attempt = conn.execute(
            text(
                "INSERT INTO attempts (step_id, scorer_id, episode_id, step_index, status, attempt_count, updated_at) "
                "VALUES (:s, :sc, :e, :i, 'failed', :n, 0) RETURNING id"
            ),
            {"s": step[0], "sc": scorer, "e": step[1], "i": step[2], "n": len(kinds)},
        ).scalar_one()
        conn.execute(
            text("INSERT INTO attempt_errors (attempt_id, kind, message, at) VALUES (:a, :k, 'boom', 0)"),
            [{"a": attempt, "k": k} for k in kinds],
        )


def test_report_sections_and_charts(store: Store, samples: Path, tmp_path: Path) -> None:
    ingest(store, [samples])
    add_scorer(store, "scorer-a", "model-a")
    add_scores(store, "scorer-a", seed=2, skip={("trajectories/episode_003", 0)})
    _failures(store, "scorer-a", "trajectories/episode_003", ["http_503", "http_503", "timeout"])
    compute_credits(store, CreditParams(c_min=0.9, c_max=1.1), name="tight")
    out = write_report(store, tmp_path / "report.html", "tight")
    page = out.path.read_text()

    for section in ("run", "hyperparameters", "distributions", "subtasks", "coverage", "failures"):
        assert f'id="{section}"' in page
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert len(svgs) == 10  # 6 histograms, rho by position decile, subtask positions, coverage, failure kinds
    for svg in svgs:
        ET.fromstring(svg)  # well-formed
    assert "c_min 0.9" in page and "c_max 1.1" in page  # the clip bounds are marked
    assert ">planning<" in page and ">0<" in page and ">2<" in page  # subtask positions
    assert "http_503" in page and "timeout" in page
    assert "trajectories/episode_003" in page  # listed as incomplete
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert re.search(r"<td>t_temp</td><td>5.0</td>", page)
    # The page opens with diagnose's verdict, before the hyperparameters and the histograms.
    verdict = diagnose_run(store, "tight")["verdict"]
    assert verdict.startswith("verdict: ")
    opens = page.index(f'<p class="verdict" id="verdict"><strong>{html.escape(verdict)}</strong>')
    assert opens < page.index('id="run"') < page.index('id="hyperparameters"') < page.index("<svg")


def test_report_without_failures(store: Store, samples: Path, tmp_path: Path) -> None:
    ingest(store, [samples])
    add_scorer(store, "s")
    add_scores(store, "s")
    compute_credits(store)
    page = write_report(store, tmp_path / "r.html").path.read_text()
    assert "No failed attempts recorded." in page
    assert len(re.findall(r"<svg", page)) == 9


def test_report_and_show_display_a_paper_runs_advantage(store: Store, samples: Path, tmp_path: Path) -> None:
    """Issue 39 §7: the signed advantage the trainer receives is on the report (a histogram and
    each episode's range) and in ``show``'s table, not only q_h_smoothed."""
    from hcapo_store.outputs.episode_view import episode_table, episode_view

    ingest(store, [samples])
    add_scorer(store, "s")
    add_scores(store, "s")
    compute_credits(store, CreditParams(variant="paper"), name="paper")
    page = write_report(store, tmp_path / "r.html", "paper", episode_pages=True).path.read_text()
    assert "Advantage per step (what the trainer receives)" in page
    assert "steps non-zero (signed: the paper" in page
    assert "<th>advantage min – max</th>" in page
    with store.engine.connect() as conn:
        lo, hi, name = conn.execute(
            text(
                "SELECT MIN(advantage), MAX(advantage), MIN(episode) FROM step_credits WHERE run = 'paper' "
                "GROUP BY episode ORDER BY episode LIMIT 1"
            )
        ).one()
    assert lo < hi
    assert f"<td>{lo:.4g} – {hi:.4g}</td>" in page  # the episode's range in the report's index
    with store.engine.connect() as conn:  # signed: the paper's advantages
        assert conn.execute(text("SELECT MIN(advantage) FROM step_credits WHERE run = 'paper'")).scalar() < 0
    rows = episode_table(episode_view(store, name, "paper"))
    assert [r["advantage"] for r in rows] and min(r["advantage"] for r in rows) == pytest.approx(lo)
