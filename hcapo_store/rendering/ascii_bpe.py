"""Byte-level BPE on pure-ASCII text without the backend's pre-tokenizer: the same ids and
character offsets as ``backend.encode(text, add_special_tokens=False)``, in about a third of
the CPU.

Why: the episode layout tokenizes each whole conversation once, and most of that time is
not the BPE merges (the backend caches them per word) but the pre-tokenizer's regex, run by
Oniguruma (on a 25k-token episode ~26 of ~36 ms; Python's ``re`` splits the same text in 3).
The client's budget (≤ 1 ms of CPU per step, issue 34) has the tokenizer as its largest part.

Why it is exact, and when it is used (:meth:`AsciiBpe.of` says why not otherwise):

* The pipeline is one of two known byte-level ones, read from the backend's own parts:
  ``Split(Qwen2's pattern, isolated)`` then ``ByteLevel(use_regex=False)`` (Qwen2, 2.5, 3),
  or ``ByteLevel(use_regex=True)`` alone (GPT-2's pattern); no prefix space; normalizer
  none or NFC; a BPE model without dropout; a post-processor that leaves offsets alone;
  no truncation or padding.
* Only pure-ASCII text takes this path. On ASCII, NFC changes nothing, one character is one
  byte, and the patterns' Unicode classes are exactly the ASCII sets written out below
  (``\\p{L}``: A–Z a–z; ``\\p{N}``: 0–9; ``\\s``: Oniguruma's Unicode whitespace, which in
  ASCII is tab, LF, VT, FF, CR and space; not Python's ``\\s``, which adds 0x1C–0x1F). Both
  engines are backtracking with leftmost-first alternation, so the same pattern over the same
  classes makes the same pre-tokens.
* Each pre-token is mapped byte by byte to the ByteLevel alphabet (the table read from the
  backend's own ByteLevel) and given to the backend's own model (``model.tokenize``); its
  tokens must spell the pre-token exactly, else the text goes to the backend.

* Every key of the pipeline parts it reads must be one it knows (``KNOWN_KEYS``): an option a
  later ``tokenizers`` adds refuses the strategy, whatever its value.

What is checked, and how: tests/test_ascii_bpe.py holds it to ``backend.encode`` on every
string of up to four characters over a representative of each character class, every pair
of ASCII characters, and long texts. At run time (verify.ASCII_BPE) the first 64 pieces of
each process and one in 512 after are encoded by the backend too; a difference switches the
strategy off for the process and counts an ``ascii_bpe`` fallback. The scorer fingerprint
and the server-tokenizer check never go through it (they use the backend tokenizer), so a
``tokenizers`` release that changes ASCII text changes the fingerprint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from hcapo_store.rendering import verify

# The pre-tokenizer patterns this strategy reproduces, as the tokenizer files spell them.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's is built into ByteLevel(use_regex=True), no file spells it:
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

_S = r"[\t\n\v\f\r ]"  # Oniguruma's \s on ASCII
_NOT_S = r"[^\t\n\v\f\r ]"
# The same patterns over ASCII, each class written out (see the module docstring).
_ASCII_PATTERNS = {
    "qwen2": re.compile(
        r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
        r"|[^\r\nA-Za-z0-9]?[A-Za-z]+"
        r"|[0-9]"
        r"| ?[^\t\n\v\f\r A-Za-z0-9]+[\r\n]*"
        rf"|{_S}*[\r\n]+"
        rf"|{_S}+(?!{_NOT_S})"
        rf"|{_S}+"
    ),
    "gpt2": re.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d"
        r"| ?[A-Za-z]+"
        r"| ?[0-9]+"
        r"| ?[^\t\n\v\f\r A-Za-z0-9]+"
        rf"|{_S}+(?!{_NOT_S})"
        rf"|{_S}+"
    ),
}

# Distinct pre-tokens remembered; past either bound the memo starts over. The characters are
# bounded too (a pre-token can be a megabyte of spaces: forty such runs kept 974 MB), and a
# pre-token longer than MEMO_WORD_CHARS is never remembered.
MEMO_LIMIT = 100_000
MEMO_CHARS = 2_000_000
MEMO_WORD_CHARS = 1024


# Every key of the pipeline parts this strategy reads, by part type: a part with any other
# key (a newer tokenizers' option) refuses the strategy, whatever its value.
KNOWN_KEYS = {
    "ByteLevel": {"type", "add_prefix_space", "trim_offsets", "use_regex"},
    "Split": {"type", "pattern", "behavior", "invert"},
    "Sequence": {"type", "pretokenizers", "normalizers", "processors"},
    "NFC": {"type"},
    "TemplateProcessing": {"type", "single", "pair", "special_tokens"},
}


def _state(part: Any) -> Any:
    return None if part is None else json.loads(part.__getstate__())


def _unknown_keys(node: Any) -> str | None:
    """The first key of a known pipeline part (or of one inside a Sequence) not in KNOWN_KEYS."""
    if node is None:
        return None
    known = KNOWN_KEYS.get(node.get("type"))
    if known is None:  # a type the checks below refuse in their own words
        return None
    extra = sorted(set(node) - known)
    if extra:
        return f"{node.get('type')} key {extra[0]!r}"
    for child in node.get("pretokenizers") or node.get("normalizers") or node.get("processors") or ():
        why = _unknown_keys(child)
        if why:
            return why
    return None


def _pipeline(backend: Any) -> tuple[str | None, str]:
    """(which pattern, "") when the backend's pipeline is one this strategy reproduces, else
    (None, why not)."""
    pre = _state(backend.pre_tokenizer)
    normalizer = _state(backend.normalizer)
    post = _state(backend.post_processor)
    model = backend.model
    for part in (pre, normalizer, post):
        why = _unknown_keys(part)
        if why is not None:
            return None, f"a pipeline this strategy does not know: {why}"
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None, f"normalizer {normalizer.get('type')}"
    if post is not None and not (
        post.get("type") == "TemplateProcessing" or (post.get("type") == "ByteLevel" and not post.get("trim_offsets"))
    ):
        return None, f"post-processor {post.get('type')} (offsets may be trimmed)"
    if type(model).__name__ != "BPE" or getattr(model, "dropout", None) not in (None, 0.0):
        return None, "not a BPE model without dropout"
    if backend.truncation is not None or backend.padding is not None:
        return None, "truncation or padding is set"
    if pre is None:
        return None, "no pre-tokenizer"
    if pre.get("type") == "ByteLevel" and pre.get("use_regex") and not pre.get("add_prefix_space"):
        return "gpt2", ""
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if parts and len(parts) == 2:
        split, byte_level = parts
        if (
            split.get("type") == "Split"
            and split.get("pattern") == {"Regex": QWEN2_PATTERN}
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex")
            and not byte_level.get("add_prefix_space")
        ):
            return "qwen2", ""
    return None, "a pre-tokenizer this strategy does not reproduce"


class AsciiEncoding:
    """One text's ids, and its tokens' character ranges made when read (the duck type of a
    ``tokenizers.Encoding`` that ``SegmentEncoder`` and ``PieceOffsets`` use)."""

    __slots__ = ("ids", "_text", "_coder", "_offsets")

    def __init__(self, ids: list[int], text: str, coder: AsciiBpe) -> None:
        self.ids = ids
        self._text = text
        self._coder = coder
        self._offsets: list[tuple[int, int]] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def offsets(self) -> list[tuple[int, int]]:
        if self._offsets is None:
            self._offsets = self._coder.offsets(self._text)
        return self._offsets


class AsciiBpe:
    """The strategy for one backend (see the module docstring)."""

    def __init__(self, backend: Any, kind: str) -> None:
        self._model = backend.model
        self._pattern = _ASCII_PATTERNS[kind]
        # each ASCII character's letter in the ByteLevel alphabet, as the backend's own
        # pre-tokenizer maps it (a single character is a single pre-token in both pipelines)
        letters = {}
        for b in range(128):
            pieces = backend.pre_tokenizer.pre_tokenize_str(chr(b))
            if len(pieces) != 1 or len(pieces[0][0]) != 1:
                raise ValueError(f"the pre-tokenizer maps {chr(b)!r} to {pieces!r}")
            letters[chr(b)] = pieces[0][0]
        self._alphabet = str.maketrans(letters)
        # pre-token -> (ids, each token's length in characters); None: the backend's call
        self._memo: dict[str, tuple[list[int], list[int]] | None] = {}
        self._memo_chars = 0
        self.off = False  # a sampled piece disagreed with the backend (verify.ASCII_BPE)

    @classmethod
    def of(cls, backend: Any) -> tuple[AsciiBpe | None, str | None]:
        """(the strategy, None) for a backend it reproduces, else (None, why not)."""
        try:
            kind, why = _pipeline(backend)
            return (cls(backend, kind), None) if kind else (None, why)
        except Exception as exc:  # an unreadable part: the backend's own path
            return None, f"cannot read the pipeline ({type(exc).__name__}: {exc})"

    def _word(self, word: str) -> tuple[list[int], list[int]] | None:
        got = self._memo.get(word, False)
        if got is not False:
            return got  # type: ignore[return-value]
        mapped = word.translate(self._alphabet)
        tokens = self._model.tokenize(mapped)
        values = [t.value for t in tokens]
        # the tokens must spell the pre-token (byte-level BPE always does; anything else: the backend)
        got = ([t.id for t in tokens], [len(v) for v in values]) if "".join(values) == mapped else None
        if len(word) > MEMO_WORD_CHARS:
            return got
        if len(self._memo) >= MEMO_LIMIT or self._memo_chars >= MEMO_CHARS:
            self._memo.clear()
            self._memo_chars = 0
        self._memo[word] = got
        self._memo_chars += len(word)
        return got

    def encode(self, text: str) -> AsciiEncoding | None:
        """``text``'s encoding, or None when this strategy does not vouch for it (not ASCII, or
        a pre-token its model does not spell): encode it with the backend."""
        if not text.isascii():
            return None
        words = self._pattern.findall(text)
        if sum(map(len, words)) != len(text):  # a stretch no alternative matched (none in these patterns)
            return None
        ids: list[int] = []
        get = self._memo.get
        for word in words:
            got = get(word) or self._word(word)
            if got is None:
                return None
            ids += got[0]
        return AsciiEncoding(ids, text, self)

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """Each token's character range in ``text`` (one that :meth:`encode` vouched for)."""
        out: list[tuple[int, int]] = []
        for match in self._pattern.finditer(text):
            at = match.start()
            got = self._word(match.group())
            assert got is not None  # encode() vouched for every pre-token of this text
            for n in got[1]:
                out.append((at, at + n))
                at += n
        return out


