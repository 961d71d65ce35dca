"""hcapo-store: agent trajectories, hindsight logprobs and HCAPO credits in SQL.

The supported library surface, covering the whole job: open a ``Store``, ``ingest``
trajectories, ``prepare`` and ``run_scoring`` a scorer, ``compute_credits``, then
``export_dataset`` / ``export_hindsight_json`` / ``write_report``. Everything else is an
implementation module.

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
    "IngestError": "hcapo_store.errors",
    "SkipEpisode": "hcapo_store.errors",
    "ScoringError": "hcapo_store.errors",
    "InferenceError": "hcapo_store.errors",
    "CreditError": "hcapo_store.errors",
    "ExportError": "hcapo_store.errors",
    # storage
    "Store": "hcapo_store.storage.store",
    # ingest
    "ConvertOptions": "hcapo_store.ingestion.sources",
    "IngestReport": "hcapo_store.ingestion.pipeline",
    "ingest": "hcapo_store.ingestion.pipeline",
    # scoring
    "ScoreConfig": "hcapo_store.scoring.job",
    "prepare": "hcapo_store.scoring.job",
    "dry_run": "hcapo_store.scoring.job",
    "run_scoring": "hcapo_store.scoring.job",
    "RunOptions": "hcapo_store.scoring.runner",
    "ScoreReport": "hcapo_store.scoring.runner",
    # credits
    "CreditParams": "hcapo_store.credits.equations",
    "compute_credits": "hcapo_store.credits.runs",
    "list_runs": "hcapo_store.credits.runs",
    "get_run": "hcapo_store.credits.runs",
    "show_run": "hcapo_store.credits.runs",
    "diff_runs": "hcapo_store.credits.runs",
    # outputs
    "export_dataset": "hcapo_store.outputs.export",
    "export_hindsight_json": "hcapo_store.outputs.export",
    "write_report": "hcapo_store.outputs.report",
    "status": "hcapo_store.storage.status",
}

__all__ = sorted(_EXPORTS)


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
    from hcapo_store.credits.equations import CreditParams
    from hcapo_store.credits.runs import compute_credits, diff_runs, get_run, list_runs, show_run
    from hcapo_store.errors import (CreditError, ExportError, HcapoError, InferenceError, IngestError, MissingExtra,
                                    SchemaOutOfDate, SchemaTooNew, ScoringError, SkipEpisode, StoreError)
    from hcapo_store.ingestion.pipeline import IngestReport, ingest
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.outputs.export import export_dataset, export_hindsight_json
    from hcapo_store.outputs.report import write_report
    from hcapo_store.scoring.job import ScoreConfig, dry_run, prepare, run_scoring
    from hcapo_store.scoring.runner import RunOptions, ScoreReport
    from hcapo_store.storage.status import status
    from hcapo_store.storage.store import Store
