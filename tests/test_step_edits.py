"""Per-step renders edited from the previous step's (``rendering/step_edits.py``): every step's
two texts equal its window rendered whole (property-based, over sessions with user turns, runs of
tool results, system messages, empty turns; four templates; whole histories and bounded windows),
and edits are made where a session continues (the comparison is not of whole renders with
themselves). A template that reads outside the short window, or an edit that went wrong, is caught
by the run-time check (``verify.EDITED_RENDERS``), counted, and the episode built on whole renders;
the real samples build as in reference mode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _hypothesis import session_settings
from _shared import SHARED
from _tokenizers import CHATML_WITH_BOS, bos_tokenizer, episode, named_tokenizer, real_tokenizer
from hypothesis import example, given
from hypothesis import strategies as st

from hcapo_store.rendering import step_edits, verify
from hcapo_store.rendering.hindsight import inject_hindsight
from hcapo_store.rendering.messages import normalize_messages
from hcapo_store.rendering.own_tokens import EMPTY_TURN
from hcapo_store.rendering.prompt_rule import head_end_of, render_pair
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import StepPrompt
from hcapo_store.rendering.step_edits import StepEdits, edited
from hcapo_store.rendering.template import TemplateRejected, render_chat

WORDS = "the of and to run test file path value data 42 café 東京 ✓ {} [] : ; ok \n \t".split(" ")
words = st.lists(st.sampled_from(WORDS), min_size=0, max_size=24).map(" ".join)
TEMPLATES = ("qwen3", "qwen2.5", "chatml-bos", "demo")


def test_an_edit_replaces_the_long_text_from_where_the_short_ones_part() -> None:
    assert edited("HEAD a b GEN", "h a GEN", "h a c GEN") == "HEAD a b a c GEN"[:0] + "HEAD a b c GEN"
    assert edited("xyz", "abc", "abc") == "xyz"  # nothing changed
    assert edited("long END", "s END", "s END more") == "long END more"  # only appended
    # the long text does not end as the short one did from where they part: no edit
    assert edited("long OTHER", "s END", "s MORE") is None


@st.composite
def sessions(draw: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": "You act. " + draw(words)})
    messages.append({"role": "user", "content": "Task: " + draw(words)})
    for s in range(draw(st.integers(2, 9))):
        turn = draw(st.integers(0, 9))
        if turn == 0:
            messages.append({"role": "user", "content": "Continue. " + draw(words)})
        elif turn == 1:
            messages.append({"role": "system", "content": "Note: " + draw(words)})
        reasoning = draw(st.one_of(st.just(""), words))
        content = draw(words)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content,
        }
        calls = draw(st.integers(0, 3))
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"c{s}_{c}",
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": draw(words)}, ensure_ascii=False)},
                }
                for c in range(calls)
            ]
        messages.append(message)
        for c in range(calls):
            messages.append({"role": "tool", "name": "bash", "tool_call_id": f"c{s}_{c}", "content": draw(words)})
    return messages


def _continuing(messages: list[dict[str, Any]], actions: list[int]) -> bool:
    """Whether some step follows the one before it with only tool results between them."""
    return any(
        all(messages[k]["role"] == "tool" for k in range(p + 1, m)) for p, m in zip(actions, actions[1:], strict=False)
    )


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("step-edits")


def _call(s: int) -> list[dict[str, Any]]:
    return [{"id": f"c{s}", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]


# Two assistant turns in a row, the first without reasoning: as the last message of a prefix Qwen3
# renders it with an empty think block, and without one once anything follows. Its steps from the
# second on (skip=1): a short window that started at the previous action would not see that turn change
IN_A_ROW = [
    {"role": "user", "content": "Task: go"},
    {"role": "assistant", "content": "first"},
    {"role": "assistant", "content": "second"},
    {"role": "assistant", "content": "third", "tool_calls": _call(3)},
    {"role": "tool", "name": "bash", "tool_call_id": "c3", "content": "out"},
    {"role": "assistant", "content": "fourth", "tool_calls": _call(4)},
    {"role": "tool", "name": "bash", "tool_call_id": "c4", "content": "out"},
    {"role": "assistant", "content": "<think>\n\n</think>\n\nfifth"},
    {"role": "assistant", "content": "sixth"},
]


@session_settings(60)
@given(
    messages=sessions(),
    name=st.sampled_from(TEMPLATES),
    start=st.integers(0, 6),
    skip=st.integers(0, 3),
    empty_turns=st.booleans(),
)
@example(messages=IN_A_ROW, name="qwen3", start=0, skip=1, empty_turns=True)
@example(messages=IN_A_ROW, name="qwen2.5", start=0, skip=1, empty_turns=True)
def test_every_edited_step_equals_its_window_rendered_whole(
    messages: list[dict[str, Any]],
    name: str,
    start: int,
    skip: int,
    empty_turns: bool,
    module_tmp: Path,
    demo_tokenizer_dir: Path,
) -> None:
    """``start``: the windows' first message after the head (0: whole histories); ``skip``: the
    chain's first actions left out (a run that resumes, or a line started by another head);
    ``empty_turns`` (--action-span policy): an edited step's empty-turn text too equals its
    window rendered whole with the action an empty turn."""
    tok = named_tokenizer(name, module_tmp, demo_tokenizer_dir)
    msgs = normalize_messages(messages)

    def render(window: list[dict], *, generation: bool) -> str:
        return render_chat(tok, window, generation=generation)

    head_end = head_end_of(msgs)
    actions = [i for i, x in enumerate(msgs) if x["role"] == "assistant" and i >= head_end]
    head = inject_hindsight(msgs[:head_end], "HINDSIGHT: the outcome")
    # a bounded chain's windows: the head and the messages from a fixed start (0: the whole history)
    begin = head_end + min(start, len(msgs) - head_end) if start else head_end
    while begin < len(msgs) and msgs[begin]["role"] == "tool":
        begin += 1
    chain = [m for m in actions if m >= begin][skip:]
    edits = StepEdits(render, empty_turns=empty_turns)
    edits.start_episode(on=True)
    empties = 0
    for m in chain:
        window = [*head, *msgs[begin : m + 1]]
        try:
            want = render_pair(render, window, False)
        except TemplateRejected:
            with pytest.raises(TemplateRejected):
                edits.pair(window, head_end, False)
            continue
        got = edits.pair(window, head_end, False)
        assert (got.prefix_text, got.full_text) == (want.prefix_text, want.full_text), m
        if got.empty_text is not None:
            empties += 1
            assert got.empty_text == render([*window[:-1], EMPTY_TURN], generation=False), m
    assert edits.finish() is None  # and the run-time checks found nothing either
    if _continuing(msgs, chain):
        assert edits.edited_steps > 0  # the steps were edited, not rendered whole
        if empty_turns and name != "qwen3":  # (Qwen3 refuses some empty turns: renders then whole)
            assert empties > 0  # and their empty-turn texts too
    if not empty_turns:
        assert empties == 0


def _reference(builder: PromptBuilder, messages: list, outcome: Any, steps: list) -> list:
    return [builder.build_step_reference(messages, outcome, step) for step in steps]


@pytest.mark.parametrize("name", ["demo", "chatml-bos", "qwen3"])
def test_build_episode_edits_steps_and_equals_the_rule(name: str, tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    before = verify.fallbacks().get("edited_renders", 0)
    for max_context in (1_000_000, 600):  # whole histories, then bounded windows
        builder = PromptBuilder(tok, max_context=max_context, max_logprob_tokens=0)
        for seed in range(3):
            messages, outcome, steps = episode(seed, steps=30, tool_chars=300)
            assert builder.build_episode(messages, outcome, steps) == _reference(builder, messages, outcome, steps)
        # most steps continue the one before; a bounded chain's window that moves starts a new line
        assert builder.edited_steps > (45 if max_context > 10_000 else 10)
    assert verify.fallbacks().get("edited_renders", 0) == before


# numbers the tool results: a short window numbers them from its own start
NUMBERED = CHATML_WITH_BOS.replace(
    "\n{{ m.content }}", "\n{% if m.role == 'tool' %}#{{ loop.index }} {% endif %}{{ m.content }}"
)


def test_a_template_that_reads_outside_the_short_window_is_caught(tmp_path: Path) -> None:
    tok = bos_tokenizer(tmp_path, template=NUMBERED)
    messages, outcome, steps = episode(0, steps=12, tool_chars=100, extra_user_turns=False)
    builder = PromptBuilder(tok, max_context=1_000_000, max_logprob_tokens=0)
    before = verify.fallbacks().get("edited_renders", 0)
    assert builder.build_episode(messages, outcome, steps) == _reference(builder, messages, outcome, steps)
    assert verify.fallbacks()["edited_renders"] == before + 1
    assert builder.edited_steps == 0  # the episode was built again on whole renders
    # unchecked, the edits would have given other texts: the check is what kept it right
    msgs = normalize_messages(messages)
    edits = StepEdits(lambda w, *, generation: render_chat(tok, w, generation=generation), verify.UNCHECKED)
    edits.start_episode(on=True)
    differs = False
    for step in steps:
        window = inject_hindsight(msgs[: step["message_index"] + 1], "H")
        got, want = edits.pair(window, 1, False), render_pair(builder.render, window, False)
        differs |= (got.prefix_text, got.full_text) != (want.prefix_text, want.full_text)
    assert differs


# marks an empty turn with the conversation's length: a short window counts fewer messages
EMPTY_COUNTED = CHATML_WITH_BOS.replace(
    "\n{{ m.content }}", "\n{% if not m.content %}[{{ loop.length }}]{% endif %}{{ m.content }}"
)


@pytest.mark.parametrize("template", ["chatml-bos", "empty-counted"])
def test_policy_spans_on_edited_empty_turns_equal_the_rule_and_a_wrong_one_is_caught(
    template: str, tmp_path: Path
) -> None:
    """--action-span policy: each edited step's empty-turn text comes from a short render, not the
    window's whole one, and the spans equal the rule's. A template whose empty turn reads outside
    the short window (its message count) gives a wrong one: the check sees it, and the episode is
    built again on whole renders."""
    tok = bos_tokenizer(tmp_path, template=EMPTY_COUNTED if template == "empty-counted" else CHATML_WITH_BOS)
    messages, outcome, steps = episode(0, steps=30, tool_chars=100, extra_user_turns=False)
    builder = PromptBuilder(tok, max_context=1_000_000, max_logprob_tokens=0, action_span="policy")
    empty_turns: list[int] = []  # the messages of every window rendered with an empty turn
    real = builder._render

    def counted(window: list[dict], *, generation: bool) -> str:
        if window[-1] is EMPTY_TURN:
            empty_turns.append(len(window))
        return real(window, generation=generation)

    builder._render = counted  # type: ignore[method-assign]
    before = verify.fallbacks().get("edited_renders", 0)
    built = builder.build_episode(messages, outcome, steps)
    fast = sum(empty_turns)
    assert built == _reference(builder, messages, outcome, steps)
    if template == "empty-counted":
        assert verify.fallbacks()["edited_renders"] == before + 1
        assert builder.edited_steps == 0  # the episode was built again on whole renders
    else:
        assert verify.fallbacks().get("edited_renders", 0) == before
        assert all(isinstance(p, StepPrompt) for p in built) and builder.edited_steps > 20
        # rendered whole, the empty turns would have been every step's whole history: 853 messages
        # here; short windows and the checks' whole renders are 324
        assert fast < 0.5 * sum(step["message_index"] + 1 for step in steps)


def test_an_edit_gone_wrong_mid_line_is_caught_at_the_line_end(
    tmp_path: Path, demo_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit that goes wrong at one step stays wrong for the rest of its line: the line's last
    step, rendered whole, shows it; the episode is built again and the rule's prompts stored."""
    tok = named_tokenizer("demo", tmp_path, demo_tokenizer_dir)
    messages, outcome, steps = episode(1, steps=12, tool_chars=100, extra_user_turns=False)
    builder = PromptBuilder(tok, max_context=1_000_000, max_logprob_tokens=0)
    want = _reference(builder, messages, outcome, steps)
    calls = {"n": 0}
    real = step_edits.edited

    def wrong_once(long_before: str, short_before: str, short_now: str) -> str | None:
        calls["n"] += 1
        out = real(long_before, short_before, short_now)
        return out.replace("Task:", "Task :", 1) if calls["n"] == 7 and out is not None else out

    monkeypatch.setattr(step_edits, "edited", wrong_once)
    before = verify.fallbacks().get("edited_renders", 0)
    assert builder.build_episode(messages, outcome, steps) == want
    assert calls["n"] > 7 and verify.fallbacks()["edited_renders"] == before + 1


