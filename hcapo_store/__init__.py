"""hcapo-store: agent trajectories, hindsight logprobs and HCAPO credits in SQL.

The supported library surface; everything else is an implementation module.
"""

from hcapo_store.errors import (
    CreditError,
    ExportError,
    HcapoError,
    InferenceError,
    IngestError,
    SchemaOutOfDate,
    SchemaTooNew,
    ScoringError,
    SkipEpisode,
    StoreError,
)
from hcapo_store.ingest import IngestReport, ingest
from hcapo_store.scheduler import RunOptions, ScoreReport
from hcapo_store.scoring import ScoreConfig, dry_run, prepare, run_scoring
from hcapo_store.sources import ConvertOptions
from hcapo_store.store import Store

__all__ = [
    "ConvertOptions",
    "CreditError",
    "ExportError",
    "HcapoError",
    "InferenceError",
    "IngestError",
    "IngestReport",
    "RunOptions",
    "SchemaOutOfDate",
    "SchemaTooNew",
    "ScoreConfig",
    "ScoreReport",
    "ScoringError",
    "SkipEpisode",
    "Store",
    "StoreError",
    "dry_run",
    "ingest",
    "prepare",
    "run_scoring",
]
