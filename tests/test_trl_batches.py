"""StoreAdvantages gives each generation batch its own GRPO groups: an evaluation pass at step N,
a second batch of a step (steps_per_generation < gradient_accumulation_steps) and a restart that
reuses ``run_id`` never put one batch's rollouts into another's group statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _rollout_batches import sign_batch
from test_trl_grpo import qwen3
from transformers import AutoTokenizer

from hcapo_store.errors import HandoffError
from hcapo_store.storage.store import Store
from hcapo_store.training.trl_grpo import RolloutBatch, StoreAdvantages


def _batch(tok, model, step: int, texts: list[str], rewards: list[float], size: int, mode: str = "train", single=False):
    return sign_batch(
        tok, model, step=step, signs=texts, rewards=rewards, group_size=size, mode=mode, earlier_turn=not single
    )


@pytest.fixture
def tok(demo_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))


def _alone(tmp_path: Path, batch: RolloutBatch, tok_dir: Path) -> list[np.ndarray]:
    """The batch's advantages in a store of its own."""
    with Store.open(str(tmp_path / "alone.db")) as store:
        return StoreAdvantages(store, tokenizer=tok_dir, workdir=tmp_path / "alone", run_id="R")(batch)


@pytest.mark.parametrize("first_mode", ["eval", "train"])
def test_a_second_batch_at_one_step_has_groups_of_its_own(tmp_path: Path, tok, demo_tokenizer_dir: Path, first_mode):
    model = qwen3(tok).eval()
    first = _batch(
        tok, model, 1, ["!!!!", "#", "!", "##", "!!", "$", "!!!", "%"], [4, 0, 1, 0, 2, 0, 3, 0], 8, first_mode
    )
    second = _batch(tok, model, 1, ["!", "#", "!!", "$", "!!!", "(", "!!!!", "+"], [1, 0, 2, 0, 3, 0, 4, 0], 4)
    with Store.open(str(tmp_path / "s.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "rollouts", run_id="R")
        source(first)
        got = source(second)
        run = source.runs[1]
        credited = store.query(
            "SELECT COUNT(DISTINCT s.episode_id) FROM credits c JOIN credit_runs r ON r.id = c.run_id "
            "JOIN steps s ON s.id = c.step_id WHERE r.name = :n",
            {"n": run},
        )[1][0][0]
        names = source.episodes[1]
        assert credited == len(second.completion_ids)  # its own eight rollouts, none of the first batch's
        assert len(set(names)) == 8 and all(n and ("-s1.1-" in n or "-s1-" in n) for n in names)
    want = _alone(tmp_path, second, demo_tokenizer_dir)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    assert any(np.abs(a).max() > 0.1 for a in got)  # the batch carries a signal to compare


def test_a_restart_with_the_same_run_id_does_not_reuse_a_batch_folder(tmp_path: Path, tok, demo_tokenizer_dir: Path):
    model = qwen3(tok).eval()
    before = _batch(tok, model, 0, ["!!!!", "#", "!", "##"], [4, 0, 1, 0], 4)
    after = _batch(tok, model, 0, ["!", "#", "!!", "$"], [1, 0, 2, 0], 4)
    with Store.open(str(tmp_path / "s.db")) as store:
        StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "rollouts", run_id="R")(before)
        restarted = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "rollouts", run_id="R")
        got = restarted(after)
        assert all("-s0.1-" in n for n in restarted.episodes[0])
    for a, b in zip(got, _alone(tmp_path, after, demo_tokenizer_dir), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_a_restart_with_the_same_run_id_and_another_workdir_stores_its_own_rollouts(
    tmp_path: Path, tok, demo_tokenizer_dir: Path
):
    """JSONL episodes are keyed by file name: a restart reusing ``run_id`` with a fresh workdir
    (a temp dir, a cleaned folder) wrote the same file names, so the same rollouts were the
    earlier run's episodes ("unchanged": not found by path, every row 0, nothing raised) and
    changed ones new versions of them. Each batch now takes names no batch of the store has."""
    model = qwen3(tok).eval()
    texts, rewards = ["!!!!", "#", "!", "##"], [4, 0, 1, 0]
    first = _batch(tok, model, 0, texts, rewards, 4)
    with Store.open(str(tmp_path / "s.db")) as store:
        StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "one", run_id="R")(first)
        for k, batch in enumerate((first, _batch(tok, model, 0, ["!", "#", "!!", "$"], [1, 0, 2, 0], 4))):
            restarted = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / f"new{k}", run_id="R")
            got = restarted(batch)
            assert all(f"-s0.{k + 1}-" in n for n in restarted.episodes[0]) and not restarted.skipped
            (tmp_path / f"alone{k}").mkdir()
            for a, b in zip(got, _alone(tmp_path / f"alone{k}", batch, demo_tokenizer_dir), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
            assert any(np.abs(a).max() > 0.1 for a in got)
        current = store.query("SELECT COUNT(*) FROM episodes WHERE version > 1")[1][0][0]
        assert current == 0  # no earlier run's episode got a new version


def test_an_evaluation_batch_keeps_out_of_its_steps_records(tmp_path: Path, tok, demo_tokenizer_dir: Path):
    """The per-step records (runs, signals, episodes) are the step's training batch's; the
    trainer logs each batch's own signal (last_signal), never another batch's of its step."""
    model = qwen3(tok).eval()
    train = _batch(tok, model, 1, ["!!!!", "#", "!", "##"], [4, 0, 1, 0], 4)
    evaluation = _batch(tok, model, 1, ["!", "#", "!!", "$"], [1, 0, 2, 0], 4, "eval")
    with Store.open(str(tmp_path / "s.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "r", run_id="R")
        source(train)
        run, names, signal = source.runs[1], source.episodes[1], source.signals[1]
        source(evaluation)
        assert source.last_signal is not None and source.last_signal != signal
        assert (source.runs[1], source.episodes[1], source.signals[1]) == (run, names, signal)


def test_an_evaluation_batch_keeps_out_of_its_steps_skipped_rows(tmp_path: Path, tok, demo_tokenizer_dir: Path):
    """``skipped`` / ``refused`` hold the step's training batch's rows: an evaluation pass at
    the same step, whose row numbers are the same, neither adds to them nor overwrites them;
    each batch's own are ``last_skipped`` / ``last_refused`` (the trainer logs their counts)."""
    model = qwen3(tok).eval()
    nan = float("nan")
    train = _batch(tok, model, 1, ["!!!!", "#", "!", "##"], [4, 0, nan, 0], 4)  # row 2: no reward function scored it
    evaluation = _batch(tok, model, 1, ["!", "#", "!!", "$"], [nan, 0, 2, 1], 4, "eval")  # row 0 this time
    with Store.open(str(tmp_path / "s.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "r", run_id="R")
        source(train)
        assert list(source.skipped) == [(1, 2)] and list(source.last_skipped) == [2]
        source(evaluation)
        assert list(source.skipped) == [(1, 2)]  # the training batch's, untouched
        assert list(source.last_skipped) == [0] and "no reward" in source.last_skipped[0]
        again = _batch(tok, model, 1, ["!!", "#", "!", "##"], [2, 0, 1, 0], 4)  # a further training batch at step 1
        source(again)
        assert source.skipped == {} and source.last_skipped == {}  # it replaces the step's


def test_a_trainer_with_tools_is_told_once_that_their_definitions_are_not_scored(
    tmp_path: Path, tok, demo_tokenizer_dir: Path
):
    """TRL's tools= put their definitions in the policy's prompt; the store keeps the messages
    only, so the hindsight prompts lack them: said once, never silent (and the advantages still
    reach the trainer)."""
    import dataclasses
    import warnings

    model = qwen3(tok).eval()
    first = dataclasses.replace(_batch(tok, model, 1, ["!!!!", "#", "!", "##"], [4, 0, 1, 0], 4), tools=2)
    second = dataclasses.replace(_batch(tok, model, 2, ["!", "#", "!!", "$"], [1, 0, 2, 0], 4), tools=2)
    with Store.open(str(tmp_path / "s.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "r", run_id="R")
        with pytest.warns(UserWarning, match=r"the trainer has 2 tool\(s\): .* not the tool definitions"):
            values = source(first)
        assert any(np.any(v != 0) for v in values)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            source(second)
        assert not [w for w in caught if "tool definitions" in str(w.message)]  # once per source


def test_single_turn_rollouts_carry_no_hindsight_and_are_refused_as_plain_grpo(
    tmp_path: Path, tok, demo_tokenizer_dir: Path
) -> None:
    """One step per episode: HCAPO's ratio (over an episode's own steps) is 1 on every step, the
    hindsight term is the reward's z-score whatever the policy scored, and the advantages are
    GRPO's. Such a batch is refused by name (as any plain-GRPO batch), unless asked for; two
    policies that score the rollouts differently then give the same advantages."""
    texts, rewards = ["!!!!", "#", "!", "##", "!!", "$", "!!!", "%"], [4.0, 0, 1, 0, 2, 0, 3, 0]
    with Store.open(str(tmp_path / "s.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "r", run_id="R")
        with pytest.raises(
            HandoffError, match="the ratio rho is 1, or weighs a return of 0, on all 8 steps.*one step each"
        ):
            source(_batch(tok, qwen3(tok).eval(), 0, texts, rewards, 4, single=True))
        outs = []
        for seed in (0, 1):
            plain = StoreAdvantages(
                store,
                tokenizer=demo_tokenizer_dir,
                workdir=tmp_path / f"p{seed}",
                run_id=f"P{seed}",
                allow_zero_hindsight=True,
            )
            outs.append(plain(_batch(tok, qwen3(tok, seed).eval(), 0, texts, rewards, 4, single=True)))
            assert plain.signals[0].scores_unused and plain.signals[0].hindsight_share == 0.0
        for a, b in zip(*outs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)  # the policy's scores changed nothing
    with Store.open(str(tmp_path / "h.db")) as store:  # the same rollouts after an earlier turn: they do
        outs = []
        for seed in (0, 1):
            source = StoreAdvantages(
                store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / f"h{seed}", run_id=f"H{seed}"
            )
            outs.append(source(_batch(tok, qwen3(tok, seed).eval(), 0, texts, rewards, 4)))
            assert source.signals[0].ratio_varying_steps > 0
        assert any(not np.allclose(a, b, atol=1e-6) for a, b in zip(*outs, strict=True))
