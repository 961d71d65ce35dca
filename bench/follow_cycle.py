"""Benchmark: what one `follow` cycle costs as the store grows (issue 34 item 2).

    python bench/follow_cycle.py --sizes 1000 10000 100000 --rounds 10
    python bench/follow_cycle.py --sizes 100000 --repo /path/to/another/checkout   # pair two commits
    python bench/follow_cycle.py --sizes 100000 --queued   # the others' steps queued by an earlier run

The store holds N episodes (one synthetic episode, its rows cloned by bulk insert: no
ingest, no scoring) that lie outside the followed folder; the followed folder holds one
published batch. Measured, per cycle, in this process:

- an **idle** cycle (nothing new): wall time, database time (connections held out of the
  engine's pool: statements and fetching their rows) and the number of statements;
- a **one-new-episode** cycle: a new episode lands in its own step folder (group size 1),
  is ingested, scored against a zero-latency server (bench/bookkeeping.py's) and published.

With ``--queued``, every stored episode's steps are queued for the scorer first (what a
whole-store ``score`` run leaves behind when it is stopped), so the queue holds the store's
rows too.

Budget: the database work of an idle cycle stays flat, at most 50 ms at 100k episodes.
``--repo`` imports hcapo_store from another checkout (e.g. ``git archive COMMIT``), so the same
script measures before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000], help="stored episodes")
    ap.add_argument("--rounds", type=int, default=10, help="cycles measured of each kind")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose hcapo_store is measured")
    ap.add_argument("--json", action="store_true", help="one JSON object per size")
    ap.add_argument("--queued", action="store_true", help="queue every stored episode's steps before following")
    return ap.parse_args()


class DbClock:
    """Database time: how long connections were held out of the engine's pool (statements and
    fetching their rows), and the statements sent, from the engine's own events."""

    def __init__(self, engine: Any) -> None:
        from sqlalchemy import event

        self.seconds, self.statements = 0.0, 0
        self._out: dict[int, float] = {}
        event.listen(
            engine.pool, "checkout", lambda dbapi, record, proxy: self._out.__setitem__(id(record), time.perf_counter())
        )
        event.listen(engine.pool, "checkin", self._checkin)
        event.listen(engine, "after_cursor_execute", self._statement)

    def _checkin(self, dbapi: Any, record: Any) -> None:
        started = self._out.pop(id(record), None)
        if started is not None:
            self.seconds += time.perf_counter() - started

    def _statement(self, *_: Any) -> None:
        self.statements += 1

    def reset(self) -> None:
        self.seconds, self.statements = 0.0, 0


def _clone(store: Any, n: int) -> None:
    """``n`` stored episodes: the first episode's row and steps copied under new keys (bulk)."""
    from sqlalchemy import text

    with store.engine.begin() as conn:
        row = dict(conn.execute(text("SELECT * FROM episodes ORDER BY id LIMIT 1")).mappings().one())
        steps = [
            dict(s)
            for s in conn.execute(text("SELECT * FROM steps WHERE episode_id = :e"), {"e": row["id"]}).mappings()
        ]
        first = int(conn.execute(text("SELECT max(id) FROM episodes")).scalar_one()) + 1
        cols = [c for c in row if c != "id"]
        step_cols = [c for c in steps[0] if c not in ("id", "episode_id")]
        insert_ep = text(
            f"INSERT INTO episodes (id, {', '.join(cols)}) VALUES (:id, {', '.join(':' + c for c in cols)})"
        )
        insert_step = text(
            f"INSERT INTO steps (episode_id, {', '.join(step_cols)}) VALUES (:episode_id, {', '.join(':' + c for c in step_cols)})"
        )
        for start in range(0, n, 5000):
            ids = range(first + start, first + min(n, start + 5000))
            conn.execute(
                insert_ep,
                [
                    {
                        **row,
                        "id": i,
                        "source_key": f"bench:{i}",
                        "name": f"elsewhere/episode_{i}",
                        "source_path": f"/elsewhere/{i}",
                    }
                    for i in ids
                ],
            )
            conn.execute(insert_step, [{**s, "episode_id": i} for i in ids for s in steps])


