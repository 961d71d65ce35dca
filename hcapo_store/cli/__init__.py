"""hcapo-store command line: thin Click commands over the ``hcapo_store`` library.

``cli`` is the root group (``main.py``); importing this package registers every command,
one module per stage. Only light modules load here: ``--help`` must not pay for
SQLAlchemy, Alembic, numpy or transformers (tests/test_cli.py checks).
"""

from hcapo_store.cli import credits, database, devkit, diagnose, ingest, online, outputs, rollout, score  # noqa: F401  (registers commands)
from hcapo_store.cli.main import cli

__all__ = ["cli"]
