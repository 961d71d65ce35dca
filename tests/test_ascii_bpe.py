"""rendering/ascii_bpe.py: byte-level BPE on ASCII text without the backend's pre-tokenizer.
The plain rule is the backend itself (``backend.encode(text, add_special_tokens=False)``):
ids and character offsets must be equal on every string of up to four characters over a
representative of each character class the patterns tell apart, on every pair of ASCII
characters, and on long texts (real renderings and a seeded random mix). The strategy must
vouch for every ASCII text there (a fallback to the backend would pass vacuously)."""

from __future__ import annotations

import itertools
import random

import pytest
from _tokenizers import episode, named_tokenizer, real_tokenizer

from hcapo_store.rendering.ascii_bpe import AsciiBpe, encode_pieces
from hcapo_store.rendering.prompts import normalize_messages
from hcapo_store.rendering.segments import SegmentEncoder
from hcapo_store.rendering.template import render_chat

# One character per class the patterns tell apart: the apostrophe and the contraction
# letters (either case), another letter, a digit, Oniguruma's whitespace (space, tab, LF, CR,
# VT, FF), punctuation, and controls that are whitespace to Python's \s but not to
# Oniguruma's (0x1C) or to neither (0x00, 0x7F).
CLASSES = list("'sTrevLdmx7 \t\n\r\x0b\x0c.\x1c\x00\x7f")

NAMES = ["demo", "chatml-bos", "qwen3", "qwen2.5"]  # GPT-2's pattern (demo, chatml-bos) and Qwen2's


@pytest.fixture(params=NAMES)
def backend(request, tmp_path, demo_tokenizer_dir):
    return named_tokenizer(request.param, tmp_path, demo_tokenizer_dir).backend_tokenizer


def _strategy(backend) -> AsciiBpe:
    fast, why = AsciiBpe.of(backend)
    assert fast is not None, why
    return fast


def _check(fast: AsciiBpe, backend, texts) -> int:
    n = 0
    for text in texts:
        got = fast.encode(text)
        assert got is not None, repr(text)  # it vouches for every ASCII text of these pipelines
        want = backend.encode(text, add_special_tokens=False)
        assert got.ids == want.ids, repr(text)
        assert got.offsets == want.offsets, repr(text)
        n += 1
    return n


# ~8-10 s a tokenizer: the second tokenizer of each pattern is in the slow tier (the same sweep
# on the same pattern: chatml-bos is GPT-2's like demo, qwen2.5 Qwen2's like qwen3, both fast).
@pytest.mark.parametrize(
    "backend",
    [
        "demo",
        pytest.param("chatml-bos", marks=pytest.mark.slow),
        "qwen3",
        pytest.param("qwen2.5", marks=pytest.mark.slow),
    ],
    indirect=True,
)
def test_every_short_string_over_the_character_classes_encodes_as_the_backend(backend):
    fast = _strategy(backend)
    texts = ("".join(t) for k in range(1, 5) for t in itertools.product(CLASSES, repeat=k))
    assert _check(fast, backend, texts) == sum(len(CLASSES) ** k for k in range(1, 5))


def test_every_pair_of_ascii_characters_encodes_as_the_backend(backend):
    fast = _strategy(backend)
    texts = (chr(a) + chr(b) for a in range(128) for b in range(128))
    assert _check(fast, backend, texts) == 128 * 128


def test_long_texts_encode_as_the_backend(backend):
    fast = _strategy(backend)
    rng = random.Random(34)
    words = ["the", "don't", "I'LL", "we've", "x=1;", "  ", "\n\n", " \n", "\t", "42", "...", "__init__", "'s", "\r\n"]
    texts = ["".join(rng.choice(words + CLASSES) for _ in range(rng.randint(50, 400))) for _ in range(200)]
    assert _check(fast, backend, texts) == 200


