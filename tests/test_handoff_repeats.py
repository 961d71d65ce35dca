"""The trainer hand-off's search when two steps of an episode have the same own tokens (an agent
that runs ``ls`` twice): each step's advantage lands on its own tokens or nowhere, never on the
other step's. With the real Qwen3 tokenizer when ../shared is here, the demo tokenizer always."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _shared import tokenizer_dir
from test_credit_variants import add_score
from test_credits import add_scorer

from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.errors import HandoffError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.storage import db
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import Handoff


@pytest.fixture(params=["qwen3", "demo"])
def tok_dir(request, demo_tokenizer_dir: Path) -> Path:
    return tokenizer_dir(request.param, demo_tokenizer_dir)


def _messages(action: str, observations: tuple[str, str, str]) -> list[dict]:
    first, second, third = observations
    return [
        {"role": "user", "content": first},
        {"role": "assistant", "content": action},
        {"role": "user", "content": second},
        {"role": "assistant", "content": action},
        {"role": "user", "content": third},
        {"role": "assistant", "content": action},
    ]


@pytest.fixture
def repeated(tmp_path: Path, tok_dir: Path) -> tuple[Handoff, dict[int, float], list, Path]:
    """Episode ``a`` runs ``ls`` three times (rewarded), ``b`` runs ``pwd`` three times; each
    step scored on its own, so a's three advantages differ."""
    observations = ("list the files", "nothing there", "still nothing")
    lines = [
        json.dumps({"episode_id": "a", "reward": 1.0, "messages": _messages("ls", observations)}),
        json.dumps({"episode_id": "b", "reward": 0.0, "messages": _messages("pwd", observations)}),
    ]
    (tmp_path / "g.jsonl").write_text("\n".join(lines) + "\n")
    store = Store.open(str(tmp_path / "s.db"))
    assert ingest(store, [tmp_path / "g.jsonl"], tags={"grp": "g"}).failed == 0
    tokenizer = load_tokenizer(str(tok_dir))
    add_scorer(store, "sc", spec={"tokenizer": tokenizer_fingerprint(tokenizer, tok_dir)})
    means = {"a": [-0.1, -6.0, -2.0], "b": [-1.0, -1.0, -1.0]}
    with db.write(store.engine) as conn:
        for sid, ext, index in conn.exec_driver_sql(
            "SELECT s.id, e.external_id, s.step_index FROM steps s JOIN episodes e ON e.id = s.episode_id"
        ).all():
            add_score(conn, "sc", sid, means[ext][index])
    compute_credits(store, CreditParams(variant="paper", dense=False, group_by="grp"), name="p")
    handoff = Handoff(store, "p", tokenizer=str(tok_dir))
    ep = handoff.episode_id("g.jsonl#a")
    whole = handoff.advantages(ep, handoff.rendered_ids(ep, "turns"))
    step_adv = whole.step_advantages
    assert len({round(v, 6) for v in step_adv.values()}) == 3  # the three differ: a misplacement shows
    return handoff, step_adv, _messages("ls", observations), tok_dir


def _ids(tok_dir: Path, messages: list[dict]) -> list[int]:
    out = load_tokenizer(str(tok_dir)).apply_chat_template(messages, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(t) for t in ids]


def _value(credit, step: int) -> float:
    """The one value placed on the step's tokens."""
    a, b = credit.spans[step]
    (value,) = set(credit.advantages[a:b].tolist())
    return value


def test_a_window_of_the_last_turn_gets_the_last_steps_advantage(repeated) -> None:
    """Ids holding only the last observation and action (a history-window sample): they are step
    2's tokens, so step 2's advantage is placed there, and steps 0 and 1 are named as absent."""
    handoff, step_adv, messages, tok_dir = repeated
    ids = _ids(tok_dir, messages[4:])
    credit = handoff.advantages("g.jsonl#a", ids, strict=False)
    assert set(credit.spans) == {2} and set(credit.refused) == {0, 1}
    assert _value(credit, 2) == pytest.approx(step_adv[2], rel=1e-6)
    assert "are step 2's" in credit.refused[0]
    with pytest.raises(HandoffError, match="step 0's own tokens .* are step 2's"):
        handoff.advantages("g.jsonl#a", ids)


