"""TRL's GRPOTrainer on per-token advantages (training/trl_grpo.py): real TRL, a tiny Qwen3 model
built from a config on the CPU, the demo tokenizer, a real store. The loss moves each token the
way its advantage says, advantages fall only on trained completion tokens, the store's are the
Handoff's own, a NaN never reaches the trainer, and the TRL methods it overrides are held against
the installed TRL."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomllib

pytest.importorskip("trl")
import torch
from _tiny_qwen3 import tiny_qwen3
from conftest import REPO, TOKENIZERS
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from hcapo_store.errors import HandoffError
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import Handoff
from hcapo_store.training.trl_grpo import (
    TRL_VERSIONS,
    HandoffAdvantages,
    HCAPOGRPOTrainer,
    RolloutBatch,
    StoreAdvantages,
    check_trl,
    place,
    trl_advantages,
)

# Single-character tokens of the demo vocabulary that no merge joins: any sequence of them
# decodes and re-tokenizes to itself, so the store's rendering of a completion is the policy's ids.
CANONICAL = "!#$%(+"
# The keys of TRL's returned dict this subclass reads or replaces.
READ_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"}


@pytest.fixture
def tok(demo_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))


def qwen3(tok, seed: int = 0) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 (q/k norms, GQA, head_dim) of the tokenizer's vocabulary, random weights."""
    return tiny_qwen3(
        len(tok), hidden=64, layers=2, seed=seed, max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip


def config(tmp_path: Path, tok, allowed: str = CANONICAL, **kw: Any) -> GRPOConfig:
    keep = {tok.convert_tokens_to_ids(c) for c in allowed} | {tok.eos_token_id}
    assert all(tok.encode(c, add_special_tokens=False) == [tok.convert_tokens_to_ids(c)] for c in allowed)
    base: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        disable_tqdm=True,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        mask_truncated_completions=True,
        seed=0,
        # the policy writes only `allowed` and its end-of-turn token (a random model would write anything)
        generation_kwargs={"suppress_tokens": [t for t in range(len(tok)) if t not in keep]},
    )
    return GRPOConfig(**{**base, **kw})


def prompts(n: int, history: bool = False) -> Dataset:
    first = [{"role": "user", "content": "Write some signs."}]
    if history:  # an earlier turn of the agent sits in the prompt: its tokens are not this completion's
        first += [{"role": "assistant", "content": "!!#"}, {"role": "user", "content": "More."}]
    return Dataset.from_list([{"prompt": first}] * n)


def bangs(completions: list, **_: Any) -> list[float]:
    return [float(c[0]["content"].count("!")) for c in completions]


def record(trainer: GRPOTrainer) -> list[dict[str, Any]]:
    """Every dict ``_generate_and_score_completions`` hands to the loss, as it is handed."""
    seen: list[dict[str, Any]] = []
    inner = trainer._generate_and_score_completions

    def wrapped(inputs):
        out = inner(inputs)
        seen.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in out.items()})
        return out

    trainer._generate_and_score_completions = wrapped  # type: ignore[method-assign]
    return seen


