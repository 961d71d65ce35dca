"""The package's public surface is deliberate: changing it is a visible decision."""

import hcapo_store


def test_exported_members():
    assert sorted(hcapo_store.__all__) == sorted(
        ["ConvertOptions", "CreditError", "ExportError", "HcapoError", "InferenceError", "IngestError",
         "IngestReport", "RunOptions", "SchemaOutOfDate", "SchemaTooNew", "ScoreConfig", "ScoreReport",
         "ScoringError", "SkipEpisode", "Store", "StoreError", "dry_run", "ingest", "prepare", "run_scoring"])
    for name in hcapo_store.__all__:
        assert getattr(hcapo_store, name) is not None
