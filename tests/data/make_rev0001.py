"""Write tests/data/rev0001.db: a database made by the revision-0001 code, frozen for upgrade tests.

Run from a checkout at schema revision 0001 (commit 1448c2d):
    PYTHONPATH=<that checkout> python tests/data/make_rev0001.py tests/data/rev0001.db
It holds what the 0001 keys got wrong: a copied root ingested again (duplicate episodes),
two roots with the same directory names, a corrected reward (version 2), a Pi v1 session
without id, and a JSONL file with ``1`` vs ``"1"`` and an explicit id "line3" next to an
id-less line 3 (ingested twice: versions that flip-flop). Scores, attempts, tags and a
credit run cover every table. The episode files are rebuilt by ``build_inputs``.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

from hcapo_store.devkit.synth import EpisodeBuilder

ROOTS = {"pg-01": 100, "pg-02": 200}


def session_uuid(seed: int) -> str:
    return f"5e551011-0000-4000-8000-{seed:012d}"


def build_inputs(base: Path) -> dict[str, Path]:
    """The episode files; session ids are unique per episode (as real Pi sessions)."""
    paths: dict[str, Path] = {}
    for root, seed0 in ROOTS.items():
        for i in range(1, 4):
            b = EpisodeBuilder(seed=seed0 + i, episode_id=i, reward=round(0.1 * i + seed0 / 1000, 4)).standard()
            _set_session_id(b, session_uuid(seed0 + i))
            b.write(base / root / f"episode_{i:03d}")
        paths[root] = base / root
    old = EpisodeBuilder(version=1, seed=7, episode_id=9).standard()
    paths["v1"] = old.write(base / "old" / "episode_009")
    lines = [
        {"episode_id": 1, "reward": 0.5, "messages": _messages("one")},
        {"episode_id": "1", "reward": 0.25, "messages": _messages("string one")},
        {"reward": 0.75, "messages": _messages("no id")},
        {"episode_id": "line3", "reward": 0.125, "messages": _messages("explicit line3")},
    ]
    paths["jsonl"] = base / "eps.jsonl"
    paths["jsonl"].write_text("".join(json.dumps(x) + "\n" for x in lines))
    return paths


def _set_session_id(b: EpisodeBuilder, new: str) -> None:
    """Our own session id (whatever the builder's default), and the entry that points at it."""
    old = b.entries[0]["id"]
    b.entries[0]["id"] = new
    for entry in b.entries[1:]:
        if entry.get("parentId") == old:
            entry["parentId"] = new


def _messages(text: str) -> list[dict]:
    return [
        {"role": "user", "content": f"task {text}"},
        {"role": "assistant", "content": f"work {text}"},
        {"role": "tool", "tool_call_id": "t", "name": "bash", "content": "ok"},
        {"role": "assistant", "content": f"done {text}"},
    ]


def correct_reward(episode_dir: Path, reward: float) -> None:
    result = episode_dir / "result.json"
    data = json.loads(result.read_text())
    data["episode_reward"] = reward
    result.write_text(json.dumps(data, indent=2))


def main(out: Path) -> None:
    from hcapo_store.credits.compute import compute_credits
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.scoring.scorer import register
    from hcapo_store.storage import db
    from hcapo_store.storage.store import Store

    assert db.head_revision() == "0001", "run this with a checkout at schema revision 0001"
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        paths = build_inputs(base)
        store = Store.open(str(out))
        ingest(store, [paths["pg-01"]], tags={"run": "pg-01"})
        ingest(store, [paths["pg-02"]], tags={"run": "pg-02"})
        shutil.copytree(paths["pg-01"], base / "mirror" / "pg-01")
        ingest(store, [base / "mirror" / "pg-01"])  # 0001: three *new* episodes
        correct_reward(paths["pg-01"] / "episode_002", 0.99)
        ingest(store, [paths["pg-01"]])  # a new version of episode_002
        ingest(store, [paths["v1"]])
        ingest(store, [paths["jsonl"]])
        ingest(store, [paths["jsonl"]])  # 0001: "0 new, N changed" every time
        sid = register(
            store,
            {"backend": {"kind": "frozen-test", "model": "none"}, "max_context": 4096, "max_logprob_tokens": 2048},
        )
        _score_everything(store, sid)
        compute_credits(store, name="r1", scorer=sid)
        store.close()
    with Store.open(str(out)) as s:
        s.query("PRAGMA wal_checkpoint(TRUNCATE)", read_only=False)


def _score_everything(store, scorer_id: str) -> None:
    from sqlalchemy import text

    from hcapo_store.storage import db

    with db.write(store.engine) as conn:
        steps = conn.execute(text("SELECT s.id, s.episode_id, s.step_index FROM steps s")).all()
        for step_id, episode_id, step_index in steps:
            lp = [-0.5 - 0.01 * (step_id % 7), -0.25]
            conn.execute(
                text(
                    "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob, "
                    "total_action_tokens, skipped_action_tokens, truncated_prefix_tokens, input_tokens, "
                    "logprob_start_len, flattened, created_at) VALUES (:s, :sc, :lp, 2, :m, 2, 0, 0, 50, 48, 0, "
                    "'2026-11-21T00:00:00')"
                ),
                {"s": step_id, "sc": scorer_id, "lp": struct.pack("<2f", *lp), "m": sum(lp) / 2},
            )
            conn.execute(
                text(
                    "INSERT INTO attempts (step_id, scorer_id, episode_id, step_index, status, attempt_count, "
                    "updated_at) VALUES (:s, :sc, :e, :i, 'done', 1, 0)"
                ),
                {"s": step_id, "sc": scorer_id, "e": episode_id, "i": step_index},
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