def completion_logps(model, batch: dict[str, Any]) -> torch.Tensor:
    """log pi(completion token) at every completion position, computed plainly."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    width = batch["completion_ids"].size(1)
    logp = torch.log_softmax(logits[:, -width - 1 : -1], -1)
    return logp.gather(-1, batch["completion_ids"][..., None])[..., 0]


# ---- TRL's methods, held against the installed TRL ---------------------------------------------


def test_the_overridden_methods_are_the_installed_trls() -> None:
    """Fails loudly when TRL renames, re-signs or re-shapes what the subclass overrides."""
    check_trl()  # the installed TRL is in the supported range
    for outside in ("1.15.2", f"{TRL_VERSIONS[1][0]}.{TRL_VERSIONS[1][1]}.0", "2.0.0"):
        with pytest.raises(RuntimeError, match=r"supports trl>=1\.16,<1\.17"):
            check_trl(outside)
    assert list(inspect.signature(GRPOTrainer._generate_and_score_completions).parameters) == ["self", "inputs"]
    assert list(inspect.signature(GRPOTrainer._calculate_rewards).parameters) == [
        "self",
        "inputs",
        "prompts",
        "completions",
        "completion_ids_list",
    ]
    # the loss takes a (B, T) advantage as it is: it unsqueezes only a (B,) one
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    assert "if advantages.dim() == 1:" in loss and "advantages.unsqueeze(1)" in loss
    # both pins in pyproject (the trl extra and the test extra) are TRL_VERSIONS
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pin = f"trl>={TRL_VERSIONS[0][0]}.{TRL_VERSIONS[0][1]},<{TRL_VERSIONS[1][0]}.{TRL_VERSIONS[1][1]}"
    for extra in ("trl", "test"):
        assert [r for r in extras[extra] if re.match(r"trl\b", r)] == [pin], extra


def test_trls_returned_dict_has_the_keys_read(tmp_path: Path, tok) -> None:
    """A plain GRPOTrainer on a real batch: the keys read and their shapes, (B,) advantages."""
    trainer = GRPOTrainer(
        model=qwen3(tok), reward_funcs=bangs, args=config(tmp_path, tok), train_dataset=prompts(4), processing_class=tok
    )
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    out = trainer._generate_and_score_completions(batch)
    assert READ_KEYS <= set(out), sorted(set(out))
    b, width = out["completion_ids"].shape
    assert out["advantages"].shape == (b,)
    assert out["completion_mask"].shape == (b, width) and out["prompt_mask"].shape == out["prompt_ids"].shape


# ---- the direction of the loss -------------------------------------------------------------------


@pytest.mark.slow  # trains 3 steps (~4 s); fast: test_trls_own_advantage_as_the_source_is_plain_grpo
def test_tokens_gain_or_lose_log_probability_as_their_advantage_says(tmp_path: Path, tok) -> None:
    plus, minus = tok.convert_tokens_to_ids("!"), tok.convert_tokens_to_ids("#")
    batches: list[RolloutBatch] = []

    def by_token(batch: RolloutBatch) -> list[list[float]]:
        batches.append(batch)
        return [[1.0 if t == plus else -1.0 if t == minus else 0.0 for t in ids] for ids in batch.completion_ids]

    model = qwen3(tok)
    before = qwen3(tok)
    before.load_state_dict(model.state_dict())
    args = config(tmp_path, tok, max_steps=3, per_device_train_batch_size=8, num_generations=8, max_completion_length=6)
    trainer = HCAPOGRPOTrainer(
        model=model,
        reward_funcs=bangs,
        args=args,
        train_dataset=prompts(24),
        processing_class=tok,
        advantages=by_token,
    )
    seen = record(trainer)
    trainer.train()
    assert trainer.state.global_step == 3 and len(seen) == 3 and len(batches) == 3
    first = seen[0]
    trained = (first["completion_mask"] == 1) & (first["advantages"] != 0)
    assert trained.any()
    delta = completion_logps(trainer.model.eval(), first) - completion_logps(before.eval(), first)
    ids = first["completion_ids"]
    up = delta[(ids == plus) & (first["completion_mask"] == 1)]
    down = delta[(ids == minus) & (first["completion_mask"] == 1)]
    assert up.numel() and down.numel()
    assert float(up.mean()) > 0 > float(down.mean())
    # exactly the source's values on trained completion tokens, 0 on padding
    for out, batch in zip(seen, batches):
        for i, ids_i in enumerate(batch.completion_ids):
            want = [(1.0 if t == plus else -1.0 if t == minus else 0.0) * m for t, m in zip(ids_i, batch.loss_mask[i])]
            assert out["advantages"][i, : len(ids_i)].tolist() == want
            assert not out["advantages"][i, len(ids_i) :].any()
        assert out["advantages"].shape == out["completion_ids"].shape


# ---- HCAPO from the store -------------------------------------------------------------------------


def test_store_advantages_are_the_handoffs_on_completion_tokens_only(
    tmp_path: Path, tok, demo_tokenizer_dir: Path
) -> None:
    with Store.open(str(tmp_path / "grpo.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "rollouts", run_id="t")
        batches: list[RolloutBatch] = []

        def keep(batch: RolloutBatch):
            batches.append(batch)
            return source(batch)

        trainer = HCAPOGRPOTrainer(
            model=qwen3(tok),
            reward_funcs=bangs,
            args=config(tmp_path, tok),
            train_dataset=prompts(8, history=True),
            processing_class=tok,
            advantages=keep,
        )
        seen = record(trainer)
        trainer.train()
        assert trainer.state.global_step == 2 and sorted(source.runs) == [0, 1]
        assert len(set(source.scorers.values())) == 2  # each step scored by the policy of that step
        checked = 0
        for out, batch in zip(seen, batches):
            handoff = Handoff(store, source.runs[batch.step], tokenizer=demo_tokenizer_dir)  # read back independently
            for i, name in enumerate(source.episodes[batch.step]):
                width = len(batch.completion_ids[i])
                placed = out["advantages"][i].numpy()
                assert np.isfinite(placed).all() and not placed[width:].any()
                if name is None or not any(batch.loss_mask[i]):
                    assert not placed.any()
                    continue
                ids = batch.prompt_ids[i] + batch.completion_ids[i]
                credit = handoff.advantages(name, ids)
                start = len(batch.prompt_ids[i])
                assert credit.mask[:start].any()  # the earlier turn's tokens, in the prompt: not trained here
                # the completion is a step of its own, unless it is empty (the end-of-turn token alone)
                assert credit.mask[start:].any() or batch.completions[i][0]["content"] == ""
                np.testing.assert_array_equal(placed[:width], credit.advantages[start:] * np.array(batch.loss_mask[i]))
                checked += 1
        assert checked >= 4
        assert not source.refused
        # the same rollouts looked up in the store (HandoffAdvantages: rollouts an agent loop stored)
        lookup = HandoffAdvantages(
            lambda batch: Handoff(store, source.runs[batch.step], tokenizer=demo_tokenizer_dir), source.episode_name
        )
        looked_up = 0
        for out, batch in zip(seen, batches):
            if None not in source.episodes[batch.step]:
                for i, row in enumerate(lookup(batch)):
                    np.testing.assert_array_equal(out["advantages"][i, : len(row)].numpy(), row.astype(np.float32))
                looked_up += 1
        assert looked_up >= 1


def test_a_rollout_the_store_renders_otherwise_is_refused_by_name(
    tmp_path: Path, tok, demo_tokenizer_dir: Path
) -> None:
    """' the' tokens: the store keeps the completion's text stripped, so its tokens are not the
    policy's. Strict: one line naming the step, the row and the episode; else 0 and listed."""
    words = " the"
    assert len(tok.encode(words, add_special_tokens=False)) == 1
    keep = {tok.encode(words, add_special_tokens=False)[0], tok.eos_token_id}
    gen = {"suppress_tokens": [t for t in range(len(tok)) if t not in keep]}
    with Store.open(str(tmp_path / "grpo.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "r1", run_id="a")
        trainer = HCAPOGRPOTrainer(
            model=qwen3(tok),
            reward_funcs=lambda completions, **_: [float(len(c[0]["content"])) for c in completions],
            args=config(tmp_path, tok, allowed="", generation_kwargs=gen, mask_truncated_completions=False),
            train_dataset=prompts(4, history=True),
            processing_class=tok,
            advantages=source,
        )
        with pytest.raises(
            HandoffError, match=r"step 0, row \d+: episode a_step000000_g00000\.jsonl#a-s0-r\d+: step 1's own"
        ):
            trainer.train()
        lenient = StoreAdvantages(
            store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "r2", run_id="b", strict=False
        )
        trainer = HCAPOGRPOTrainer(
            model=qwen3(tok),
            reward_funcs=lambda completions, **_: [float(len(c[0]["content"])) for c in completions],
            args=config(
                tmp_path, tok, allowed="", generation_kwargs=gen, mask_truncated_completions=False, max_steps=1
            ),
            train_dataset=prompts(4, history=True),
            processing_class=tok,
            advantages=lenient,
        )
        seen = record(trainer)
        trainer.train()
        assert lenient.refused and all(why for steps in lenient.refused.values() for why in steps.values())
        for (_, row), _steps in lenient.refused.items():
            assert not seen[0]["advantages"][row].any()


# ---- what never reaches the trainer --------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "short"])
def test_a_nan_inf_or_misshapen_advantage_never_reaches_the_trainer(tmp_path: Path, tok, bad) -> None:
    def broken(batch: RolloutBatch) -> list[list[float]]:
        rows = [[0.5] * len(ids) for ids in batch.completion_ids]
        if bad == "short":
            rows[2] = rows[2][:-1]
        else:
            rows[2][0] = bad
        return rows

    model = qwen3(tok)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = HCAPOGRPOTrainer(
        model=model,
        reward_funcs=bangs,
        args=config(tmp_path, tok, max_steps=1),
        train_dataset=prompts(4),
        processing_class=tok,
        advantages=broken,
    )
    message = (
        r"row 2 \(group 0\): the advantage source gave"
        if bad == "short"
        else r"step 0, row 2 \(group 0\): advantage (nan|inf) at completion token 0"
    )
    with pytest.raises(HandoffError, match=message):
        trainer.train()
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())  # no step was taken


@pytest.mark.slow  # trains a Qwen3-vocabulary model; the tiny-vocabulary sibling above stays fast
def test_store_advantages_with_the_real_qwen3_tokenizer(tmp_path: Path) -> None:
    """The real Qwen3 tokenizer and chat template (no thinking: TRL's prompt then ends in the
    empty think block the template puts before a final answer). Digits: Qwen3 never merges them."""
    directory = TOKENIZERS / "qwen3"
    if not directory.is_dir():
        pytest.skip(f"{directory} is not here (../shared absent)")
    tok = AutoTokenizer.from_pretrained(str(directory))
    sevens = lambda completions, **_: [float(c[0]["content"].count("7")) for c in completions]  # noqa: E731
    with Store.open(str(tmp_path / "grpo.db")) as store:
        source = StoreAdvantages(store, tokenizer=directory, workdir=tmp_path / "rollouts", run_id="q")
        batches: list[RolloutBatch] = []

        def keep(batch: RolloutBatch):
            batches.append(batch)
            return source(batch)

        trainer = HCAPOGRPOTrainer(
            model=qwen3(tok),
            reward_funcs=sevens,
            args=config(tmp_path, tok, allowed="0123456789", chat_template_kwargs={"enable_thinking": False}),
            train_dataset=prompts(8, history=True),
            processing_class=tok,
            advantages=keep,
        )
        seen = record(trainer)
        trainer.train()
        assert trainer.state.global_step == 2 and not source.refused
        placed = 0
        for out, batch in zip(seen, batches):
            assert batch.prompt_ids[0][-4:] == tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
            handoff = Handoff(store, source.runs[batch.step], tokenizer=directory)
            for i, name in enumerate(source.episodes[batch.step]):
                if name is None or not any(batch.loss_mask[i]):
                    continue
                credit = handoff.advantages(name, batch.prompt_ids[i] + batch.completion_ids[i])
                start, width = len(batch.prompt_ids[i]), len(batch.completion_ids[i])
                want = credit.advantages[start:] * np.array(batch.loss_mask[i])
                np.testing.assert_array_equal(out["advantages"][i, :width].numpy(), want)
                placed += int(credit.mask[start:].any())
        assert placed >= 2


def test_unrewarded_rows_are_listed_and_several_processes_refused(
    tmp_path: Path, tok, demo_tokenizer_dir: Path
) -> None:
    """A completion no reward function scored (TRL: NaN) is not stored, gets 0 and is listed;
    a batch of several training processes is refused (a group's rows would be split)."""

    def some(completions: list, **_: Any) -> list[float | None]:
        return [float(c[0]["content"].count("!")) if "!" in c[0]["content"] else None for c in completions]

    with Store.open(str(tmp_path / "grpo.db")) as store:
        source = StoreAdvantages(store, tokenizer=demo_tokenizer_dir, workdir=tmp_path / "rollouts", run_id="u")
        batches: list[RolloutBatch] = []

        def keep(batch: RolloutBatch):
            batches.append(batch)
            return source(batch)

        trainer = HCAPOGRPOTrainer(
            model=qwen3(tok),
            reward_funcs=some,
            args=config(tmp_path, tok, max_steps=1, per_device_train_batch_size=8, num_generations=8),
            train_dataset=prompts(8, history=True),
            processing_class=tok,
            advantages=keep,
        )
        seen = record(trainer)
        trainer.train()
        batch = batches[0]
        unrewarded = [i for i, r in enumerate(batch.rewards) if r != r]
        assert unrewarded, "the seed gave every completion a '!': pick another"
        for i in unrewarded:
            assert "no reward function scored it" in source.skipped[(0, i)]
            assert source.episodes[0][i] is None and not seen[0]["advantages"][i].any()
        with pytest.raises(HandoffError, match="one training process, not 2"):
            source(RolloutBatch(**{**batch.__dict__, "processes": 2}))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trls_own_advantage_as_the_source_is_plain_grpo(tmp_path: Path, tok, accumulate: int) -> None:
    """The override changes nothing else: fed TRL's own advantage on every completion token, the
    subclass trains exactly as a plain GRPOTrainer (same generations, losses and weights), also
    when one generation batch is split, shuffled, over accumulation steps."""
    runs = []
    for cls, extra in ((GRPOTrainer, {}), (HCAPOGRPOTrainer, {"advantages": trl_advantages})):
        trainer = cls(
            model=qwen3(tok),
            reward_funcs=bangs,
            args=config(tmp_path / cls.__name__, tok, max_steps=3, gradient_accumulation_steps=accumulate),
            train_dataset=prompts(12),
            processing_class=tok,
            **extra,
        )
        seen = record(trainer)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs.append((seen, losses, trainer.model.state_dict()))
    (plain, plain_losses, plain_weights), (ours, our_losses, our_weights) = runs
    assert len(plain) == len(ours) == 3 and len(plain_losses) == 3
    for a, b in zip(plain, ours):
        assert torch.equal(a["completion_ids"], b["completion_ids"])
        assert a["advantages"].dim() == 1 and b["advantages"].shape == b["completion_ids"].shape
        expect = a["advantages"][:, None] * b["completion_mask"]
        assert torch.equal(b["advantages"], expect.float())
    assert our_losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-7)
    assert any(loss != 0 for loss in plain_losses)
    for key, value in plain_weights.items():
        torch.testing.assert_close(our_weights[key], value, rtol=1e-5, atol=1e-6)


