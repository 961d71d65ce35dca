"""``hcapo-store demo``: the main job end to end on a fresh machine, no GPU, no downloads.

Builds a tiny random Qwen2 model and a small tokenizer locally, ingests the example
episodes, starts the reference server (an SGLang-compatible /generate over that model)
on 127.0.0.1, scores every step through it exactly as against a real SGLang server,
computes the default credits, and returns the per-subtask summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hcapo_store.devkit.synth import write_examples
from hcapo_store.devkit.tiny_model import ensure_demo_model
from hcapo_store.ingestion.pipeline import IngestReport, ingest
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions, ScoreReport
from hcapo_store.storage.store import Store

EXAMPLES = Path("examples") / "trajectories"
DEMO_MAX_CONTEXT = 8192

SUMMARY_SQL = """
SELECT COALESCE(subtask_id, phase) AS subtask, COUNT(*) AS steps,
       AVG(mean_logprob) AS mean_logprob, AVG(token_count) AS tokens_per_step
FROM step_scores WHERE scorer_id = :scorer
GROUP BY COALESCE(subtask_id, phase)
ORDER BY MIN(CASE WHEN phase = 'planning' THEN 0 ELSE 1 END), 1
"""


@dataclass
class DemoResult:
    episodes_dir: Path
    model_dir: Path
    ingest: IngestReport
    score: ScoreReport
    scorer_id: str
    subtasks: tuple[list[str], list[tuple]]
    credits: tuple[list[str], list[tuple]] | None
    verdict: str | None = None  # diagnose's one line on the 'default' run


def find_episodes(workdir: Path) -> Path:
    """The checkout's examples/ when run from a clone, else freshly written ones."""
    if EXAMPLES.is_dir() and any(EXAMPLES.glob("episode_*")):
        return EXAMPLES.resolve()
    target = workdir / "examples"
    if not any(target.glob("episode_*")):
        write_examples(target)
    return target


def run_demo(store: Store, workdir: Path, *, on_step: Callable[[str], None] = lambda _: None) -> DemoResult:
    from hcapo_store.devkit.refserver import make_server

    workdir.mkdir(parents=True, exist_ok=True)
    on_step("building the tiny demo model (random weights, local tokenizer)")
    model_dir = ensure_demo_model(workdir / "models")
    episodes = find_episodes(workdir)
    on_step(f"ingesting {episodes}")
    ingested = ingest(store, [episodes], tags={"source": "demo"})
    server = make_server(model_dir).start()
    try:
        on_step(f"scoring through the reference server at {server.url}")
        cfg = ScoreConfig(backend="sglang", server=server.url, tokenizer=str(model_dir), max_context=DEMO_MAX_CONTEXT)
        prep = prepare(store, cfg)
        scored = run_scoring(store, prep, RunOptions(concurrency=2))
    finally:
        server.shutdown()
    subtasks = store.query(SUMMARY_SQL, {"scorer": prep.scorer_id})
    credits = verdict = None
    try:
        from hcapo_store.credits.compute import compute_credits
        from hcapo_store.credits.diagnose import diagnose_run

        on_step("computing credits (Eq. 5-7, default hyperparameters)")
        compute_credits(store, scorer=prep.scorer_id, replace=True)
        credits = store.query(
            "SELECT subtask, COUNT(*) AS episodes, AVG(rho) AS rho, AVG(q_h_smoothed) AS q_h_smoothed "
            "FROM subtask_credits WHERE run = 'default' GROUP BY subtask ORDER BY subtask"
        )
        verdict = diagnose_run(store, "default")["verdict"]
    except ImportError:  # pragma: no cover - credits ship with the package
        pass
    return DemoResult(episodes, model_dir, ingested, scored, prep.scorer_id, subtasks, credits, verdict)


def manual_commands(result: DemoResult, db: str, port: int = 30000) -> list[str]:
    """The demo's scoring step by hand: serve its tiny model, score against it."""
    return [
        f"hcapo-store serve-reference --model {result.model_dir} --port {port}",
        f"hcapo-store --db {db} score --server http://127.0.0.1:{port} --tokenizer {result.model_dir} "
        f"--max-context {DEMO_MAX_CONTEXT}",
    ]


def demo_summary(result: DemoResult) -> dict[str, Any]:
    cols, rows = result.subtasks
    return {
        "episodes_dir": str(result.episodes_dir),
        "model_dir": str(result.model_dir),
        "ingest": result.ingest.as_dict(),
        "score": result.score.as_dict(),
        "scorer_id": result.scorer_id,
        "subtasks": [dict(zip(cols, r)) for r in rows],
        "credits": [dict(zip(result.credits[0], r)) for r in result.credits[1]] if result.credits else None,
        "verdict": result.verdict,
    }
