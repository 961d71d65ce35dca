"""Nothing silent (issue 9 §3): exit codes, reasons and messages of ``score``, ``status``,
help texts, scorer labels and the demo — against the real reference server over HTTP."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from _waiting import wait_until
from conftest import TOKENIZERS

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

MAX_CONTEXT = 2048


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    with make_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 2, steps_per_subtask=1, output_words=12)
    return root


@pytest.fixture
def db(tmp_path: Path, episodes_dir: Path) -> str:
    path = tmp_path / "x.db"
    with Store.open(str(path)) as store:
        assert ingest(store, [episodes_dir]).failed == 0
    return str(path)


def _score_args(db: str, ref: ReferenceServer, tokenizer: Path, *extra: str) -> list[str]:
    return [
        "--db",
        db,
        "score",
        "--server",
        ref.url,
        "--tokenizer",
        str(tokenizer),
        "--max-context",
        str(MAX_CONTEXT),
        *extra,
    ]


def _dump(db: str) -> list[str]:
    with sqlite3.connect(db) as conn:
        return list(conn.iterdump())


def test_dry_run_writes_nothing(runner, db, ref, tiny_model_dir):
    before = _dump(db)
    r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir, "--dry-run"), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "nothing was sent" in r.output
    assert _dump(db) == before  # no scorer row, no queue rows: `credits compute` still sees one scorer or none
    r = runner.invoke(
        cli, _score_args(db, ref, tiny_model_dir, "--dry-run", "--max-logprob-tokens", "8"), catch_exceptions=False
    )
    assert r.exit_code == 0 and _dump(db) == before


def _count(db: str, sql: str) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchone()[0]


def test_failed_steps_exit_non_zero_with_their_reasons(runner, db, ref, tiny_model_dir):
    from faultserver import FaultServer

    with FaultServer(ref, lambda key, n: "http_400") as faulty:
        r = runner.invoke(
            cli,
            [
                "--db",
                db,
                "score",
                "--server",
                faulty.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--max-context",
                str(MAX_CONTEXT),
            ],
        )
    assert r.exit_code == 1, r.output
    failed = _count(db, "SELECT COUNT(*) FROM attempts WHERE status = 'failed'")
    assert failed > 0 and f"failed {failed}" in r.output
    assert "injected bad request" in r.output  # the reason, not only "[http_400]"
    assert r.output.count("injected bad request") == 1  # distinct messages, not one line per step
    # A rerun with nothing left to do is not a failure.
    r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir))
    assert r.exit_code == 0 and "scored 0, failed 0" in r.output, r.output


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_a_tokenizer_the_model_lacks_is_refused_before_scoring(runner, db, ref, backend):
    qwen = TOKENIZERS / "qwen2.5"
    if not qwen.is_dir():
        pytest.skip(f"{qwen} is absent")
    before, sequences = _dump(db), ref.sequences
    r = runner.invoke(cli, _score_args(db, ref, qwen, "--backend", backend))
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not match the model" in lines[0] and "vocabulary" in lines[0], r.output
    assert ref.sequences == sequences and _dump(db) == before  # refused before any step or scorer row


def _options(command) -> list:
    return [p for p in command.params if isinstance(p, __import__("click").Option) and p.name != "help"]


def test_every_option_of_score_and_credits_compute_is_described(runner):
    from hcapo_store.cli.credits import credits_compute
    from hcapo_store.cli.score import score

    for command in (score, credits_compute):
        undescribed = [o.opts[0] for o in _options(command) if not (o.help or "").strip()]
        assert not undescribed, (command.name, undescribed)
    helps = {o.opts[0]: o.help for o in _options(credits_compute)}
    for option, symbol in (
        ("--t-temp", "T"),
        ("--gamma", "γ"),
        ("--alpha", "α"),
        ("--c-min", "c_min"),
        ("--c-max", "c_max"),
    ):
        assert symbol in helps[option], option
    r = runner.invoke(cli, ["credits", "compute", "--help"])
    assert r.exit_code == 0 and "γ" in r.output


def test_group_help_is_not_cut_and_db_after_the_command_gets_a_hint(runner, tmp_path):
    r = runner.invoke(cli, ["--help"])
    assert r.exit_code == 0
    line = next(x for x in r.output.splitlines() if x.strip().startswith("credits "))
    assert "(Eq. 5-7)" in line and line.rstrip().endswith("no model calls."), line  # not cut at "(Eq."
    for command in (["status"], ["credits", "list"]):
        r = runner.invoke(cli, [*command, "--db", str(tmp_path / "x.db")])
        assert r.exit_code == 2
        assert "--db is a global option" in r.output and f"--db PATH_OR_URL {' '.join(command)}" in r.output, r.output


def test_scorer_labels_differ_when_scorers_differ(db, ref, tiny_model_dir, demo_tokenizer_dir, tmp_path):
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.rendering.prompts import HINDSIGHT_TEMPLATE
    from hcapo_store.scoring.job import ScoreConfig, prepare
    from hcapo_store.scoring.scorer import scorer_label

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for f in demo_tokenizer_dir.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 12345  # same name pattern, different files
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    base = dict(backend="sglang", server=ref.url, max_context=MAX_CONTEXT)
    configs = [
        ScoreConfig(tokenizer=str(tiny_model_dir), **base),
        ScoreConfig(tokenizer=str(demo_tokenizer_dir), **base),
        ScoreConfig(tokenizer=str(other), **base),
        ScoreConfig(tokenizer=str(tiny_model_dir), hindsight_template=HINDSIGHT_TEMPLATE + " ", **base),
        ScoreConfig(tokenizer=str(tiny_model_dir), conversion=ConvertOptions(include_thinking=False), **base),
        ScoreConfig(tokenizer=str(tiny_model_dir), top_k=5, **base),
        ScoreConfig(tokenizer=str(tiny_model_dir), top_k=20, **base),
    ]
    with Store.open(db) as store:
        specs = [prepare(store, cfg) for cfg in configs]
    assert len({p.scorer_id for p in specs}) == len(configs)
    labels = [scorer_label(p.spec) for p in specs]
    assert len(set(labels)) == len(labels), labels
    assert demo_tokenizer_dir.name in labels[1]
    assert "top-k=5" in labels[-2] and "top-k=20" in labels[-1]  # a K's distributions are another scorer's


@pytest.mark.parametrize(
    "template, shown",
    [
        ("Reward {reward} for {subtask_name}", "{subtask_name}"),
        ("Reward {reward:.2f} {", "cannot be parsed"),
        ("Reward {0}", "{0}"),
    ],
)
def test_a_bad_hindsight_template_is_one_line_listing_the_placeholders(
    runner, db, ref, tiny_model_dir, tmp_path, template, shown
):
    path = tmp_path / "hindsight.txt"
    path.write_text(template)
    r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir, "--hindsight-template", str(path)))
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and shown in lines[0], r.output
    assert "allowed placeholders: {reward}, {phase}" in lines[0] and "{current_subtask_score}" in lines[0]


def _attempt_states(db: str) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT status, COUNT(*) FROM attempts GROUP BY status").fetchall())


def test_a_server_that_dies_mid_run_stops_the_run_and_leaves_the_rest_pending(runner, db, ref, tiny_model_dir):
    import threading

    from faultserver import FaultServer

    steps = _count(db, "SELECT COUNT(*) FROM steps")
    with FaultServer(ref) as server:

        def kill_after_three_requests() -> None:
            wait_until(lambda: server.requests >= 3, "3 requests", poll_s=0.01, timeout=120.0)
            server.die()

        killer = threading.Thread(target=kill_after_three_requests, daemon=True)
        killer.start()
        r = runner.invoke(
            cli,
            [
                "--db",
                db,
                "score",
                "--server",
                server.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--max-context",
                str(MAX_CONTEXT),
                "--concurrency",
                "2",
            ],
        )
        killer.join()
    assert r.exit_code == 1, r.output
    assert "server stopped answering" in r.output and "stay pending" in r.output, r.output
    states = _attempt_states(db)
    assert "failed" not in states and "leased" not in states, states  # nothing failed for good, nothing held
    assert states.get("pending", 0) > 0 and sum(states.values()) == steps, states
    # Back up: the rest is scored, nothing twice.
    r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir))
    assert r.exit_code == 0, r.output
    assert _attempt_states(db) == {"done": steps}


def test_request_timeout_and_a_hung_request_do_not_fail_steps_of_a_live_server(runner, db, ref, tiny_model_dir):
    """--request-timeout bounds a hung request; a live server is not taken for dead."""
    from faultserver import FaultServer

    first = {}

    def hang_first_request_of_one_step(key: str, n: int) -> str | None:
        first.setdefault("key", key)
        return "hang" if key == first["key"] and n == 0 else None

    with FaultServer(ref, hang_first_request_of_one_step) as server:
        r = runner.invoke(
            cli,
            [
                "--db",
                db,
                "score",
                "--server",
                server.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--max-context",
                str(MAX_CONTEXT),
                "--request-timeout",
                "5",
                "--json",
            ],
        )
        hung = server.faults_for(first["key"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["failed"] == 0 and out["retried"] >= 1 and out["server_down"] is None
    assert hung[0] == "hang" and hung[-1] is None  # given up after the timeout, retried, answered
    assert _attempt_states(db) == {"done": _count(db, "SELECT COUNT(*) FROM steps")}


@pytest.mark.slow
def test_first_ctrl_c_stops_within_the_grace_period_while_requests_hang(db, ref, tiny_model_dir, tmp_path):
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from faultserver import FaultServer

    hcapo = shutil.which("hcapo-store") or str(Path(sys.executable).with_name("hcapo-store"))
    with FaultServer(ref, lambda key, n: "hang") as server:
        log = tmp_path / "score.log"
        proc = subprocess.Popen(
            [
                hcapo,
                "--db",
                db,
                "score",
                "--server",
                server.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--max-context",
                str(MAX_CONTEXT),
                "--concurrency",
                "2",
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1"},
        )
        try:
            wait_until(
                lambda: server.requests >= 2 or proc.poll() is not None, "two hung requests", poll_s=0.01, timeout=120.0
            )
            proc.send_signal(signal.SIGINT)
            # Without the grace period this waits for the 300 s request timeout.
            proc.wait(timeout=150)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = log.read_text()
    assert proc.returncode == 130, out
    assert "interrupted" in out and "2 request(s) in flight cancelled" in out, out
    states = _attempt_states(db)
    assert set(states) == {"pending"}, states  # the hung steps went back to the queue, not failed


def test_nothing_to_score_says_why(runner, db, ref, tiny_model_dir, tmp_path):
    empty = str(tmp_path / "empty.db")
    Store.open(empty).close()
    cases = [
        ([empty], "no episodes in this database"),
        ([db, "--no-thinking"], "no episode was ingested with --no-thinking --max-tool-result-chars 4000"),
        ([db, "--max-tool-result-chars", "10"], "2 with --include-thinking --max-tool-result-chars 4000"),
        ([db, "--min-reward", "1e9"], "no episode has reward >= 1000000000.0"),
    ]
    for i, ((where, *extra), reason) in enumerate(cases):
        for dry in ([], ["--dry-run"])[: 2 if i < 1 else 1]:  # both paths share the explanation
            r = runner.invoke(cli, _score_args(where, ref, tiny_model_dir, *extra, *dry))
            assert r.exit_code == 0 and reason in r.output, (extra, dry, r.output)
    # an unknown --episode is refused before anything else, naming it (not "nothing to score")
    for dry in ([], ["--dry-run"]):
        r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir, "--episode", "nosuch", *dry))
        assert r.exit_code == 1 and "no episode 'nosuch'" in r.output, r.output
    assert runner.invoke(cli, _score_args(db, ref, tiny_model_dir)).exit_code == 0
    r = runner.invoke(cli, _score_args(db, ref, tiny_model_dir, "--json"))
    steps = _count(db, "SELECT COUNT(*) FROM steps")
    assert json.loads(r.output)["reason"] == f"every step is done: {steps} already scored by this scorer", r.output


def test_status_shows_killed_workers_dead_and_silent_ones_stale(runner, db):
    import subprocess
    import sys

    from sqlalchemy import text

    from hcapo_store.scoring import work_queue
    from hcapo_store.scoring.scorer import register
    from hcapo_store.storage import db as dbmod

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid no longer exists
    with Store.open(db) as store:
        scorer = register(store, {"backend": {"kind": "test"}, "max_context": 1, "max_logprob_tokens": 1})
        host = work_queue.default_worker_id().rpartition(":")[0]
        work_queue.register_worker(store, f"{host}:{gone.pid}", scorer)
        work_queue.register_worker(store, "elsewhere:1", scorer)
        work_queue.register_worker(store, "elsewhere:2", scorer)
        with dbmod.write(store.engine) as conn:
            conn.execute(text("UPDATE workers SET heartbeat_at = heartbeat_at - 1000 WHERE id = 'elsewhere:1'"))
    r = runner.invoke(cli, ["--db", db, "status", "--json"], catch_exceptions=False)
    states = {w["id"]: w["state"] for w in json.loads(r.output)["workers"]}
    assert states == {f"{host}:{gone.pid}": "dead", "elsewhere:1": "stale", "elsewhere:2": "running"}, states
    r = runner.invoke(cli, ["--db", db, "status"], catch_exceptions=False)
    assert f"worker {host}:{gone.pid}: dead" in r.output and "worker elsewhere:1: stale" in r.output