def test_place_drops_values_on_tokens_the_loss_does_not_train() -> None:
    """A tool result inside a completion (TRL's tool_mask 0) or a masked completion gets 0, and
    padding stays 0, whatever the source returned there."""
    batch = RolloutBatch(
        step=0,
        prompts=[[], []],
        completions=[[], []],
        prompt_ids=[[1, 2], [1, 2]],
        completion_ids=[[5, 6, 7, 8], [5, 6]],
        loss_mask=[[1, 0, 0, 1], [0, 0]],  # row 0: a tool result at 1-2; row 1: masked (truncated)
        rewards=[1.0, 0.0],
        groups=[0, 0],
        trl_advantages=[0.5, -0.5],
        inputs=[{}, {}],
    )
    placed = place(batch, [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0]], width=5)
    assert placed.dtype == torch.float32
    assert placed.tolist() == [[1.0, 0.0, 0.0, 4.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]


def test_place_refuses_a_value_beyond_float32_after_the_cast() -> None:
    """1e39 is finite in float64 and inf in float32: the check runs after the cast, naming the step."""
    batch = RolloutBatch(
        step=3,
        prompts=[[]],
        completions=[[]],
        prompt_ids=[[1]],
        completion_ids=[[5, 6, 7, 8]],
        loss_mask=[[1, 1, 1, 1]],
        rewards=[1.0],
        groups=[0],
        trl_advantages=[0.0],
        inputs=[{}],
    )
    for value in (1e39, -1e39):
        with pytest.raises(
            HandoffError,
            match=r"^step 3, row 0 \(group 0\): advantage [-]?1e\+39 \(beyond float32's range\) at completion token 1",
        ):
            place(batch, [[0.5, value, 0.5, 0.0]], width=4)
    assert place(batch, [[0.5, 3.0e38, -0.5, 0.0]], width=4).isfinite().all()