def encode_pieces(
    backend: Any, fast: AsciiBpe | None, pieces: Sequence[str], checks: verify.Checks = verify.CHECKED
) -> list[Any]:
    """Each piece's encoding (``.ids``, ``.offsets``, ``len``), as ``backend.encode_batch``
    makes them: through ``fast`` where it vouches for a piece, the rest in one batch. The
    pieces its policy samples (verify.ASCII_BPE) are encoded by the backend too; a
    disagreement switches ``fast`` off for the process and the backend's encodings are used."""
    if fast is None or fast.off:
        return list(backend.encode_batch(list(pieces), add_special_tokens=False))
    out: list[Any] = [fast.encode(p) for p in pieces]
    vouched = [n for n, enc in enumerate(out) if enc is not None]
    for k in checks.sampled(verify.ASCII_BPE, len(vouched)):
        n, enc = vouched[k], out[vouched[k]]
        rule = backend.encode(pieces[n], add_special_tokens=False)
        if rule.ids != enc.ids or [tuple(o) for o in rule.offsets] != enc.offsets:
            fast.off = True
            verify.disagreed(verify.ASCII_BPE, f"a piece of {len(pieces[n])} characters")
            return list(backend.encode_batch(list(pieces), add_special_tokens=False))
    rest = [n for n, enc in enumerate(out) if enc is None]
    if rest:
        for n, enc in zip(rest, backend.encode_batch([pieces[n] for n in rest], add_special_tokens=False)):
            out[n] = enc
    return out
