"""Token fidelity: the ``turns`` rows hold exactly the ids a multi-turn RL trainer accumulates.

The reference here is written from the chat template alone (``tokenizer.apply_chat_template``),
the way a token-in/token-out rollout builds its context:

* the first step's prompt: ``render(messages[:m], add_generation_prompt=True)``;
* each turn as the policy produced it: ``render(messages[:m + 1])`` minus that prompt, up to
  and including the end-of-turn token the policy stopped on;
* between two turns, what the template writes after the previous turn's end-of-turn token up to
  the next generation prompt. It is read from a rendering where the previous turn is a plain
  sentinel text, so it never depends on how the template shows that turn later.

Each piece is encoded alone (the trainer never re-tokenizes across a boundary) and the pieces
are concatenated. The row must equal it token for token: no piece of a special token, no
character lost or doubled (the bug this guards: ``<|im_end|>`` then the text ``|im_end|>``).
"""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path
from typing import Any

import pytest
from _shared import SHARED
from _tokenizers import CHATML_WITH_BOS, bos_tokenizer, loaded_tokenizer, real_tokenizer
from test_tokenized import _rows, scored_with

from hcapo_store.ingestion.parsing import ConvertOptions
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.export import export_dataset
from hcapo_store.rendering.alignment import EpisodeRenderer
from hcapo_store.rendering.messages import flatten_messages
from hcapo_store.rendering.prompts import normalize_messages
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import Handoff

DATA = Path(__file__).parent / "data"
SENTINEL = "SENTINEL-TURN-7f3a"
SAMPLE_DIRS = [SHARED / "samples" / "trajectories", SHARED / "samples" / "long"]

# A ChatML template that refuses tool traffic, like many base-model templates.
NO_TOOLS = (
    "{% for m in messages %}{% if m.role == 'tool' or m.tool_calls %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}{% endfor %}" + CHATML_WITH_BOS
)


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama-3 tokenizer committed under tests/data/llama3 (see its SOURCE.md), unpacked."""
    out = tmp_path_factory.mktemp("llama3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with lzma.open(DATA / "llama3" / f"{name}.xz") as src, (out / name).open("wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def _render(tok: Any, messages: list[dict], generation: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def trainer_row(tok: Any, msgs: list[dict], turns: list[int], eot: str) -> list[int]:
    """The plain, slow rule: the ids a multi-turn rollout holds after producing ``turns``."""
    ids: list[int] = []
    previous: int | None = None
    for m in turns:
        if previous is None:
            ids += _encode(tok, _render(tok, msgs[:m], True))
        else:
            marked = [*msgs[:previous], {"role": "assistant", "content": SENTINEL}, *msgs[previous + 1 : m]]
            prompt = _render(tok, marked, True)
            after = prompt.index(SENTINEL + eot) + len(SENTINEL + eot)
            ids += _encode(tok, prompt[after:])
        prompt = _render(tok, msgs[:m], True)
        full = _render(tok, msgs[: m + 1], False)
        assert full.startswith(prompt), f"message {m}: the template renders the prompt differently once answered"
        action = full[len(prompt) :]
        ids += _encode(tok, action[: action.index(eot) + len(eot)])
        previous = m
    return ids


def _episodes(store: Store, options: ConvertOptions = ConvertOptions()) -> list[list[dict]]:
    dirs = [d for d in SAMPLE_DIRS if d.is_dir()]
    if not dirs:
        pytest.skip(f"the shared samples {SAMPLE_DIRS[0]} are absent")
    ingest(store, dirs, options=options)
    with store.engine.connect() as conn:
        return [load_messages(conn, i) for (i,) in store.query("SELECT id FROM episodes ORDER BY id")[1]]


def _assistant_steps(msgs: list[dict]) -> list[tuple[int, int]]:
    return list(enumerate(m for m, msg in enumerate(msgs) if m and msg["role"] == "assistant"))


def _check(tok: Any, episodes: list[list[dict]], eot: str, *, flatten: bool = False) -> int:
    """Every episode's ``turns`` row equals the rule; returns how many turn boundaries were checked."""
    renderer = EpisodeRenderer(tok)
    boundaries = 0
    for raw in episodes:
        steps = _assistant_steps(raw)
        al = renderer.align(raw, steps, "turns")
        assert al.flattened == flatten
        msgs = flatten_messages(raw) if flatten else normalize_messages(raw)
        placed = [m for index, m in steps if index in al.spans]
        for reason in al.refused.values():  # only turns with nothing of their own are left out
            assert reason.startswith("empty_action"), reason
        assert placed, "no step placed"
        want = trainer_row(tok, msgs, placed, eot)
        assert al.input_ids == want, _first_difference(tok, al.input_ids, want)
        boundaries += len(placed) - 1
    return boundaries


