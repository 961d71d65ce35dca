"""The ``whole`` rendering's credited tokens against TRL's training templates' assistant masks.

TRL ships chat templates with ``{% generation %}`` blocks; ``return_assistant_tokens_mask``
then marks what TRL trains on. On the same conversations, per assistant turn, the tokens the
store credits and the tokens TRL marks differ in exactly these classes, on purpose
(docs/OUTPUTS.md, "Against TRL's assistant masks"):

* the newline after the end-of-turn token (``<|im_end|>\\n``): TRL marks it, the store does
  not: the policy stops at ``<|im_end|>`` and never generates that newline;
* Qwen2.5: the newline that ends the ``<|im_start|>assistant`` header: the template's;
* Qwen3: the empty think block (``<think>\\n\\n</think>\\n\\n``) the template writes on a turn
  without reasoning: the template's, not the policy's;
* Qwen3: a turn before the last user message, which the chat template renders without its
  reasoning: TRL's training template is prefix-preserving and keeps that reasoning (so its ids
  differ from the chat template's) and marks the whole turn; the store's ``whole`` rendering
  has no reasoning there and refuses the step (``turns`` has it, as the policy produced it).

Qwen3's template in ../shared is not one TRL knows (``get_training_chat_template`` refuses
it), so the Qwen3 case renders with TRL's own ``qwen3_chat_template`` on the Qwen3 vocabulary.
"""

from __future__ import annotations

from typing import Any

import pytest
from _shared import SAMPLES
from _tokenizers import real_tokenizer

from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.rendering.alignment import EpisodeRenderer
from hcapo_store.rendering.prompts import normalize_messages
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store

chat_template_utils = pytest.importorskip("trl.chat_template_utils")

EMPTY_THINK = "<think>\n\n</think>\n\n"


def _episodes(store: Store) -> list[list[dict]]:
    if not SAMPLES.is_dir():
        pytest.skip(f"the shared samples {SAMPLES} are absent")
    ingest(store, [SAMPLES])
    with store.engine.connect() as conn:
        return [normalize_messages(load_messages(conn, i)) for (i,) in store.query("SELECT id FROM episodes")[1]]


def _masked_runs(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    runs, current = [], []
    for token, marked in zip(ids, mask):
        if marked:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


def _compare(tok: Any, msgs: list[dict]) -> tuple[list[str | None], list[str], list[int], list[int]]:
    """Per assistant turn: the store's credited text (None: refused) and TRL's masked text."""
    steps = list(enumerate(m for m, x in enumerate(msgs) if m and x["role"] == "assistant"))
    al = EpisodeRenderer(tok).align(msgs, steps, "whole")
    assert all(reason.startswith("rendering") for reason in al.refused.values())
    training = chat_template_utils.get_training_chat_template(tok)
    out = tok.apply_chat_template(
        msgs, chat_template=training, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ours = [tok.decode(al.input_ids[slice(*al.spans[i])]) if i in al.spans else None for i, _ in steps]
    return ours, _masked_runs(tok, out["input_ids"], out["assistant_masks"]), al.input_ids, out["input_ids"]


def test_qwen25_differs_from_trl_only_by_the_templates_newlines(store: Store) -> None:
    tok = real_tokenizer("qwen2.5")
    for msgs in _episodes(store):
        ours, theirs, our_ids, their_ids = _compare(tok, msgs)
        assert our_ids == their_ids  # the same rendering: only the credited positions differ
        assert len(ours) == len(theirs) > 0
        assert all(o is not None and t == "\n" + o + "\n" for o, t in zip(ours, theirs))


def test_qwen3_differs_from_trl_only_by_the_eot_newline_and_the_empty_think_block(store: Store) -> None:
    tok = real_tokenizer("qwen3")
    tok.chat_template = chat_template_utils.qwen3_chat_template
    seen = {"eot newline": 0, "empty think": 0, "reasoning dropped": 0}
    for msgs in _episodes(store):
        ours, theirs, _, _ = _compare(tok, msgs)
        assert len(ours) == len(theirs) > 0
        for turn, o, t in zip([m for m in msgs[1:] if m["role"] == "assistant"], ours, theirs):
            content = turn.get("content") or ""
            if o is None:  # refused: the template dropped its reasoning; TRL's training template keeps it
                reasoning = content.split("</think>")[0].split("<think>")[-1].strip()
                assert reasoning and reasoning in t and t.endswith("<|im_end|>\n")
                seen["reasoning dropped"] += 1
            elif "<think>" in content:
                assert t == o + "\n"
                seen["eot newline"] += 1
            else:
                assert t == EMPTY_THINK + o + "\n"
                seen["empty think"] += 1
    assert all(seen.values()), seen
