"""The ``turns`` alignment's pieces kept across the episodes of one ``EpisodeRenderer`` (issue 43
item 4: a GRPO batch's rows share their whole prompt, and each row's hand-off rendered its ~100
steps' histories again). Every alignment equals the one the code before the change made
(``reference_turns``: its ``_align_turns`` verbatim, on a fresh renderer), for rows that share
their prompt, a row whose history differs in the middle, a row with a message that is not plain
data (never kept), and rows in any order; and the rows after the first render only their own turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _tokenizers import SHARED_TOKENIZERS, real_tokenizer

from hcapo_store.rendering.alignment import Alignment, EpisodeRenderer
from hcapo_store.rendering.kept_renders import message_digests, prefix_digests
from hcapo_store.rendering.own_tokens import NotOwn
from hcapo_store.rendering.prompts import normalize_messages


def reference_turns(renderer: EpisodeRenderer, msgs: list[dict], steps: list[tuple[int, int]]) -> Alignment:
    """``EpisodeRenderer._align_turns`` as it was before the pieces were kept (commit 5476412;
    its helpers given no digests: every render made anew)."""
    ids: list[int] = []
    out = Alignment(ids, flattened=False)
    previous: int | None = None
    for index, m in sorted(steps, key=lambda s: s[1]):
        if not 0 < m < len(msgs) or msgs[m].get("role") != "assistant" or m == previous:
            out.refused[index] = f"message {m} is not an assistant message after the first message"
            continue
        prompt = renderer._render(msgs[:m], generation=True)
        if previous is None:
            context = prompt
        else:
            end = renderer._turn_end(msgs[:m], None, previous, prompt)
            if end is None:
                out.refused[index] = "alignment: the end of the previous turn is not found in this step's prompt"
                continue
            context = prompt[end:]
        turn = renderer._turn_text(msgs, None, m, prompt)
        if turn is None:
            out.refused[index] = "alignment: the turn's generation prompt is not found in its rendering"
            continue
        turn_text, turn_empty = turn
        turn_ids, turn_offsets = renderer.locator.offsets(turn_text)
        try:
            span = renderer.locator.span(turn_text, turn_empty, msgs[m], turn_ids, turn_offsets)
            renderer.locator.check_decodes(turn_text, turn_ids, turn_offsets, span)
        except NotOwn as exc:
            out.refused[index] = exc.reason
            continue
        context_ids, _ = renderer.locator.offsets(context)
        ids.extend(context_ids)
        out.spans[index] = (len(ids) + span.start, len(ids) + span.end)
        ids.extend(turn_ids[: span.end])
        previous = m
    return out


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """A synthetic episode's messages up to its last assistant turn (bench/hindsight_pass.py's
    prompt, one subtask of it)."""
    from hcapo_store.devkit.synth import EpisodeBuilder
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage import db
    from hcapo_store.storage.episodes import load_messages
    from hcapo_store.storage.store import Store

    work: Path = tmp_path_factory.mktemp("shared-turns")
    path = EpisodeBuilder(seed=1, episode_id=1, reward=0.5, plan_ids=("S1", "S2")).standard(steps_per_subtask=2)
    path = path.write(work / "episode")
    with Store.open(str(work / "s.db")) as store:
        assert not ingest(store, [path], jobs=1).failed
        with db.read(store.engine) as conn:
            (episode_id,) = [int(r[0]) for r in conn.exec_driver_sql("SELECT id FROM episodes")]
            messages = [dict(m) for m in load_messages(conn, episode_id)]
    last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    return messages[:last]


def rows(prompt: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rollouts of the prompt: digit completions, an empty one, one with reasoning, one whose
    history differs in its middle, one with a message that is not plain data (a tuple)."""
    out = [[*prompt, {"role": "assistant", "content": text}] for text in ("12", "907", "")]
    out.append([*prompt, {"role": "assistant", "content": "4", "reasoning_content": "a sum"}])
    middle = max(i for i, m in enumerate(prompt) if m.get("role") == "assistant" and i < len(prompt) // 2)
    changed = [dict(m) for m in prompt]
    changed[middle]["content"] = str(changed[middle].get("content") or "") + " (edited)"
    out.append([*changed, {"role": "assistant", "content": "55"}])
    odd = [dict(m) for m in prompt]
    odd[1] = {**odd[1], "extra": ("not", "plain")}
    out.append([*odd, {"role": "assistant", "content": "3"}])
    return out


def steps_of(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(k, m) for k, m in enumerate(i for i, x in enumerate(messages) if x.get("role") == "assistant")]


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_kept_pieces_give_the_alignment_the_code_before_gave(name: str, prompt: list[dict[str, Any]]) -> None:
    tok = real_tokenizer(name)
    episodes = rows(prompt)
    reference = [reference_turns(EpisodeRenderer(tok), normalize_messages(ep), steps_of(ep)) for ep in episodes]
    assert all(r.spans for r in reference) and not reference[0].refused
    shared = EpisodeRenderer(tok)
    assert shared.kept is not None
    before = len(shared.kept.pieces)
    for order in (range(len(episodes)), reversed(range(len(episodes)))):  # new pieces, then all kept
        for i in order:
            got = shared.align(episodes[i], steps_of(episodes[i]), "turns")
            assert got == reference[i], (name, i)
    # the first row's pieces serve the rows that share its prompt: only the new turns were kept
    # (kept per tokenizer object: counted from what other tests' renderers of it had put)
    steps = len(steps_of(episodes[0]))
    assert len(shared.kept.pieces) - before < 3 * steps, len(shared.kept.pieces) - before


class Counting(EpisodeRenderer):
    """Counts the ``turns`` pieces it makes (kept pieces are not made again; a piece made again
    to check it, by the run-time checks, is not counted)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.rendered = 0

    def _turns(self, *args: Any, **kwargs: Any) -> Any:
        out, made = super()._turns(*args, **kwargs)
        self.rendered += len(made)
        return out, made


def test_pieces_are_kept_across_renderers_of_one_tokenizer(prompt: list[dict[str, Any]]) -> None:
    """A trainer makes a hand-off, and so a renderer, per step over the one tokenizer it keeps:
    the next step's renderer renders only the turns it has not seen, with the same alignment; a
    tokenizer whose chat template changed, or another tokenizer object, renders everything again."""
    from hcapo_store.rendering.tokenizers import load_tokenizer

    path = SHARED_TOKENIZERS / "qwen3"
    if not path.is_dir():
        pytest.skip(f"real tokenizer directory {path} is absent")
    tok = load_tokenizer(path)  # this test's own object: nobody else's pieces are kept for it
    episodes = rows(prompt)
    steps = len(steps_of(episodes[0]))
    first = Counting(tok)
    want = first.align(episodes[0], steps_of(episodes[0]), "turns")
    assert first.rendered == steps  # a new tokenizer: every turn rendered
    step_two = Counting(tok)  # the next training step's hand-off
    assert step_two.align(episodes[0], steps_of(episodes[0]), "turns") == want and step_two.rendered == 0
    got = step_two.align(episodes[1], steps_of(episodes[1]), "turns")
    assert step_two.rendered == 1  # only the row's own last turn
    fresh = EpisodeRenderer(load_tokenizer(path))
    assert got == reference_turns(fresh, normalize_messages(episodes[1]), steps_of(episodes[1]))
    other = Counting(load_tokenizer(path))  # another object: its own pieces
    other.align(episodes[0], steps_of(episodes[0]), "turns")
    assert other.rendered == steps
    tok.chat_template = tok.chat_template + " "  # changed: what was kept for it no longer counts
    changed = Counting(tok)
    changed.align(episodes[0], steps_of(episodes[0]), "turns")
    assert changed.rendered == steps


def test_prefix_digests_follow_the_prefix_and_stop_at_data_that_is_not_plain() -> None:
    a = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "1"}]
    b = [{"role": "user", "content": "x"}, {"role": "assistant", "content": 1}]
    c = [{"content": "x", "role": "user"}, {"role": "assistant", "content": "1"}]
    da, db_, dc = (prefix_digests(message_digests(x)) for x in (a, b, c))
    assert da[0] == db_[0] and da[1] != db_[1]  # same first message; "1" and 1 differ
    assert da[0] != dc[0]  # the keys' order is part of what a template renders
    odd = [{"role": "user", "content": ("x",)}, {"role": "assistant", "content": "1"}]
    assert prefix_digests(message_digests(odd)) == [None, None]
    assert message_digests(odd)[1] is not None  # one message that is not plain data: only it unkept