def test_rendered_conversations_encode_as_the_backend_piece_by_piece(tmp_path, demo_tokenizer_dir):
    """The pieces a SegmentEncoder cuts from real renderings (ASCII ones through the strategy,
    the others through the backend) give the tokenizer's own ids and offsets."""
    for name in NAMES:
        try:
            tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
        except pytest.skip.Exception:
            continue
        encoder = SegmentEncoder(tok)
        assert encoder.ascii_off_reason is None
        messages, _, _ = episode(3, steps=10, tool_chars=500)
        text = render_chat(tok, normalize_messages(messages), generation=False)
        ids, offsets = encoder.offsets(text)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids == enc["input_ids"] and list(offsets) == [tuple(o) for o in enc["offset_mapping"]]
        assert encoder.encode_once(text) == enc["input_ids"]
        assert SegmentEncoder(tok, ascii_fast=False).offsets(text)[0] == ids


def test_text_that_is_not_ascii_goes_to_the_backend(backend):
    fast = _strategy(backend)
    pieces = ["plain text", "caf\u00e9 na\u00efve", "\u6771\u4eac \u2713", "again plain", "nbsp\u00a0here"]
    assert [fast.encode(p) is None for p in pieces] == [False, True, True, False, True]
    got = encode_pieces(backend, fast, pieces)
    want = backend.encode_batch(pieces, add_special_tokens=False)
    assert [(g.ids, g.offsets) for g in got] == [(w.ids, w.offsets) for w in want]


def test_a_pipeline_it_does_not_reproduce_is_refused_with_the_reason():
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast, why = AsciiBpe.of(tok)
    assert fast is None and "pre-tokenizer" in why

    # Qwen2's sequence with another pattern (Llama 3's: numbers in threes) is not Qwen2's
    llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    assert AsciiBpe.of(tok)[0] is None

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert AsciiBpe.of(tok)[0] is None  # a prefix space changes the first pre-token

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert AsciiBpe.of(tok)[0] is not None
    tok.normalizer = normalizers.Lowercase()
    fast, why = AsciiBpe.of(tok)
    assert fast is None and "normalizer" in why


def test_counting_texts_with_added_tokens_inside_counts_as_the_tokenizer(tmp_path, demo_tokenizer_dir):
    """``count`` takes whole texts (turn windows count message texts), which may hold added
    tokens: those are split by the backend, never read as characters."""
    tok = named_tokenizer("demo", tmp_path, demo_tokenizer_dir)
    encoder = SegmentEncoder(tok)
    marker = next(iter(encoder._token_ids))
    texts = ["plain words", f"before {marker} after", "more words\n"]
    assert encoder.count(texts) == [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    assert encoder.count(texts[::2]) == [len(tok.encode(t, add_special_tokens=False)) for t in texts[::2]]


def test_a_part_with_a_key_it_does_not_know_refuses_the_strategy():
    """Issue 40: a newer tokenizers' option on a part this strategy reads (here a key on the
    Split, as a later release would serialize it; this release drops unknown keys when it
    loads a file) is not ignored: the strategy is refused, the backend tokenizes."""
    import json as _json

    backend = real_tokenizer("qwen3").backend_tokenizer

    class NewerPart:
        def __init__(self, part):
            self.state = _json.loads(part.__getstate__())
            self.state["pretokenizers"][0]["future_option"] = True

        def __getstate__(self):
            return _json.dumps(self.state)

    class NewerBackend:
        pre_tokenizer = NewerPart(backend.pre_tokenizer)

        def __getattr__(self, name):
            return getattr(backend, name)

    assert AsciiBpe.of(backend)[0] is not None
    fast, why = AsciiBpe.of(NewerBackend())
    assert fast is None and "future_option" in (why or "")


def test_the_memo_keeps_no_long_runs():
    """Issue 41: forty distinct 1 MB runs kept 974 MB; a long pre-token is never remembered
    and the remembered characters are bounded."""
    from hcapo_store.rendering import ascii_bpe

    tok = real_tokenizer("qwen3")
    fast, _ = ascii_bpe.AsciiBpe.of(tok.backend_tokenizer)
    assert fast is not None
    for n in range(40):
        assert fast.encode(" " * (20_000 + n) + "x") is not None
    assert fast._memo_chars <= ascii_bpe.MEMO_CHARS + ascii_bpe.MEMO_WORD_CHARS
    assert all(len(word) <= ascii_bpe.MEMO_WORD_CHARS for word in fast._memo)