def test_a_window_of_the_last_two_turns_places_both_in_order(repeated) -> None:
    handoff, step_adv, messages, tok_dir = repeated
    credit = handoff.advantages("g.jsonl#a", _ids(tok_dir, messages[2:]), strict=False)
    assert set(credit.spans) == {1, 2} and set(credit.refused) == {0}
    assert credit.spans[1][1] <= credit.spans[2][0]
    for step in (1, 2):
        assert _value(credit, step) == pytest.approx(step_adv[step], rel=1e-6)


def test_the_whole_conversation_searched_places_each_step_on_its_own_tokens(repeated) -> None:
    """The whole conversation with a system prompt the store's rendering lacks (so the ids differ
    from it and are searched): each repeated action keeps its own step's advantage."""
    handoff, step_adv, messages, tok_dir = repeated
    ids = _ids(tok_dir, [{"role": "system", "content": "You are a shell agent."}, *messages])
    credit = handoff.advantages("g.jsonl#a", ids)
    assert credit.how == "search" and set(credit.spans) == {0, 1, 2} and not credit.refused
    assert [_value(credit, s) for s in range(3)] == pytest.approx([step_adv[s] for s in range(3)], rel=1e-6)


def test_ids_that_cannot_tell_two_steps_apart_place_neither(repeated) -> None:
    """Only the action itself after its header: any of the three steps could be it; nothing is
    placed, and the reason says so, rather than the first step's advantage."""
    handoff, _step_adv, messages, tok_dir = repeated
    turns = handoff.rendered_ids("g.jsonl#a", "turns")
    credit = handoff.advantages("g.jsonl#a", turns, strict=False)
    a, b = credit.spans[2]
    ids = turns[a - 3 : b]  # the header the search requires, then the action
    credit = handoff.advantages("g.jsonl#a", ids, strict=False)
    assert credit.spans == {} and set(credit.refused) == {0, 1, 2}
    assert all("do not tell which step" in why for why in credit.refused.values())
    assert not credit.advantages.any()


def test_a_stuck_agents_equal_turns_are_each_placed_on_their_own(tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    """An agent that runs the same command on the same answer 60 times, the conversation searched
    (a system prompt before it): every step is placed on its own turn, with its own advantage
    (the terminal discount makes each differ); each comparison with the other 59 stays short."""
    turns = 60
    messages = [{"role": "user", "content": "find the config"}]
    for _ in range(turns):
        messages += [{"role": "assistant", "content": "cat config.yaml"}, {"role": "user", "content": "not found"}]
    messages = messages[:-1]
    (tmp_path / "g.jsonl").write_text(json.dumps({"episode_id": "a", "reward": 0.5, "messages": messages}) + "\n")
    store = Store.open(str(tmp_path / "s.db"))
    assert ingest(store, [tmp_path / "g.jsonl"], tags={"grp": "g"}).failed == 0
    tokenizer = load_tokenizer(str(demo_tokenizer_dir))
    add_scorer(store, "sc", spec={"tokenizer": tokenizer_fingerprint(tokenizer, demo_tokenizer_dir)})
    with db.write(store.engine) as conn:
        for sid, index in conn.exec_driver_sql("SELECT id, step_index FROM steps").all():
            add_score(conn, "sc", sid, -1.0 - 0.01 * (index % 7))  # scored apart: the ratio moves
    compute_credits(store, CreditParams(variant="paper", dense=False), name="p")
    handoff = Handoff(store, "p", tokenizer=str(demo_tokenizer_dir))
    ids = _ids(demo_tokenizer_dir, [{"role": "system", "content": "You are a shell agent."}, *messages])
    credit = handoff.advantages("g.jsonl#a", ids)
    assert credit.how == "search" and sorted(credit.spans) == list(range(turns))
    values = [_value(credit, s) for s in range(turns)]
    assert values == pytest.approx([credit.step_advantages[s] for s in range(turns)], rel=1e-6)
    assert len({round(v, 6) for v in values}) == turns
