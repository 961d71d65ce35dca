"""hcapo-store: agent trajectories, hindsight logprobs and HCAPO credits in SQL.

The supported library surface, covering the whole job: open a ``Store``, ``ingest``
trajectories, ``prepare`` and ``run_scoring`` a scorer, ``compute_credits``, then
``export_dataset`` / ``export_hindsight_json`` / ``write_report``, and look at the numbers
(``credits_frame``, ``steps_frame``, ``export_scores``). Everything else is an
implementation module. In a notebook (a running event loop) ``prepare`` and
``run_scoring`` run in a worker thread; ``await prepare_async(...)`` /
``await run_scoring_async(...)`` run on the notebook's loop.

Online (HCAPO scores its own rollouts between rollout and update): ``follow`` a collection
with a ``Follower`` (``FollowConfig``), ``score_live`` with the policy in process, and hand a
credit run's advantages onto a trainer's ids with ``Handoff``; ``verl_advantages``,
``slime_advantages``/``slime_advantage_function`` and ``prime_rl_advantages``/
``prime_rl_sampled_advantages`` put them in those frameworks' shapes (no framework imported).

Provisional, imported by their deep path and free to change with the trainers they track
(TRL's and verl's private hooks move between releases): the trainer integrations in
``hcapo_store.training.trl_grpo``, ``.trl_sft``, ``.verl`` and ``.verl_batch``.

Names load on first use, so ``import hcapo_store`` (and ``hcapo-store --help``) does not
pull in SQLAlchemy, Alembic, numpy or transformers.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # errors
    "HcapoError": "hcapo_store.errors",
    "MissingExtra": "hcapo_store.errors",
    "StoreError": "hcapo_store.errors",
    "SchemaOutOfDate": "hcapo_store.errors",
    "SchemaTooNew": "hcapo_store.errors",
    "DatabaseLocked": "hcapo_store.errors",
    "DatabaseFull": "hcapo_store.errors",
    "NotAStore": "hcapo_store.errors",
    "IngestError": "hcapo_store.errors",
    "EpisodeLookupError": "hcapo_store.errors",
    "InvalidCreditParams": "hcapo_store.errors",
    "ScoringError": "hcapo_store.errors",
    "InferenceError": "hcapo_store.errors",
    "CreditError": "hcapo_store.errors",
    "ExportError": "hcapo_store.errors",
    "UsageError": "hcapo_store.errors",
    # storage
    "Store": "hcapo_store.storage.store",
    # ingest
    "ConvertOptions": "hcapo_store.ingestion.sources",
    "IngestReport": "hcapo_store.ingestion.pipeline",
    "ingest": "hcapo_store.ingestion.pipeline",
    # scoring
    "ScoreConfig": "hcapo_store.scoring.job",
    "Prepared": "hcapo_store.scoring.job",
    "DryRun": "hcapo_store.scoring.job",
    "prepare": "hcapo_store.scoring.job",
    "dry_run": "hcapo_store.scoring.job",
    "run_scoring": "hcapo_store.scoring.job",
    "prepare_async": "hcapo_store.scoring.job",
    "run_scoring_async": "hcapo_store.scoring.job",
    "RunOptions": "hcapo_store.scoring.scheduler",
    "ScoreReport": "hcapo_store.scoring.scheduler",
    # credits
    "CreditParams": "hcapo_store.credits.params",
    "RunInfo": "hcapo_store.credits.lookup",
    "ComputeResult": "hcapo_store.credits.compute",
    "compute_credits": "hcapo_store.credits.compute",
    "list_runs": "hcapo_store.credits.lookup",
    "get_run": "hcapo_store.credits.lookup",
    "show_run": "hcapo_store.credits.compare",
    "RunDetails": "hcapo_store.credits.compare",
    "SubtaskSummary": "hcapo_store.credits.compare",
    "diff_runs": "hcapo_store.credits.compare",
    "RunDiff": "hcapo_store.credits.compare",
    "MovedStep": "hcapo_store.credits.compare",
    # outputs
    "export_dataset": "hcapo_store.outputs.export",
    "DatasetExport": "hcapo_store.outputs.export",
    "export_hindsight_json": "hcapo_store.outputs.export",
    "HindsightExport": "hcapo_store.outputs.export",
    "export_tokenized": "hcapo_store.outputs.tokenized",
    "TokenizedExport": "hcapo_store.outputs.tokenized",
    "export_scores": "hcapo_store.outputs.scores",
    "ScoresExport": "hcapo_store.outputs.scores",
    "write_report": "hcapo_store.outputs.report",
    "ReportResult": "hcapo_store.outputs.report",
    "write_episode_page": "hcapo_store.outputs.episode_view",
    "EpisodePage": "hcapo_store.outputs.episode_view",
    # analysis (DataFrames need pandas: the `pandas` extra)
    "credits_frame": "hcapo_store.analysis.frames",
    "steps_frame": "hcapo_store.analysis.frames",
    "datasette_metadata": "hcapo_store.analysis.datasette",
    "DatasetteMetadata": "hcapo_store.analysis.datasette",
    # online: the batches `follow` publishes
    "BatchInfo": "hcapo_store.online.batches",
    "BatchMember": "hcapo_store.online.batches",
    "FailedEpisode": "hcapo_store.online.batches",
    "BatchNotReady": "hcapo_store.errors",
    "list_batches": "hcapo_store.online.batches",
    "wait_for_batch": "hcapo_store.online.batches",
    # online: follow a collection, score in process, hand advantages to a trainer
    "follow": "hcapo_store.online.follow",
    "Follower": "hcapo_store.online.follow",
    "FollowConfig": "hcapo_store.online.follow",
    "FollowResult": "hcapo_store.online.follow",
    "score_live": "hcapo_store.scoring.live",
    "Handoff": "hcapo_store.training.handoff",
    "TokenCredit": "hcapo_store.training.handoff",
    "verl_advantages": "hcapo_store.training.adapters",
    "slime_advantages": "hcapo_store.training.adapters",
    "slime_advantage_function": "hcapo_store.training.adapters",
    "prime_rl_advantages": "hcapo_store.training.adapters",
    "prime_rl_sampled_advantages": "hcapo_store.training.adapters",
    "status": "hcapo_store.status_report",
    "StoreStatus": "hcapo_store.status_report",
    "WorkerStatus": "hcapo_store.status_report",
}

__all__ = sorted(_EXPORTS)

# Modules that are usable but not yet the supported surface: they track trainers' private hooks.
_PROVISIONAL: tuple[str, ...] = (
    "hcapo_store.training.trl_grpo",
    "hcapo_store.training.trl_sft",
    "hcapo_store.training.verl",
    "hcapo_store.training.verl_batch",
)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hcapo_store' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static tools see the real names
    from hcapo_store.analysis.datasette import DatasetteMetadata, datasette_metadata
    from hcapo_store.analysis.frames import credits_frame, steps_frame
    from hcapo_store.credits.compare import MovedStep, RunDetails, RunDiff, SubtaskSummary, diff_runs, show_run
    from hcapo_store.credits.compute import ComputeResult, compute_credits
    from hcapo_store.credits.lookup import RunInfo, get_run, list_runs
    from hcapo_store.credits.params import CreditParams
    from hcapo_store.errors import (
        BatchNotReady,
        CreditError,
        DatabaseFull,
        DatabaseLocked,
        EpisodeLookupError,
        ExportError,
        HcapoError,
        InferenceError,
        IngestError,
        InvalidCreditParams,
        MissingExtra,
        NotAStore,
        SchemaOutOfDate,
        SchemaTooNew,
        ScoringError,
        StoreError,
        UsageError,
    )
    from hcapo_store.ingestion.pipeline import IngestReport, ingest
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.online.batches import BatchInfo, BatchMember, FailedEpisode, list_batches, wait_for_batch
    from hcapo_store.online.follow import FollowConfig, Follower, FollowResult, follow
    from hcapo_store.outputs.episode_view import EpisodePage, write_episode_page
    from hcapo_store.outputs.export import DatasetExport, HindsightExport, export_dataset, export_hindsight_json
    from hcapo_store.outputs.report import ReportResult, write_report
    from hcapo_store.outputs.scores import ScoresExport, export_scores
    from hcapo_store.outputs.tokenized import TokenizedExport, export_tokenized
    from hcapo_store.scoring.job import (
        DryRun,
        Prepared,
        ScoreConfig,
        dry_run,
        prepare,
        prepare_async,
        run_scoring,
        run_scoring_async,
    )
    from hcapo_store.scoring.live import score_live
    from hcapo_store.scoring.scheduler import RunOptions, ScoreReport
    from hcapo_store.status_report import StoreStatus, WorkerStatus, status
    from hcapo_store.storage.store import Store
    from hcapo_store.training.adapters import (
        prime_rl_advantages,
        prime_rl_sampled_advantages,
        slime_advantage_function,
        slime_advantages,
        verl_advantages,
    )
    from hcapo_store.training.handoff import Handoff, TokenCredit