def test_unchecked_builders_edit_on_trust_and_reference_mode_edits_nothing(
    tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    tok = named_tokenizer("demo", tmp_path, demo_tokenizer_dir)
    messages, outcome, steps = episode(2, steps=10, tool_chars=100)
    reference = PromptBuilder(tok, max_context=1_000_000, rendering="reference")
    unchecked = PromptBuilder(tok, max_context=1_000_000, checks=verify.UNCHECKED)
    assert unchecked.build_episode(messages, outcome, steps) == reference.build_episode(messages, outcome, steps)
    assert unchecked.edited_steps > 0 and reference.edited_steps == 0


@pytest.mark.skipif(not (SHARED / "samples" / "long").is_dir(), reason="needs ../shared/samples/long")
def test_the_long_samples_build_as_their_steps_by_the_rule(tmp_path: Path) -> None:
    """The real 99-step sessions (69k and 101k Qwen3 tokens, user turns in one): per-step prompts
    edited where the session continues, on bounded windows and whole histories; every 6th step and
    the last (an edit gone wrong stays wrong for the rest of its line) equal their build by the rule."""
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage.episodes import load_episode
    from hcapo_store.storage.store import Store

    tok = real_tokenizer("qwen3")
    with Store.open(str(tmp_path / "long.db")) as store:
        assert not ingest(store, sorted((SHARED / "samples" / "long").glob("episode_*")), jobs=1).failed
        with store.engine.connect() as conn:
            ids = [r[0] for r in store.query("SELECT id FROM episodes WHERE is_current ORDER BY id")[1]]
            episodes = [load_episode(conn, i) for i in ids]
    fast = PromptBuilder(tok, max_context=32768)
    before = verify.fallbacks()
    for ep in episodes:
        built = fast.build_episode(ep.messages, ep.outcome, ep.steps)
        for k in [*range(0, len(built), 6), len(built) - 1]:
            assert built[k] == fast.build_step_reference(ep.messages, ep.outcome, ep.steps[k]), k
        assert any(isinstance(p, StepPrompt) and p.truncated_prefix_tokens for p in built)
    assert fast.edited_steps > 100 and fast.bounded_steps > 0
    assert verify.fallbacks() == before
