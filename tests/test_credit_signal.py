"""Issue 39: one set of credit defaults, library and CLI alike, and the hindsight signal measured
wherever advantages leave the store. Outcome-only rollouts (a reward per episode, no plan, no
subtask reward: the common case) get non-zero credits from the default run; a dense run asked
for over them is refused in one line; ``credits show``, ``diagnose``, ``report`` and the exports
say how much of a run carries the hindsight term, and "zero" when none does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_credits import add_scorer, add_scores

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits, has_subtask_rewards
from hcapo_store.credits.lookup import get_run
from hcapo_store.credits.params import CreditParams
from hcapo_store.credits.signal import CreditSignal, measure
from hcapo_store.errors import InvalidCreditParams
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


def _outcome_only(path: Path, rewards: tuple[float, ...] = (1.0, 0.0, 1.0, 0.0, 0.5, 1.0)) -> Path:
    """GRPO-style rollouts: a task, three action / tool-result turns, one reward per episode."""
    lines = []
    for i, reward in enumerate(rewards):
        messages = [{"role": "user", "content": f"task {i}: find the file"}]
        for t in range(3):
            messages.append({"role": "assistant", "content": f"ls dir{i}{t}"})
            messages.append({"role": "user", "content": f"tool: entry{t}"})
        lines.append(json.dumps({"episode_id": f"r{i}", "reward": reward, "messages": messages[:-1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def outcome_db(tmp_path: Path) -> Path:
    db_path = tmp_path / "o.db"
    with Store.open(str(db_path)) as store:
        ingest(store, [_outcome_only(tmp_path / "rollouts.jsonl")])
        add_scorer(store, "sc")
        add_scores(store, "sc", seed=3)
    return db_path


def _cli(db_path: Path, *args: str):
    return CliRunner().invoke(cli, ["--db", str(db_path), *args])


def test_the_library_and_the_cli_share_one_set_of_defaults() -> None:
    """paper = terminal unless asked, original = dense (the scripts'), in the library as in the CLI."""
    assert CreditParams().uses_dense and not CreditParams(variant="paper").uses_dense
    assert CreditParams(variant="paper", dense=True).uses_dense
    assert CreditParams().as_dict()["dense"] is True and CreditParams(variant="paper").as_dict()["dense"] is False
    from hcapo_store.cli.credits import CREDIT_OPTIONS, credits_compute

    dense_option = next(p for p in credits_compute.params if p.name == "dense_rewards")
    assert dense_option.default is None and len(CREDIT_OPTIONS) == 12  # None: the library decides
    # dense asked over steps without a subtask reward: one line naming both ways out
    with pytest.raises(InvalidCreditParams) as refused:
        CreditParams(dense=True).for_data(has_subtask_rewards=False)
    assert "--no-dense-rewards" in str(refused.value) and "--variant paper" in str(refused.value)
    assert "\n" not in str(refused.value)
    chosen, note = CreditParams().for_data(has_subtask_rewards=False)
    assert not chosen.uses_dense and note and note.startswith("terminal rewards: no step has a subtask reward")
    assert CreditParams().for_data(has_subtask_rewards=True) == (CreditParams(dense=True), None)


def test_the_default_run_on_outcome_only_data_has_a_hindsight_term(outcome_db: Path) -> None:
    r = _cli(outcome_db, "credits", "compute")
    assert r.exit_code == 0, r.output
    assert "terminal rewards: no step has a subtask reward" in r.output
    assert "hindsight term non-zero on" in r.output and "zero on all" not in r.output
    with Store.open(str(outcome_db)) as store:
        with db.read(store.engine) as conn:
            assert not has_subtask_rewards(conn)
        run = get_run(store, "default")  # the default command's run keeps its name
        assert run.params["dense"] is False  # recorded: the run used terminal rewards
        signal = run.credit_signal
        assert signal is not None and signal.note and signal.note.startswith("terminal rewards")
        # the original keeps reward >= 0.2: 4 of 6 episodes, 12 steps; most carry a hindsight term
        assert signal.steps == 12 and signal.hindsight_nonzero_steps > signal.steps / 2
        assert signal.varying_episodes > 0 and signal.advantage_spread > 0
        (nonzero,) = store.query(
            "SELECT COUNT(*) FROM step_credits WHERE run = 'default' AND q_h != 0", read_only=True
        )[1][0]
        assert nonzero > 0
    shown = _cli(outcome_db, "credits", "show", "default")
    assert shown.exit_code == 0 and "signal               hindsight term non-zero on" in shown.output
    assert json.loads(_cli(outcome_db, "credits", "show", "default", "--json").output)["signal"] == signal.as_dict()
    # the README's training path: export --credits default writes rows, its summary counts signs
    out = outcome_db.parent / "train.jsonl"
    r = _cli(outcome_db, "export", "dataset", str(out), "--credits", "default", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["episodes_in_dataset"] > 0 and summary["signal"]["hindsight_nonzero_steps"] > 0
    signs = summary["step_signs"]
    assert sum(signs.values()) == summary["total_steps"] and signs["negative"] == 0  # Eq. 8 weights are >= 0
    assert summary["nonzero_steps"] == signs["positive"]


def test_dense_rewards_asked_over_outcome_only_data_are_refused_in_one_line(outcome_db: Path) -> None:
    r = _cli(outcome_db, "credits", "compute", "--dense-rewards")
    assert r.exit_code != 0 and "Traceback" not in r.output
    (line,) = r.output.strip().splitlines()
    assert "--no-dense-rewards" in line and "--variant paper" in line
    with Store.open(str(outcome_db)) as store:
        assert store.query("SELECT COUNT(*) FROM credit_runs", read_only=True)[1][0][0] == 0  # nothing stored


def test_the_library_paper_run_is_the_cli_paper_run(outcome_db: Path) -> None:
    """StoreAdvantages and the online loop take CreditParams(variant="paper"): the same run as the CLI's."""
    with Store.open(str(outcome_db)) as store:
        made = compute_credits(store, CreditParams(variant="paper"), name="lib")
        signal = made.run.credit_signal
        assert signal is not None and signal.steps == 18 and signal.hindsight_nonzero_steps > 9
    r = _cli(outcome_db, "credits", "compute", "--variant", "paper")
    assert r.exit_code == 0 and "credit run 'lib' already has this scorer and these parameters" in r.output


def test_a_run_without_hindsight_term_is_called_zero(outcome_db: Path, tmp_path: Path) -> None:
    """omega 0: diagnose's verdict says zero, the report and the export warn, credits show says it."""
    assert _cli(outcome_db, "credits", "compute", "--variant", "paper", "--omega", "0", "--name", "flat").exit_code == 0
    d = _cli(outcome_db, "diagnose", "flat")
    assert d.exit_code == 0, d.output
    assert d.output.startswith("verdict: zero: the hindsight term is zero on all 18 steps")
    assert "GRPO plus a positional discount" not in d.output
    data = json.loads(_cli(outcome_db, "diagnose", "flat", "--json").output)
    assert data["signal"]["hindsight_nonzero_steps"] == 0 and data["warnings"][0]["code"] == "zero"
    shown = _cli(outcome_db, "credits", "show", "flat")
    assert "hindsight term zero on all 18 steps: the advantage is GRPO's group term alone" in shown.output
    r = _cli(outcome_db, "export", "dataset", str(tmp_path / "flat.jsonl"), "--credits", "flat")
    assert "HCAPO's hindsight term is not in these advantages" in r.output
    report = tmp_path / "report.html"
    assert _cli(outcome_db, "report", str(report), "--credits", "flat").exit_code == 0
    html = report.read_text()
    assert "warning: hindsight term zero on all 18 steps" in html and "verdict: zero" in html


def test_measure_counts_the_hindsight_term_and_the_spread() -> None:
    s = measure([1, 1, 1, 2, 2], [0.0, 0.5, -0.5, 0.0, 0.0], [1.0, 1.5, 0.5, -1.0, -1.0])
    assert (s.steps, s.hindsight_nonzero_steps, s.episodes, s.varying_episodes) == (5, 2, 2, 1)
    assert s.advantage_spread == pytest.approx((0.5 * (2 / 3) ** 0.5) / 2)
    assert not s.zero and CreditSignal.from_dict(s.as_dict()) == s
    flat = measure([1, 1, 2], [0.0, 0.0, 0.0], [0.7, 0.7, -0.7])
    assert flat.zero and flat.plain_grpo and flat.text().startswith("hindsight term zero on all 3 steps")
    none = measure([1, 2], [0.0, 0.0], [0.0, 0.0])
    assert none.zero and not none.plain_grpo  # no reward spread: plain GRPO is 0 as well, nothing refused
    assert measure([1, 1], [1.0, float("nan")], [float("nan"), float("nan")]).steps == 0


@pytest.mark.parametrize("variant", ["paper", "original"])
def test_one_step_episodes_carry_no_hindsight_scores(tmp_path: Path, variant: str) -> None:
    """The ratio is over an episode's own steps: on one-step episodes it is 1, so whatever the
    scores say the hindsight term is the return's z-score and the advantage GRPO's. The run's
    signal says so (no step's ratio off 1), it counts as plain GRPO, and the hand-off refuses it."""
    from test_credit_variants import _store_with

    from hcapo_store.errors import HandoffError
    from hcapo_store.training.handoff import Handoff

    trajs = [
        {"group": 0, "reward": r, "logprobs": [lp]} for r, lp in zip((1.0, 0.0, 0.5, 1.0), (-0.1, -3.0, -1.0, -7.0))
    ]
    store = _store_with(tmp_path, trajs)
    result = compute_credits(store, CreditParams(variant=variant, dense=False, min_reward=0.0), name="one")
    signal = get_run(store, "one").credit_signal
    assert signal is not None and signal.ratio_varying_steps == 0 and signal.hindsight_nonzero_steps > 0
    assert signal.scores_unused and signal.plain_grpo and signal.hindsight_share == 0.0
    assert "ratio rho is 1, or weighs a return of 0, on all 4 steps" in signal.text()
    assert "ratio rho is 1" in result.message
    with pytest.raises(HandoffError, match="one step each"):
        Handoff(store, "one", tokenizer=None)
    two = [dict(t, logprobs=[-1.0, t["logprobs"][0]]) for t in trajs]  # an earlier step: the ratio moves
    (tmp_path / "two").mkdir()
    store2 = _store_with(tmp_path / "two", two)
    compute_credits(store2, CreditParams(variant=variant, dense=False, min_reward=0.0), name="two")
    signal2 = get_run(store2, "two").credit_signal
    # -1.0 twice: ratio 1; reward 0 (terminal returns): the ratio weighs G = 0 on both steps
    assert signal2 is not None and signal2.ratio_varying_steps == 4 and not signal2.plain_grpo
    assert "ratio rho off 1 on 4 of 8 steps" in signal2.text()


@pytest.mark.parametrize("variant", ["paper", "original"])
def test_a_ratio_that_moves_only_on_reward_zero_episodes_carries_no_hindsight(tmp_path: Path, variant: str) -> None:
    """One-step episodes and one three-step episode of reward 0: under terminal returns its
    Q_H = rho * gamma^k * 0 is 0 whatever rho is, so the scores reach no advantage (two sets of
    scores give the same advantages) although its ratio moves: plain GRPO, refused by name.
    Before, its three steps counted as a moving ratio and the batch passed as HCAPO."""
    from test_credit_variants import _store_with

    from hcapo_store.errors import HandoffError
    from hcapo_store.training.handoff import Handoff

    def run(logprobs: list[float], where: Path):
        trajs = [
            {"group": 0, "reward": 1.0, "logprobs": [-0.5]},
            {"group": 0, "reward": 0.5, "logprobs": [-2.0]},
            {"group": 0, "reward": 0.0, "logprobs": logprobs},
        ]
        where.mkdir(exist_ok=True)
        store = _store_with(where, trajs)
        compute_credits(store, CreditParams(variant=variant, dense=False, min_reward=0.0), name="r")
        rows = store.query("SELECT c.advantage FROM credits c JOIN steps s ON s.id = c.step_id ORDER BY s.id")[1]
        return store, [r[0] for r in rows]

    store, first = run([-0.1, -3.0, -1.0], tmp_path / "a")
    _, second = run([-4.0, -0.2, -2.5], tmp_path / "b")
    assert first == pytest.approx(second, abs=1e-12)  # the scores change nothing
    signal = get_run(store, "r").credit_signal
    assert signal is not None and signal.ratio_varying_steps == 0 and signal.scores_unused and signal.plain_grpo
    with pytest.raises(HandoffError, match="or weighs a return of 0"):
        Handoff(store, "r", tokenizer=None)
