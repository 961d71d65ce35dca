"""Prepare pools kept per recipe (issue 43 item 4): a log-ratio training step scores with two
recipes (with and without the hindsight block); with one pool kept, each step ended the other's
workers and started its own again. Now ``KEPT_POOLS`` (2) stay, the least recently used ended first."""

from __future__ import annotations

from pathlib import Path

import pytest

from hcapo_store.scoring import preparing
from hcapo_store.storage.store import Store


@pytest.mark.slow  # three pools of one worker start (imports, a tokenizer): ~20 s on a loaded 2-core machine
def test_two_recipes_keep_their_pools_and_a_third_ends_the_least_recent(
    tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    Store.open(url).close()
    with_hindsight, without = (
        preparing.BuilderRecipe(str(demo_tokenizer_dir), (("hindsight", flag),), "fast") for flag in (True, False)
    )
    third = preparing.BuilderRecipe(str(demo_tokenizer_dir), (("hindsight", True), ("max_context", 512)), "fast")
    preparing.close_pools()
    try:
        a = preparing.shared_pool(url, with_hindsight, 1)
        b = preparing.shared_pool(url, without, 1)
        assert a is not None and b is not None and a is not b
        for _ in range(2):  # a step of a log-ratio run: both recipes, both pools kept
            assert preparing.shared_pool(url, with_hindsight, 1) is a
            assert preparing.shared_pool(url, without, 1) is b
        assert not a.broken and not b.broken
        c = preparing.shared_pool(url, third, 1)  # a is the least recently used: ended
        assert c is not None and a.broken and not b.broken and not c.broken
        assert len(preparing._pools) == preparing.KEPT_POOLS
        assert preparing.shared_pool(url, without, 1) is b
    finally:
        preparing.close_pools()
    assert not preparing._pools and b.broken and c.broken
