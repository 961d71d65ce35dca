"""Every scoring request carries X-SMG-Routing-Key, one opaque key per episode (issue 19), so the
SGLang router (``--policy manual``) keeps an episode on the worker whose prefix cache holds it."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_each_episodes_requests_carry_one_opaque_key_of_their_own(tmp_path, ref, tiny_model_dir, backend):
    db = tmp_path / "x.db"
    with Store.open(str(db)) as store:
        ingest(store, [REPO / "examples" / "trajectories"])
        episodes = store.query("SELECT count(*) FROM episodes", read_only=True)[1][0][0]
        texts = [c for (c,) in store.query("SELECT content FROM messages WHERE content IS NOT NULL", read_only=True)[1]]
    ref.routing_keys.clear()
    server = ref.url + ("/v1" if backend == "vllm" else "")
    argv = ["--db", str(db), "score", "--backend", backend, "--server", server, "--tokenizer", str(tiny_model_dir)]
    # --max-context 512: every step is still one request of its episode (per-step), each prompt a
    # quarter of 2048 tokens' forward (the keys do not depend on how much of the history is sent)
    argv += ["--max-context", "512", "--grouping", "per-step", "--concurrency", "1"]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    keys = list(ref.routing_keys)
    assert keys and all(k is not None and re.fullmatch(r"ep-[0-9a-f]{16}", k) for k in keys), keys
    # one episode at a time (--concurrency 1): each episode's requests form one run of one key
    runs = [k for k, _ in itertools.groupby(keys)]
    assert len(runs) == len(set(runs)) == episodes
    # opaque: no episode text and no path in a header
    assert not any(k[3:] in t for k in set(keys) for t in texts)
    assert not any("/" in k for k in keys)
