"""Where the tests find the shared data next to the checkout (``../shared``).

``HCAPO_TEST_SHARED`` overrides the location; point it at a missing directory to run the
suite as a plain clone does (``HCAPO_TEST_SHARED=/nonexistent python -m pytest``): tests then
use the project's own examples and skip the ones that need a real tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("HCAPO_TEST_SHARED") or REPO.parent / "shared")
SAMPLES = SHARED / "samples" / "trajectories"
TOKENIZERS = SHARED / "tokenizers"
EXAMPLES = REPO / "examples" / "trajectories"


def tokenizer_dir(name: str, demo: Path) -> Path:
    """A tokenizer parameter's directory: ``demo`` for "demo", else ../shared's tokenizer ``name``
    (the test skips where ../shared is absent)."""
    import pytest

    if name == "demo":
        return demo
    path = TOKENIZERS / name
    if not path.is_dir():
        pytest.skip(f"{path} is not here (../shared absent)")
    return path
