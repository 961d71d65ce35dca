"""``score``/``follow --logprobs-mode`` (issue 40 item 6): vLLM's --logprobs-mode changes what
``prompt_logprobs`` are (since vllm #47680), so the scorer declares the mode its server runs.
The reference server plays a vLLM server in development mode (its ``/server_info`` names the
mode) over real HTTP on 127.0.0.1, with the tiny local model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_log_ratio import _episodes

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring import defaults
from hcapo_store.storage.store import Store


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as srv:
        srv.start()
        yield srv


def _scorers(db: str) -> dict[str, tuple[int, dict]]:
    store = Store.open(db)
    try:
        counts = dict(store.query("SELECT scorer_id, COUNT(*) FROM scores GROUP BY scorer_id")[1])
        specs = {i: json.loads(spec) for i, spec in store.query("SELECT id, spec FROM scorers")[1]}
    finally:
        store.close()
    return {i: (counts.get(i, 0), spec) for i, spec in specs.items()}


def test_the_mode_is_declared_refused_when_the_server_runs_another_and_part_of_the_scorer(
    server: ReferenceServer, tiny_model_dir: Path, tmp_path: Path, runner
) -> None:
    db = str(tmp_path / "s.db")
    store = Store.open(db)
    assert ingest(store, [_episodes(tmp_path / "eps.jsonl", n=1)]).failed == 0
    store.close()
    argv = ["--db", db, "score", "--backend", "vllm", "--server", server.url, "--tokenizer", str(tiny_model_dir)]
    try:
        # a server restarted with processed log-probabilities: refused in one line naming the option
        server.logprobs_mode = "processed_logprobs"
        r = runner.invoke(cli, argv)
        assert r.exit_code != 0
        line = next(x for x in r.output.splitlines() if "--logprobs-mode" in x)
        assert "runs --logprobs-mode processed_logprobs, not raw_logprobs" in line
        assert "pass --logprobs-mode processed_logprobs" in line
        assert _scorers(db) == {}  # refused before anything was registered or scored

        # declared: scored, under a scorer that names the mode
        r = runner.invoke(cli, [*argv, "--logprobs-mode", "processed_logprobs", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["scored"] == 3
        [(processed, (n, spec))] = _scorers(db).items()
        assert n == 3 and spec["backend"]["logprobs_mode"] == "processed_logprobs"

        # the same server restarted in vLLM's default mode: another scorer, the first one's scores stay its own
        server.logprobs_mode = "raw_logprobs"
        r = runner.invoke(cli, [*argv, "--logprobs-mode", "processed_logprobs"])
        assert r.exit_code != 0 and "runs --logprobs-mode raw_logprobs, not processed_logprobs" in r.output
        r = runner.invoke(cli, [*argv, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["scored"] == 3
        scorers = _scorers(db)
        assert len(scorers) == 2 and scorers[processed][0] == 3
        [(raw, (n, spec))] = [(i, v) for i, v in scorers.items() if i != processed]
        assert n == 3 and "logprobs_mode" not in spec["backend"]  # the default, named by its absence

        # a server that reports no mode is scored as the declared one: the default resumes its scorer
        server.logprobs_mode = None
        r = runner.invoke(cli, [*argv, "--dry-run", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["steps"] == 0  # the raw scorer: nothing left to score

        # a logits mode is never scored: its numbers are not log-probabilities
        server.logprobs_mode = "raw_logits"
        r = runner.invoke(cli, argv)
        assert r.exit_code != 0 and "runs --logprobs-mode raw_logits" in r.output
        assert "not log-probabilities" in r.output
    finally:
        server.logprobs_mode = None
    r = runner.invoke(cli, [*argv, "--logprobs-mode", "raw_logits"])
    assert r.exit_code == 2 and "'raw_logits' is not one of" in r.output
    r = runner.invoke(cli, ["--db", db, "score", "--server", server.url, "--logprobs-mode", "processed_logprobs"])
    assert r.exit_code == 2 and "--logprobs-mode is the vLLM server's" in r.output


def test_follow_takes_the_option_and_the_default_lives_in_the_library(runner) -> None:
    from hcapo_store.scoring.backends.vllm import RAW_LOGPROBS, VLLMBackend
    from hcapo_store.scoring.job import ScoreConfig

    for command in ("score", "follow"):
        r = runner.invoke(cli, [command, "--help"])
        assert r.exit_code == 0 and "--logprobs-mode" in r.output, command
    # follow shares score's scorer options: the same check, before any server is asked
    argv = [
        "follow",
        ".",
        "--group-size",
        "4",
        "--server",
        "http://127.0.0.1:9",
        "--logprobs-mode",
        "processed_logprobs",
    ]
    r = runner.invoke(cli, argv)
    assert r.exit_code == 2 and "--logprobs-mode is the vLLM server's" in r.output
    assert ScoreConfig().logprobs_mode == RAW_LOGPROBS == defaults.LOGPROBS_MODE == "raw_logprobs"
    assert VLLMBackend("http://127.0.0.1:9").logprobs_mode == defaults.LOGPROBS_MODE
