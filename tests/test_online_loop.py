"""examples/online_loop.py: three on-policy iterations where the policy scores itself; every
iteration's scores carry its weight version and the advantages fall on action tokens only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_three_iterations_of_the_policy_scoring_itself(tmp_path: Path) -> None:
    work = tmp_path / "work"
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "online_loop.py"), "--workdir", str(work), "--iterations", "3"]
        + ["--group-size", "4", "--json", "--dump", str(tmp_path / "dump.jsonl")],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr
    iterations = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [i["weight_version"] for i in iterations] == ["iter-0", "iter-1", "iter-2"]
    assert len({i["scorer_id"] for i in iterations}) == 3
    with Store.open(str(work / "online.db")) as store:
        for it in iterations:
            assert scorer_spec(store, it["scorer_id"])["weight_version"] == it["weight_version"]
            # the run's credits come from this iteration's scores alone
            (scorer,) = store.query(
                "SELECT DISTINCT r.scorer_id FROM credit_runs r WHERE r.name = :n",
                {"n": it["credit_run"]},
                read_only=True,
            )[1]
            assert scorer[0] == it["scorer_id"]
            n = store.query(
                "SELECT count(*) FROM step_credits c JOIN scores s ON s.step_id = c.step_id AND s.scorer_id = :s "
                "WHERE c.run = :n",
                {"s": it["scorer_id"], "n": it["credit_run"]},
                read_only=True,
            )[1][0][0]
            assert n == it["steps"] > 0
    tok = AutoTokenizer.from_pretrained(str(work / "model"))
    rows = [json.loads(line) for line in (tmp_path / "dump.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    weighted = 0
    for row in rows:
        actions = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        runs, current = [], []
        for token, a in zip(row["ids"], row["advantages"]):
            if a != 0:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        for span in runs:
            text = tok.decode(span, skip_special_tokens=True).strip()
            assert any(text and text in action for action in actions), (text, actions)
            weighted += 1
    assert weighted > 0
