"""Renders kept by their messages' digest (``rendering/kept_renders.py``): the rows of a GRPO
group share all but their last turn, and the hand-off's alignments of the second row render only
what that turn changes. Every alignment equals the one made with nothing kept (property-based,
over families of rows); a kept render or piece that went wrong is caught by the run-time check
(``verify.KEPT_RENDERS``, ``verify.KEPT_PIECES``), counted, and the fresh one used; a template
that reads outside a ``turns`` piece's window is caught (``verify.WINDOWED_TURNS``); reference
mode keeps nothing."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _hypothesis import session_settings
from _tokenizers import CHATML_WITH_BOS, SHARED_TOKENIZERS, bos_tokenizer, real_tokenizer
from hypothesis import given
from hypothesis import strategies as st

from hcapo_store.rendering import verify
from hcapo_store.rendering.alignment import EpisodeRenderer, checked_pieces
from hcapo_store.rendering.kept_renders import KeptRenders, list_digest, message_digests, prefix_digests
from hcapo_store.rendering.messages import normalize_messages
from hcapo_store.rendering.tokenizers import load_tokenizer

STRATEGIES = ("kept_renders", "kept_pieces", "windowed_turns")  # the hand-off's alignments' fast strategies
WORDS = "the of and to run test file path value data 42 café 東京 {} [] : ; ok".split()
words = st.lists(st.sampled_from(WORDS), min_size=0, max_size=20).map(" ".join)


def steps_of(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(k, m) for k, m in enumerate(i for i, x in enumerate(messages) if x.get("role") == "assistant")]


@st.composite
def assistant_turns(draw: Any, s: int) -> dict[str, Any]:
    reasoning = draw(st.one_of(st.just(""), words))
    content = draw(words) or "ok"
    message: dict[str, Any] = {
        "role": "assistant",
        "content": f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content,
    }
    if draw(st.booleans()):
        arguments = json.dumps({"command": draw(words)}, ensure_ascii=False)
        message["tool_calls"] = [
            {"id": f"c{s}", "type": "function", "function": {"name": "bash", "arguments": arguments}}
        ]
    return message


@st.composite
def families(draw: Any) -> list[list[dict[str, Any]]]:
    """Rows of one prompt (a session up to a turn): each row the prompt and its own completion;
    some rows with a middle message edited, some with a user turn before the completion."""
    prompt: list[dict[str, Any]] = [{"role": "system", "content": "You act. " + draw(words)}]
    prompt.append({"role": "user", "content": "Task: " + draw(words)})
    for s in range(draw(st.integers(1, 7))):
        if draw(st.booleans()) and draw(st.booleans()):
            prompt.append({"role": "user", "content": "Continue. " + draw(words)})
        turn = draw(assistant_turns(s))
        prompt.append(turn)
        if "tool_calls" in turn:
            prompt.append({"role": "tool", "name": "bash", "tool_call_id": f"c{s}", "content": draw(words)})
        else:
            prompt.append({"role": "user", "content": "Next. " + draw(words)})
    rows = []
    for r in range(draw(st.integers(2, 4))):
        head = [dict(m) for m in prompt]
        if draw(st.integers(0, 3)) == 0:  # a history that differs in the middle
            i = draw(st.integers(1, len(head) - 1))
            head[i]["content"] = str(head[i].get("content") or "") + " edited"
        rows.append([*head, draw(assistant_turns(100 + r))])
    return rows


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    return {name: real_tokenizer(name) for name in ("qwen3", "qwen2.5")}


@session_settings(25)
@given(rows=families(), name=st.sampled_from(["qwen3", "qwen2.5"]))
def test_kept_renders_give_the_alignments_of_renders_made_anew(tokenizers, rows, name) -> None:
    tok = tokenizers[name]
    kept, plain = EpisodeRenderer(tok), EpisodeRenderer(tok, fast=False)
    assert kept.kept is not None and plain.kept is None and kept.kept.on
    before = {k: verify.fallbacks().get(k, 0) for k in STRATEGIES}
    for row in rows:
        for rendering in ("turns", "whole"):
            assert kept.align(row, steps_of(row), rendering) == plain.align(row, steps_of(row), rendering)
    # equal by the strategies themselves, not by their run-time checks switching them off
    assert {k: verify.fallbacks().get(k, 0) for k in STRATEGIES} == before and kept.kept.on


def _group(n: int = 3, steps: int = 6) -> list[list[dict[str, Any]]]:
    prompt: list[dict[str, Any]] = [{"role": "system", "content": "You act."}, {"role": "user", "content": "Task"}]
    for s in range(steps):
        call = {"id": f"c{s}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"n": s})}}
        prompt.append({"role": "assistant", "content": f"step {s}", "tool_calls": [call]})
        prompt.append({"role": "tool", "name": "bash", "tool_call_id": f"c{s}", "content": f"out {s}"})
    return [[*prompt, {"role": "assistant", "content": f"done {r}"}] for r in range(n)]


@pytest.fixture
def own_qwen3() -> Any:
    """A Qwen3 tokenizer object of this test's own: nothing else's renders are kept for it."""
    path = SHARED_TOKENIZERS / "qwen3"
    if not path.is_dir():
        pytest.skip(f"real tokenizer directory {path} is absent")
    return load_tokenizer(path)


def test_the_groups_next_row_renders_only_what_its_turn_changes(own_qwen3) -> None:
    rows = _group()
    first = EpisodeRenderer(own_qwen3)
    assert first.kept is not None
    for rendering in ("turns", "whole"):
        first.align(rows[0], steps_of(rows[0]), rendering)
    made = first.kept.misses
    assert made > 2 * len(steps_of(rows[0]))  # a new tokenizer: the history rendered
    nxt = EpisodeRenderer(own_qwen3)  # the next hand-off over the same tokenizer object
    got = {r: nxt.align(rows[1], steps_of(rows[1]), r) for r in ("turns", "whole")}
    # turns: the turn as the last message (the whole rendering is the same render); whole: the
    # turn's local render between its user turns
    assert first.kept.misses - made == 2
    plain = EpisodeRenderer(own_qwen3, fast=False)
    assert got == {r: plain.align(rows[1], steps_of(rows[1]), r) for r in ("turns", "whole")}


def test_a_wrong_kept_render_is_caught_and_the_fresh_one_used(own_qwen3, monkeypatch) -> None:
    rows = _group()
    renderer = EpisodeRenderer(own_qwen3)
    kept = renderer.kept
    assert kept is not None
    renderer.align(rows[0], steps_of(rows[0]), "turns")
    for key in list(kept._kept):  # planted: what a template that reads the clock would do
        kept._kept[key] = kept._kept[key].replace("Task", "Tusk")
    kept.pieces.clear()  # the renders, not the pieces, are under test here
    want = EpisodeRenderer(own_qwen3, fast=False).align(rows[1], steps_of(rows[1]), "turns")
    # not due: the planted renders are used on trust, and the alignment is wrong
    monkeypatch.setitem(verify._uses, "kept_renders", itertools.count(verify.KEPT_RENDERS.first + 1))
    assert EpisodeRenderer(own_qwen3).align(rows[1], steps_of(rows[1]), "turns") != want
    kept.pieces.clear()
    monkeypatch.setitem(verify._uses, "kept_renders", itertools.count())  # the process's first hits
    before = verify.fallbacks().get("kept_renders", 0)
    assert EpisodeRenderer(own_qwen3).align(rows[1], steps_of(rows[1]), "turns") == want
    assert verify.fallbacks()["kept_renders"] == before + 1
    assert not kept.on and len(kept) == 0 and not kept.pieces  # nothing kept from now on
    assert EpisodeRenderer(own_qwen3).align(rows[2], steps_of(rows[2]), "turns") == EpisodeRenderer(
        own_qwen3, fast=False
    ).align(rows[2], steps_of(rows[2]), "turns")


def test_a_wrong_kept_piece_is_caught_and_the_fresh_one_used(own_qwen3, monkeypatch) -> None:
    rows = _group()
    renderer = EpisodeRenderer(own_qwen3)
    kept = renderer.kept
    assert kept is not None
    want = renderer.align(rows[0], steps_of(rows[0]), "turns")
    for key, piece in list(kept.pieces.items()):
        context, turn, start, end = piece
        kept.pieces[key] = ([*context, 0], turn, start, end)  # one id too many before each turn
    monkeypatch.setitem(verify._uses, "kept_pieces", itertools.count())  # the process's first hits
    before = verify.fallbacks().get("kept_pieces", 0)
    assert EpisodeRenderer(own_qwen3).align(rows[0], steps_of(rows[0]), "turns") == want
    assert verify.fallbacks()["kept_pieces"] == before + 1 and not kept.on


def test_reference_mode_keeps_nothing(own_qwen3, monkeypatch) -> None:
    monkeypatch.setenv(verify.RENDERING_ENV, "reference")
    renderer = EpisodeRenderer(own_qwen3)
    assert renderer.kept is None and renderer.placer.renders is None
    rows = _group(1)
    monkeypatch.delenv(verify.RENDERING_ENV)
    assert renderer.align(rows[0], steps_of(rows[0]), "turns") == EpisodeRenderer(own_qwen3, fast=False).align(
        rows[0], steps_of(rows[0]), "turns"
    )


def test_kept_renders_stay_within_their_bytes(tmp_path: Path) -> None:
    tok = bos_tokenizer(tmp_path)
    lists = [[{"role": "user", "content": "x" * n}] for n in (30, 31, 32)]
    one = sys.getsizeof(KeptRenders().render(tok, lists[-1], message_digests(lists[-1]), generation=False))
    kept = KeptRenders(budget=2 * one + 3)
    for msgs in lists:
        kept.render(tok, msgs, message_digests(msgs), generation=False)
    assert len(kept) == 2 and kept._bytes <= kept.budget  # the oldest dropped
    wide = [{"role": "user", "content": "東" * 30}]  # 4 bytes a character in memory: more than two
    kept.render(tok, wide, message_digests(wide), generation=False)
    assert len(kept) == 1 and kept._bytes <= kept.budget
    big = [{"role": "user", "content": "y" * (3 * one)}]
    kept.render(tok, big, message_digests(big), generation=False)
    assert len(kept) == 1  # larger than the whole budget: never kept
    odd = [{"role": "user", "content": "z", "extra": ("not", "plain")}]
    assert message_digests(odd) == [None]
    kept.render(tok, [{"role": "user", "content": "z"}], [None], generation=False)
    assert len(kept) == 1  # a message that is not plain data: rendered, not kept


def test_list_digests_follow_the_messages_in_order() -> None:
    a, b = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    da, db_ = message_digests([a, b])
    assert list_digest([da, db_]) != list_digest([db_, da])
    assert list_digest([da, db_]) == prefix_digests([da, db_])[1]
    assert list_digest([da]) == prefix_digests([da, db_])[0]
    assert list_digest([da, None]) is None


def test_a_long_rows_pieces_are_made_on_windows_equal_to_the_whole_historys(own_qwen3) -> None:
    (row,) = _group(1, steps=14)
    renderer = EpisodeRenderer(own_qwen3)
    before = verify.fallbacks().get("windowed_turns", 0)
    out, made = renderer._turns(
        normalize_messages(row), steps_of(row), message_digests(normalize_messages(row)), flattened=False, windowed=True
    )
    assert sum(on_window for *_, on_window in made) >= 8  # all but the first few: their windows are shorter
    assert out == EpisodeRenderer(own_qwen3, fast=False).align(row, steps_of(row), "turns")
    assert renderer.align(row, steps_of(row), "turns") == out
    assert verify.fallbacks().get("windowed_turns", 0) == before


# numbers the messages that are not the policy's: a turn's context reads how many came before it
NUMBERED = CHATML_WITH_BOS.replace(
    "<|im_start|>{{ m.role }}\n",
    "<|im_start|>{{ m.role }}{{ (' #' ~ loop.index) if m.role != 'assistant' else '' }}\n",
)


def test_a_template_that_reads_outside_the_window_is_caught_and_placed_on_whole_histories(tmp_path: Path) -> None:
    assert NUMBERED != CHATML_WITH_BOS
    tok = bos_tokenizer(tmp_path, template=NUMBERED)
    (row,) = _group(1, steps=10)
    want = EpisodeRenderer(tok, fast=False).align(row, steps_of(row), "turns")
    assert len(want.spans) == len(steps_of(row)) and not want.refused
    before = verify.fallbacks().get("windowed_turns", 0)
    assert EpisodeRenderer(tok).align(row, steps_of(row), "turns") == want
    assert verify.fallbacks()["windowed_turns"] == before + 1
    # the windows would have placed it otherwise: the check is what kept it right
    msgs = normalize_messages(row)
    windowed, _ = EpisodeRenderer(tok, fast=False)._turns(msgs, steps_of(row), None, flattened=False, windowed=True)
    assert windowed != want


def test_checked_pieces_are_the_first_the_last_and_halving_back() -> None:
    assert checked_pieces(0) == [] and checked_pieces(1) == [0] and checked_pieces(2) == [1, 0]
    assert checked_pieces(98) == [97, 48, 24, 12, 6, 3, 1, 0]


def test_the_shared_samples_align_as_with_nothing_kept(tmp_path: Path) -> None:
    """Real sessions (the trajectories and the long samples: up to 101k tokens), each aligned in
    both renderings with the strategies on and with the rules only: the same alignments."""
    from _shared import SHARED

    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage import db
    from hcapo_store.storage.episodes import load_messages
    from hcapo_store.storage.store import Store

    folders = sorted((SHARED / "samples" / "trajectories").glob("episode_*")) + sorted(
        (SHARED / "samples" / "long").glob("episode_*")
    )
    if not folders:
        pytest.skip(f"{SHARED / 'samples'} is not here (../shared absent)")
    tok = real_tokenizer("qwen3")
    with Store.open(str(tmp_path / "s.db")) as store:
        assert not ingest(store, folders, jobs=1).failed
        with db.read(store.engine) as conn:
            ids = [int(r[0]) for r in conn.exec_driver_sql("SELECT id FROM episodes ORDER BY id")]
            episodes = [[dict(m) for m in load_messages(conn, i)] for i in ids]
    before = {k: verify.fallbacks().get(k, 0) for k in STRATEGIES}
    for msgs in episodes:
        for rendering in ("turns", "whole"):
            fast = EpisodeRenderer(tok).align(msgs, steps_of(msgs), rendering)
            assert fast == EpisodeRenderer(tok, fast=False).align(msgs, steps_of(msgs), rendering)
            assert fast.spans  # something placed: the comparison is not of two empty alignments
    assert {k: verify.fallbacks().get(k, 0) for k in before} == before