def _first_difference(tok: Any, got: list[int], want: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (
        f"first difference at token {i} of {len(got)}/{len(want)}: "
        f"got {tok.decode(got[max(0, i - 5) : i + 5])!r}, want {tok.decode(want[max(0, i - 5) : i + 5])!r}"
    )


def test_qwen3_rows_equal_the_trainer_rule_on_the_samples(store: Store) -> None:
    tok = real_tokenizer("qwen3")
    episodes = _episodes(store)
    assert _check(tok, episodes, "<|im_end|>") > 200  # the two long samples alone have hundreds of boundaries


@pytest.mark.slow  # the rule on the long samples again (~30 s); test_qwen3_rows_... stays fast
def test_qwen3_no_thinking_rows_equal_the_trainer_rule(store: Store) -> None:
    tok = real_tokenizer("qwen3")
    episodes = _episodes(store, ConvertOptions(include_thinking=False))
    assert not any("<think>" in (m.get("content") or "") for msgs in episodes for m in msgs)
    assert _check(tok, episodes, "<|im_end|>") > 200


@pytest.mark.slow  # the rule on the long samples, another template (~30 s)
def test_qwen25_rows_equal_the_trainer_rule(store: Store) -> None:
    tok = real_tokenizer("qwen2.5")
    assert _check(tok, _episodes(store), "<|im_end|>") > 200


@pytest.mark.slow  # the rule on the long samples, another template (~30 s)
def test_llama3_rows_equal_the_trainer_rule(store: Store, llama3_dir: Path) -> None:
    tok = load_tokenizer(llama3_dir)
    # Its (original Llama-3) template writes no tool calls and never raises on them, so the
    # episodes are given with their tool traffic as text (as a tool-less agent writes it).
    episodes = [flatten_messages(msgs) for msgs in _episodes(store)]
    assert _check(tok, episodes, "<|eot_id|>") > 200


def test_a_template_that_rejects_tools_gets_the_flattened_rule(store: Store, tmp_path: Path) -> None:
    tok = bos_tokenizer(tmp_path, template=NO_TOOLS)
    episodes = _episodes(store)
    with pytest.raises(Exception, match="not supported"):
        tok.apply_chat_template(normalize_messages(episodes[0]), tokenize=False)
    assert _check(tok, episodes, "<|im_end|>", flatten=True) > 0


def test_no_special_token_piece_between_turns_in_the_export(store: Store, tmp_path: Path) -> None:
    """The issue's symptom, through the export and the trainer hand-off: after every turn end
    the next ids are the template's, never the text of the end-of-turn token again."""
    samples = SHARED / "samples" / "trajectories"
    tok_dir = SHARED / "tokenizers" / "qwen3"
    if not samples.is_dir() or not tok_dir.is_dir():
        pytest.skip("the shared samples or the Qwen3 tokenizer are absent")
    scored_with(store, samples, tok_dir)
    tok = loaded_tokenizer(tok_dir)
    export_dataset(store, tmp_path / "t.jsonl", "r", min_reward=0.0, layout="tokenized", tokenizer=tok_dir)
    rows = _rows(tmp_path / "t.jsonl")
    assert rows
    ep_ids = dict(store.query("SELECT name, id FROM episodes")[1])
    handoff = Handoff(store, "r", tokenizer=tok_dir)
    with store.engine.connect() as conn:
        for row in rows:
            msgs = normalize_messages(load_messages(conn, ep_ids[row["episode"]]))
            assert "|im_end|>|im_end|>" not in tok.decode(row["token_ids"])
            assert row["token_ids"] == trainer_row(tok, msgs, row["step_message_indices"], "<|im_end|>")
            assert handoff.rendered_ids(row["episode"]) == row["token_ids"]
            credit = handoff.advantages(row["episode"], row["token_ids"])
            assert list(credit.advantages) == pytest.approx(row["advantages"], abs=1e-6)
