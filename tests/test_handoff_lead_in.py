"""A wrapper the policy wrote before a step's own tokens carries the step's advantage.

With Qwen3 and thinking on, a policy that thinks nothing writes ``<think>\\n\\n</think>\\n\\n``
itself at the start of its turn; the store's rendering has the template write that block, so it
is no step's own tokens. The trainer trains those tokens (they are generated), and GRPO gives
every completion token the advantage: the hand-off gives them the step's (``with_lead_in``), at
most GLUE_TOKENS of them, never across an untrained token or another step's tokens, and never
per-token values (a log-ratio run's). The rule on hand-made credits (no tokenizer), then TRL's
row and verl's response on the real Qwen3 tokenizer when ../shared is here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _shared import tokenizer_dir
from test_credit_variants import add_score
from test_credits import add_scorer

from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.storage import db
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import GLUE_TOKENS, Handoff, TokenCredit, with_lead_in


def _credit(n: int, spans: dict[int, tuple[int, int]], values: dict[int, float]) -> TokenCredit:
    adv = np.zeros(n, dtype=np.float32)
    mask = np.zeros(n, dtype=bool)
    for index, (a, b) in spans.items():
        adv[a:b], mask[a:b] = values[index], True
    return TokenCredit("e", adv, mask, dict(spans), dict(values), lead_in=dict(values))


def test_a_short_trained_stretch_before_a_step_takes_its_advantage() -> None:
    # prompt [0, 2), completion [2, 12): 4 loose trained tokens, then step 0's own tokens [6, 9)
    credit = _credit(12, {0: (6, 9)}, {0: -1.5})
    out = with_lead_in(credit, np.ones(10, dtype=bool), 2)
    assert out.tolist() == [-1.5] * 7 + [0.0] * 3
    assert out[:4].tolist() == [-1.5] * GLUE_TOKENS  # the wrapper: the step's, not 0


def test_a_longer_stretch_an_untrained_token_and_another_step_stop_it() -> None:
    longer = _credit(12, {0: (7, 9)}, {0: 2.0})  # 5 loose trained tokens before the step: not a wrapper
    assert with_lead_in(longer, np.ones(10, dtype=bool), 2)[:5].tolist() == [0.0] * 5
    trained = np.ones(10, dtype=bool)
    trained[2] = False  # completion position 2 untrained (a tool result's last token, say)
    out = with_lead_in(longer, trained, 2)
    assert out.tolist()[:5] == [0.0, 0.0, 0.0, 2.0, 2.0]  # back to the untrained token only
    two = _credit(12, {0: (2, 4), 1: (6, 8)}, {0: 1.0, 1: 3.0})  # 2 loose, step 0, 2 loose, step 1
    out = with_lead_in(two, np.ones(12, dtype=bool), 0)
    assert out.tolist()[:8] == [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0]  # each stretch: the step after it
    untrained = with_lead_in(_credit(8, {0: (4, 6)}, {0: 1.0}), np.zeros(8, dtype=bool), 0)
    assert untrained[:4].tolist() == [0.0] * 4  # nothing trained before it: nothing given


def test_per_token_values_give_the_wrapper_the_steps_lead_in_value() -> None:
    """A log-ratio run: the step's tokens keep their own values; the wrapper (scored by
    neither scorer) gets ``lead_in``, the step's A_i, whatever its d_t are (all equal or not)."""
    for values in ([0.1, -0.2, 0.3], [0.5, 0.5, 0.5]):
        credit = _credit(8, {0: (3, 6)}, {0: 0.5})
        credit.advantages[3:6] = values  # per-token values
        credit.lead_in = {0: -0.25}
        out = with_lead_in(credit, np.ones(8, dtype=bool), 0)
        assert out[:3].tolist() == [-0.25] * 3
        assert out[3:6].tolist() == pytest.approx(values)
    credit.lead_in = {}  # a step the run leaves out of training: nothing to give
    assert with_lead_in(credit, np.ones(8, dtype=bool), 0)[:3].tolist() == [0.0] * 3