def _one_size(n: int, url: str, tokenizer: str, rounds: int, queued: bool) -> dict[str, Any]:
    from hcapo_store.devkit.synth import EpisodeBuilder
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.online.follow import FollowConfig, Follower
    from hcapo_store.scoring import work_queue
    from hcapo_store.scoring.job import ScoreConfig, prepare
    from hcapo_store.scoring.scheduler import RunOptions
    from hcapo_store.scoring.scorer import register
    from hcapo_store.storage.store import Store

    def episode(directory: Path, i: int) -> None:
        EpisodeBuilder(seed=i, episode_id=i, reward=0.1 * (i % 10)).standard(steps_per_subtask=1, output_words=5).write(
            directory
        )

    with tempfile.TemporaryDirectory(prefix="hcapo-bench-cycle-") as tmp, Store.open(str(Path(tmp) / "s.db")) as store:
        seed = Path(tmp) / "seed"
        episode(seed / "episode_000", 10**6)
        ingest(store, [seed])
        _clone(store, n - 1)
        root = Path(tmp) / "rollouts"
        episode(root / "step_0000" / "episode_000", 1)
        prep = prepare(store, ScoreConfig(server=url, tokenizer=tokenizer, max_context=2048))
        if queued:
            register(store, prep.spec)
            conv = prep.spec["conversion"]
            work_queue.enqueue(
                store,
                prep.scorer_id,
                include_thinking=conv["include_thinking"],
                max_tool_result_chars=conv["max_tool_result_chars"],
            )
        follower = Follower(store, prep, FollowConfig(paths=[root], group_size=1), RunOptions(concurrency=1))
        first = follower.cycle()
        assert len(first.published) == 1, "the first batch was not published"
        clock = DbClock(store.engine)
        idle_wall, idle_db, idle_statements = [], [], []
        new_wall, new_db, new_statements = [], [], []

        def timed_cycle(wall: list[float], dbs: list[float], statements: list[int]) -> Any:
            clock.reset()
            t = time.perf_counter()
            report = follower.cycle()
            wall.append(time.perf_counter() - t)
            dbs.append(clock.seconds)
            statements.append(clock.statements)
            return report

        for _ in range(rounds):
            assert not timed_cycle(idle_wall, idle_db, idle_statements).published
        for r in range(rounds):
            episode(root / f"step_{r + 1:04d}" / "episode_000", 100 + r)
            report = timed_cycle(new_wall, new_db, new_statements)
            assert len(report.published) == 1, "the new episode's batch was not published in its cycle"
        stored = store.query("SELECT count(*) FROM episodes", read_only=True)[1][0][0]
    ms = lambda v: round(1000 * statistics.median(v), 2)  # noqa: E731
    return {
        "stored_episodes": stored,
        "idle_cycle_ms": ms(idle_wall),
        "idle_db_ms": ms(idle_db),
        "idle_db_ms_max": round(1000 * max(idle_db), 2),
        "idle_statements": statistics.median(idle_statements),
        "new_episode_cycle_ms": ms(new_wall),
        "new_episode_db_ms": ms(new_db),
        "new_episode_statements": statistics.median(new_statements),
        "rounds": rounds,
        "queued": queued,
    }


def main() -> None:
    args = _args()
    sys.path.insert(0, str(BENCH))
    from bookkeeping import start_server  # it puts this checkout first on sys.path: the measured one goes before it

    sys.path.insert(0, str(args.repo.resolve()))
    for name in [m for m in sys.modules if m == "hcapo_store" or m.startswith("hcapo_store.")]:
        del sys.modules[name]
    import hcapo_store
    from hcapo_store.devkit.tiny_model import build_demo_tokenizer

    measured = Path(hcapo_store.__file__).resolve().parent.parent
    if measured != args.repo.resolve():
        raise SystemExit(f"hcapo_store came from {measured}, not {args.repo}")

    work = Path(tempfile.mkdtemp(prefix="hcapo-bench-cycle-tok-"))
    tokenizer = str(build_demo_tokenizer(work / "tokenizer"))
    url, server = start_server(tokenizer, backlog=64)
    try:
        for n in args.sizes:
            result = {"repo": str(args.repo), **_one_size(n, url, tokenizer, args.rounds, args.queued)}
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print(
                    f"{result['stored_episodes']:>7} stored: idle cycle {result['idle_cycle_ms']} ms "
                    f"(database {result['idle_db_ms']} ms, max {result['idle_db_ms_max']} ms, "
                    f"{result['idle_statements']:g} statements); one new episode {result['new_episode_cycle_ms']} ms "
                    f"(database {result['new_episode_db_ms']} ms, {result['new_episode_statements']:g} statements); "
                    f"medians of {result['rounds']}",
                    flush=True,
                )
    finally:
        server.terminate()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
