"""examples/online_loop.py: on-policy iterations the way verl runs them — rollouts written by
GRPO group, followed and scored by the policy itself under each iteration's weight version,
advantages found by each sample's own ids; the same numbers through verl 0.9.1 itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _verl_venv
import pytest
from _hindsight import assert_advantage_moves_with_logprob, assert_advantages_follow_hindsight
from transformers import AutoTokenizer

from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.storage.store import Store

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow]


def _loop(python: str, work: Path, dump: Path, *extra: str, env: dict | None = None) -> list[dict]:
    out = subprocess.run(
        [python, str(REPO / "examples" / "online_loop.py"), "--workdir", str(work), "--iterations", "3"]
        + ["--groups", "2", "--group-size", "3", "--json", "--dump", str(dump), *extra],
        capture_output=True,
        text=True,
        timeout=900,
        env=env or {**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("online")
    return tmp, _loop(sys.executable, tmp / "work", tmp / "dump.jsonl")


def test_three_iterations_of_the_policy_scoring_itself(plain: tuple[Path, list[dict]]) -> None:
    tmp_path, iterations = plain
    work = tmp_path / "work"
    assert [i["weight_version"] for i in iterations] == ["iter-0", "iter-1", "iter-2"]
    assert len({i["scorer_id"] for i in iterations}) == 3
    with Store.open(str(work / "online.db")) as store:
        for it in iterations:
            assert scorer_spec(store, it["scorer_id"])["weight_version"] == it["weight_version"]
            # one batch per GRPO group, every sample found in its own group by its own ids
            assert it["batches"] == 2 and len(it["credit_runs"]) == 2 and it["samples"] == 6
            n = it["iteration"]
            assert it["episodes"] == [f"it{n}-g{g}-{k}" for g in range(2) for k in range(3)]
            for run in it["credit_runs"]:
                # each run's credits come from this iteration's scores alone
                (scorer,) = store.query(
                    "SELECT DISTINCT r.scorer_id FROM credit_runs r WHERE r.name = :n", {"n": run}, read_only=True
                )[1]
                assert scorer[0] == it["scorer_id"]
                (key,) = store.query("SELECT key FROM batches WHERE credit_run = :n", {"n": run}, read_only=True)[1]
                assert key[0].startswith(f"it{n}-g")
    for it in iterations:
        # outcome-only rollouts (no subtask rewards): the hindsight term is non-zero on most steps and
        # the advantages vary within episodes, not GRPO's group term alone
        assert it["hindsight_nonzero_steps"] > it["steps"] / 2, it
        assert it["varying_episodes"] > 0 and it["advantage_spread"] > 0, it
    tok = AutoTokenizer.from_pretrained(str(work / "model"))
    rows = [json.loads(line) for line in (tmp_path / "dump.jsonl").read_text().splitlines()]
    assert len(rows) == 6
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


def _tokenizers_release(python: str) -> str:
    if python == sys.executable:  # this interpreter's own: no process to ask
        import tokenizers

        return tokenizers.__version__
    out = subprocess.run(
        [python, "-c", "import tokenizers; print(tokenizers.__version__)"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_through_verl_the_loop_trains_on_the_same_numbers(plain: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """``--verl``: verl 0.9.1's compute_advantage with the hcapo reward manager and estimator
    (its own venv) gives the same advantages, hence the same losses, as the plain hand-off."""
    python = str(_verl_venv.verl_python())
    verl = _loop(python, tmp_path / "verl", tmp_path / "verl.jsonl", "--verl", env=_verl_venv.run_env())
    assert [i["through"] for i in verl] == ["verl"] * 3
    # The scorer id names the tokenizers release (docs/SCORING.md): verl's venv may pin another
    # one than this one, and then the two loops are rightly two scorers (and two run hashes).
    same_release = _tokenizers_release(sys.executable) == _tokenizers_release(python)
    for a, b in zip(plain[1], verl):
        assert a["episodes"] == b["episodes"] and len(a["credit_runs"]) == len(b["credit_runs"])
        if same_release:
            assert (a["scorer_id"], a["credit_runs"]) == (b["scorer_id"], b["credit_runs"])
        else:
            assert a["scorer_id"] != b["scorer_id"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    plain_rows = [json.loads(x) for x in (plain[0] / "dump.jsonl").read_text().splitlines()]
    verl_rows = [json.loads(x) for x in (tmp_path / "verl.jsonl").read_text().splitlines()]
    assert [r["ids"] for r in plain_rows] == [r["ids"] for r in verl_rows]
    assert [r["advantages"] for r in plain_rows] == [r["advantages"] for r in verl_rows]  # float32, passed on as is


def test_the_loops_advantages_follow_the_stored_hindsight_logprobs(plain: tuple[Path, list[dict]]) -> None:
    """Within each episode the advantages are ordered as the steps' Q_H, and raising one step's
    stored hindsight logprob raises its advantage once its batch's run is recomputed."""
    tmp_path, iterations = plain
    runs = [run for it in iterations for run in it["credit_runs"]]
    with Store.open(str(tmp_path / "work" / "online.db")) as store:
        assert_advantages_follow_hindsight(store, runs)
        assert_advantage_moves_with_logprob(store, runs)