@pytest.fixture
def qwen3_group(tmp_path: Path, demo_tokenizer_dir: Path) -> tuple[Handoff, object, dict[str, str]]:
    """Three one-step rollouts of a prompt with Qwen3: an empty think block the policy wrote,
    real reasoning, and no think block at all; rewards 0, 1, 3, each step scored apart."""
    tok_dir = tokenizer_dir("qwen3", demo_tokenizer_dir)
    prompt = [{"role": "user", "content": "add the digits"}]
    completions = {"a": "<think>\n\n</think>\n\n42", "b": "<think>\nlet me see\n</think>\n\n7", "c": "13"}
    lines = [
        json.dumps({"episode_id": k, "reward": r, "messages": [*prompt, {"role": "assistant", "content": c}]})
        for (k, c), r in zip(completions.items(), (0.0, 1.0, 3.0))
    ]
    (tmp_path / "g.jsonl").write_text("\n".join(lines) + "\n")
    store = Store.open(str(tmp_path / "s.db"))
    assert ingest(store, [tmp_path / "g.jsonl"], tags={"grp": "g"}).failed == 0
    tok = load_tokenizer(str(tok_dir))
    add_scorer(store, "sc", spec={"tokenizer": tokenizer_fingerprint(tok, tok_dir)})
    with db.write(store.engine) as conn:
        for sid, ext in conn.exec_driver_sql(
            "SELECT s.id, e.external_id FROM steps s JOIN episodes e ON e.id = s.episode_id"
        ).all():
            add_score(conn, "sc", sid, {"a": -1.0, "b": -2.0, "c": -0.5}[ext])
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp"), name="p")
    return Handoff(store, "p", tokenizer=str(tok_dir), allow_zero_hindsight=True), tok, completions


def _row(tok, completions: dict[str, str], key: str, thinking: bool) -> tuple[list[int], list[int]]:
    """TRL's ids of a row: the prompt through the chat template with the generation prompt,
    then the completion and its end token."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": "add the digits"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    return prompt, [*tok(completions[key], add_special_tokens=False)["input_ids"], tok.eos_token_id]


def test_trl_the_empty_think_block_the_policy_wrote_carries_its_steps_advantage(qwen3_group) -> None:
    from hcapo_store.training.trl_grpo import HandoffAdvantages, RolloutBatch

    handoff, tok, completions = qwen3_group
    rows = [_row(tok, completions, k, thinking=True) for k in ("a", "b")]
    batch = RolloutBatch(
        step=0,
        prompts=[[]] * 2,
        completions=[[]] * 2,
        prompt_ids=[p for p, _ in rows],
        completion_ids=[c for _, c in rows],
        loss_mask=[[1] * len(c) for _, c in rows],
        rewards=[0.0, 1.0],
        groups=[0, 0],
        trl_advantages=[0.0, 0.0],
        inputs=[{}, {}],
    )
    a, b = HandoffAdvantages(handoff, lambda _batch, i: f"g.jsonl#{'ab'[i]}")(batch)
    step = handoff.advantages("g.jsonl#a", [*rows[0][0], *rows[0][1]]).step_advantages[0]
    assert step != 0.0  # the signal is there to be carried
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert rows[0][1][: len(think)] == think and len(think) <= GLUE_TOKENS
    assert a.tolist() == pytest.approx([step] * len(a))  # every generated token, the wrapper too
    # without the rule, the wrapper would be trained at 0 (the step's own tokens start after it)
    credit = handoff.advantages("g.jsonl#a", [*rows[0][0], *rows[0][1]])
    assert credit.advantages[len(rows[0][0]) : len(rows[0][0]) + len(think)].tolist() == [0.0] * len(think)
    # real reasoning is the step's own already: every token, <think> included
    step_b = handoff.advantages("g.jsonl#b", [*rows[1][0], *rows[1][1]]).step_advantages[0]
    assert b.tolist() == pytest.approx([step_b] * len(b)) and step_b != step


def test_trl_with_thinking_off_the_block_is_the_prompts(qwen3_group) -> None:
    """enable_thinking=False: the template writes the empty think block into the generation
    prompt, which the loss never trains; the completion is the step's own tokens alone."""
    handoff, tok, completions = qwen3_group
    prompt, completion = _row(tok, completions, "c", thinking=False)
    credit = handoff.advantages("g.jsonl#c", [*prompt, *completion])
    out = with_lead_in(credit, np.ones(len(completion), dtype=bool), len(prompt))
    assert out.tolist() == pytest.approx([credit.step_advantages[0]] * len(completion))
    assert credit.advantages[: len(prompt)].tolist() == [0.0] * len(prompt)


