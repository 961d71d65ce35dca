"""A server that goes away and comes back (online loops restart SGLang at every weight sync):
the retry waits no longer than it takes the server to answer again (issue 33 item 5).

Real parts: the fault server over the reference model on a fixed port, killed (the port stops
accepting, a held request is closed unanswered) and started again on the same port; a real
SQLite store and the real scheduler. The retry backoff is set to an hour, so a run that slept
it out would not finish; the run must instead notice the server through its probe (a GET
/health on the new server before its first /generate) and score everything.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _waiting import HANG_GUARD_S, wait_until
from faultserver import FaultServer

from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions, ScoreReport
from hcapo_store.storage.store import Store, count

MAX_CONTEXT = 2048
HOUR = 3600.0  # a backoff no test could sleep out


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Iterator[ReferenceServer]:
    server = make_server(tiny_model_dir)  # not started: the fault servers call ref.generate in-process
    yield server
    server.httpd.server_close()


def test_a_restarted_server_is_used_again_as_soon_as_it_answers(tmp_path, ref, tiny_model_dir):
    root = tmp_path / "episodes"
    write_standard_episodes(root, 2, seed=3, steps_per_subtask=1, output_words=12)
    store = Store.open(str(tmp_path / "store.db"))
    first = FaultServer(ref).start()
    port = int(first.url.rsplit(":", 1)[1])
    second: FaultServer | None = None
    try:
        ingest(store, [root])
        steps = count(store, "SELECT COUNT(*) FROM steps")
        prep = prepare(store, ScoreConfig(server=first.url, tokenizer=str(tiny_model_dir), max_context=MAX_CONTEXT))
        first.hold_answers = threading.Event()  # the first request arrives and waits: then the server dies
        # Never "down" and never out of attempts: only the backoff decides when the retry goes out.
        options = RunOptions(concurrency=1, backoff_base=HOUR, backoff_cap=HOUR, max_attempts=1000, down_after=1000)
        outcome: dict[str, ScoreReport | BaseException] = {}

        def score() -> None:
            try:
                outcome["report"] = run_scoring(store, prep, options)
            except BaseException as exc:  # shown by the assertion below
                outcome["error"] = exc

        worker = threading.Thread(target=score, name="score")
        worker.start()
        wait_until(lambda: first.requests >= 1 or not worker.is_alive(), "the first request at the server")
        first.die()  # the held request is closed unanswered; the port refuses connections
        first.hold_answers.set()
        # The run is now waiting out its backoff (recorded as a failed attempt); the server comes back.
        wait_until(
            lambda: count(store, "SELECT COUNT(*) FROM attempt_errors") >= 1 or not worker.is_alive(),
            "the failed attempt is recorded",
        )
        second = FaultServer(ref, port=port).start()
        worker.join(HANG_GUARD_S)  # a run that slept out its hour-long backoff would still be waiting
        assert not worker.is_alive(), "the run did not come back to the restarted server"
        assert "error" not in outcome, outcome
        report = outcome["report"]
        assert isinstance(report, ScoreReport)
        assert report.scored == steps and report.failed == 0 and report.server_down is None, report.summary()
        assert report.retried >= 1, report.summary()
        paths = [path.split("?", 1)[0] for path, _ in second.seen]
        assert "/health" in paths and "/generate" in paths, paths
        assert paths.index("/health") < paths.index("/generate"), paths  # the probe brought it back
        assert count(store, "SELECT COUNT(*) FROM attempts WHERE status = 'done'") == steps
    finally:
        first.hold_answers = None
        if second is not None:
            second.shutdown()
        store.close()
