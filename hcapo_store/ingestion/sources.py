"""The names other layers import from ingestion (options, rows, sources), in one place.

Discovery (which inputs, read through files.py's gate) is discovery.py; parsing (bytes to
episodes) is parsing.py. Import from those inside ingestion/.
"""

from __future__ import annotations

from hcapo_store.ingestion.discovery import (
    INPUT_FORMATS,
    MAX_RESULT_BYTES,
    MAX_SESSION_BYTES,
    JsonlCursor,
    Source,
    count_inputs,
    iter_sources,
)
from hcapo_store.ingestion.parsing import (
    COMPACTION_MODES,
    RESULT_FILE,
    SESSION_FILE,
    ConvertOptions,
    MessageRow,
    ParsedEpisode,
)

__all__ = [
    "COMPACTION_MODES",
    "INPUT_FORMATS",
    "MAX_RESULT_BYTES",
    "MAX_SESSION_BYTES",
    "RESULT_FILE",
    "SESSION_FILE",
    "ConvertOptions",
    "JsonlCursor",
    "MessageRow",
    "ParsedEpisode",
    "Source",
    "count_inputs",
    "iter_sources",
]