def test_verl_the_response_gets_the_wrapper_too(qwen3_group) -> None:
    from hcapo_store.training.verl_batch import VerlHandoff

    handoff, tok, completions = qwen3_group
    prompt, completion = _row(tok, completions, "a", thinking=True)
    credit = handoff.advantages("g.jsonl#a", [*prompt, *completion])
    valid = np.ones(len(completion), dtype=bool)
    out = VerlHandoff._place(credit, len(prompt), valid, "sample 0")
    assert out.dtype == np.float32
    assert out.tolist() == pytest.approx([credit.step_advantages[0]] * len(completion))


def test_trl_log_ratio_the_wrapper_gets_the_grpo_backbone(tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    """A log-ratio run through StoreAdvantages (``--grpo``, the default), Qwen3 with thinking on:
    each completion's own tokens carry A_i + g_t·d_t (varying), its empty think block A_i, the
    group's z-scored reward computed here (TRL's GRPO gives every completion token that)."""
    from test_trl_grpo import qwen3

    from hcapo_store.training.trl_grpo import RolloutBatch, StoreAdvantages

    tok_dir = tokenizer_dir("qwen3", demo_tokenizer_dir)
    tok = load_tokenizer(str(tok_dir))
    model = qwen3(tok).eval()
    prompt = [
        {"role": "user", "content": "add the digits"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "again"},
    ]
    texts, rewards = ["42", "7", "13", "9"], [1.0, 0.0, 0.5, 0.0]
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    completion_ids = [[*think, *tok(t, add_special_tokens=False)["input_ids"], tok.eos_token_id] for t in texts]
    batch = RolloutBatch(
        step=0,
        prompts=[prompt] * 4,
        completions=[
            [{"role": "assistant", "content": tok.decode(c, skip_special_tokens=True)}] for c in completion_ids
        ],
        prompt_ids=[prompt_ids] * 4,
        completion_ids=completion_ids,
        loss_mask=[[1] * len(c) for c in completion_ids],
        rewards=rewards,
        groups=[0] * 4,
        trl_advantages=[0.0] * 4,
        inputs=[{}] * 4,
        model=model,
    )
    r = np.asarray(rewards)
    backbone = (r - r.mean()) / r.std()
    with Store.open(str(tmp_path / "s.db")) as store:
        source = StoreAdvantages(
            store, tokenizer=tok_dir, workdir=tmp_path / "r", run_id="Q", variant="log-ratio", against="no-hindsight"
        )
        rows = source(batch)
    for row, a_i in zip(rows, backbone):
        assert row[: len(think)].tolist() == pytest.approx([a_i] * len(think), abs=1e-6)
        own = row[len(think) :]
        assert np.all(own != 0.0) and len(set(own.round(6).tolist())) > 1  # A_i + g_t·d_t: the log-ratio term varies


def test_a_turn_begun_without_the_templates_think_block_is_refused_naming_the_header(qwen3_group) -> None:
    """Thinking on and a policy that wrote no think block: the step's own tokens are in the
    ids, but not after the header the template renders (its empty think block). Refused, not
    guessed, and the reason says where they are and which header is missing."""
    from hcapo_store.errors import HandoffError

    handoff, tok, completions = qwen3_group
    prompt, completion = _row(tok, completions, "c", thinking=True)
    with pytest.raises(HandoffError, match=r"are not in the given ids after position 0 \(they are at position") as e:
        handoff.advantages("g.jsonl#c", [*prompt, *completion])
    assert "'\\n\\n</think>\\n\\n' the chat template writes before them" in str(e.value)
    loose = handoff.advantages("g.jsonl#c", [*prompt, *completion], strict=False)
    assert not loose.spans and "think block" in loose.refused[0]
