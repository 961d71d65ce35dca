"""PieceOffsets (rendering/segments.py) finds a character's token by piece; the plain rule is a
bisection over the whole list of ranges the tokenizer itself gives. Checked at every character
position of real renderings (and one past each end), not at samples."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import pytest
from _tokenizers import episode, real_tokenizer

from hcapo_store.rendering.own_tokens import OwnTokenLocator
from hcapo_store.rendering.prompts import normalize_messages
from hcapo_store.rendering.segments import PieceOffsets, SegmentEncoder
from hcapo_store.rendering.template import render_chat


def _texts(tok) -> list[str]:
    texts = [
        "",
        "x",
        "<|im_end|>",
        "<|im_start|><|im_end|>",
        "a<|im_end|><|im_start|>b",
        "caf\u00e9 \U0001f600<|im_end|>",
    ]
    messages, _, _ = episode(1, steps=4, tool_chars=300)
    texts.append(render_chat(tok, normalize_messages(messages), generation=False))
    return texts


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_the_token_of_every_character_equals_a_bisection_over_the_tokenizers_ranges(name):
    tok = real_tokenizer(name)
    encoder = SegmentEncoder(tok)
    for text in _texts(tok):
        ids, offsets = encoder.offsets(text)
        assert isinstance(offsets, PieceOffsets)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        plain = [tuple(o) for o in enc["offset_mapping"]]
        assert ids == enc["input_ids"] and list(offsets) == plain
        for char in range(-1, len(text) + 2):
            assert offsets.first_ending_after(char) == bisect_right(plain, char, key=lambda o: o[1]), (text[:40], char)
            assert offsets.first_starting_from(char) == bisect_left(plain, char, key=lambda o: o[0]), (text[:40], char)


@pytest.mark.parametrize("name", ["qwen3"])
def test_spans_found_through_pieces_equal_spans_found_in_the_plain_list(name):
    """The locator's span search takes the piece path for PieceOffsets and bisects a list
    otherwise: the same spans, for every assistant turn's own characters."""
    tok = real_tokenizer(name)
    encoder = SegmentEncoder(tok)
    locator = OwnTokenLocator(tok, encoder)
    messages, _, _ = episode(2, steps=12, tool_chars=400)
    msgs = normalize_messages(messages)
    text = render_chat(tok, msgs, generation=False)
    ids, offsets = encoder.offsets(text)
    plain = list(offsets)
    checked = 0
    for m, msg in enumerate(msgs):
        content = msg.get("content") or ""
        if msg.get("role") != "assistant" or not content:
            continue
        cs = text.find(content)
        if cs < 0:  # rendered otherwise (its reasoning moved): not a span to compare here
            continue
        ce = cs + len(content)
        own = {"role": "assistant", "content": content}  # its text only (tool names are elsewhere)
        fast = locator.token_span(text, cs, ce, own, ids, offsets, reasoning_required=False)
        slow = locator.token_span(text, cs, ce, own, ids, plain, reasoning_required=False)
        assert fast == slow, m
        checked += 1
    assert checked >= 3
