"""Tokenizing rendered chat text piece by piece between added tokens, bit-identical to the
tokenizer: cached pieces for the per-step renders of one episode, and ids with character
offsets for one long rendering. Pieces of pure ASCII go through ascii_bpe.py (the same ids
and offsets without the backend's regex); the others in one batch, in parallel by the backend."""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Any, overload

from hcapo_store.rendering.ascii_bpe import AsciiBpe, encode_pieces
from hcapo_store.rendering.verify import CHECKED, Checks


def _walk_json(node: Any) -> list[dict]:
    if isinstance(node, dict):
        return [node] + [d for v in node.values() for d in _walk_json(v)]
    if isinstance(node, list):
        return [d for v in node for d in _walk_json(v)]
    return []


class SegmentEncoder:
    """Tokenizes rendered chat text segment by segment, bit-identical to ``tokenizer.encode``.

    Why it is exact: a ``tokenizers`` backend first cuts the text at added tokens
    (leftmost-longest match on the raw text when the tokens are not ``normalized``) and then
    normalizes, pre-tokenizes and runs the model on every other piece on its own. So the ids
    of a text are the concatenation of the ids of its pieces, and a piece's ids can be cached.
    The preconditions for that are checked in :meth:`_fast_path_reason`; when one fails,
    every text is encoded whole.

    Consecutive renders of one episode share long prefixes: a ``RenderState`` remembers the last
    text as (piece, added token) pairs and reuses the ids of the pairs the new text starts
    with. A reused pair must be followed by the same added token in the new text, and no
    added token contains another, so no match can start inside a reused piece and end in
    the changed part.
    """

    def __init__(
        self, tokenizer: Any, *, ascii_fast: bool = True, reference: bool = False, checks: Checks = CHECKED
    ) -> None:
        self._tokenizer = tokenizer
        self._checks = checks  # ascii_bpe.py's pieces held to backend.encode by its policy (verify.py)
        # reference: every text tokenized whole by the tokenizer itself (HCAPO_RENDERING=reference)
        self.fast_path_off_reason = "reference mode" if reference else self._fast_path_reason(tokenizer)
        self._token_ids: dict[str, int] = {}
        self._splitter: re.Pattern[str] | None = None
        # ASCII pieces through ascii_bpe.py (the same ids and offsets, a third of the CPU)
        self._ascii: AsciiBpe | None = None
        self.ascii_off_reason: str | None = "off" if not ascii_fast else self.fast_path_off_reason
        if self.fast_path_off_reason is None:
            backend = tokenizer.backend_tokenizer
            self._backend = backend
            if ascii_fast:
                self._ascii, self.ascii_off_reason = AsciiBpe.of(backend)
            self._token_ids = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
            tokens = sorted(self._token_ids, key=len, reverse=True)
            self._splitter = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None
        self.pieces: dict[str, list[int]] = {}

    @staticmethod
    def _fast_path_reason(tokenizer: Any) -> str | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return "tokenizer has no `tokenizers` backend"
        if getattr(backend, "encode_special_tokens", False) or getattr(tokenizer, "split_special_tokens", False):
            return "special tokens are split as text"
        added = list(backend.get_added_tokens_decoder().values())
        if any(t.normalized or t.lstrip or t.rstrip or t.single_word for t in added):
            return "an added token is normalized or strips/single-word matched"
        contents = [t.content for t in added]
        if any(a != b and a in b for a in contents for b in contents):
            return "an added token contains another"
        # the two parts read alone: the whole spec (vocabulary and merges) takes ~0.5 s to write and parse
        parts = [json.loads(p.__getstate__()) for p in (backend.pre_tokenizer, backend.normalizer) if p is not None]
        for node in [d for part in parts for d in _walk_json(part)]:
            # Metaspace(prepend_scheme="first") only prefixes the piece at offset 0 of the
            # whole text, so a piece encoded alone would differ.
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                return "Metaspace pre-tokenizer prepends only at the start of the text"
        return None

    def encode_whole(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def new_state(self) -> RenderState:
        return RenderState()

    def encode(self, text: str, state: RenderState) -> list[int]:
        if self._splitter is None:
            if self.fast_path_off_reason:
                return self.encode_whole(text)
            self._cache_pieces([text])
            return list(self.pieces[text])
        reused_pairs, pos = state.match(text)
        pairs: list[tuple[str, str]] = []
        start = pos
        for match in self._splitter.finditer(text, pos):
            pairs.append((text[start : match.start()], match.group()))
            start = match.end()
        tail = text[start:]
        self._cache_pieces([p for p, _ in pairs] + [tail])
        ids = state.ids[: state.counts[reused_pairs - 1]] if reused_pairs else []
        state.truncate(reused_pairs)
        for piece, token in pairs:
            ids.extend(self.pieces[piece])
            ids.append(self._token_ids[token])
            state.push(piece, token, len(ids))
        ids.extend(self.pieces[tail])
        state.ids = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` as the tokenizer's own decoder writes it (special tokens kept)."""
        if self.fast_path_off_reason is None:
            return str(self._backend.decode(ids, skip_special_tokens=False))
        return str(self._tokenizer.decode(ids))

    def _split(self, text: str) -> tuple[list[str], list[tuple[int, int, int]]]:
        """The pieces between added tokens (one more than the tokens) and each added token's
        (start, end, id), in the segmentation the tokenizer itself makes."""
        assert self._splitter is not None
        pieces, tokens, start = [], [], 0
        for match in self._splitter.finditer(text):
            pieces.append(text[start : match.start()])
            tokens.append((match.start(), match.end(), self._token_ids[match.group()]))
            start = match.end()
        pieces.append(text[start:])
        return pieces, tokens

    def encode_once(self, text: str) -> list[int]:
        """The ids of ``text`` (as ``tokenizer.encode``), its pieces encoded in one batch and
        not cached: for a text rendered once (a whole conversation)."""
        if self._splitter is None:
            return self.encode_whole(text)
        pieces, tokens = self._split(text)
        ids: list[int] = []
        for n, enc in enumerate(self._encode_all(pieces)):
            ids.extend(enc.ids)
            if n < len(tokens):
                ids.append(tokens[n][2])
        return ids

    def count(self, texts: list[str]) -> list[int]:
        """The number of ids of each text on its own (one batch, nothing cached)."""
        if not texts:
            return []
        if self.fast_path_off_reason:
            return [len(self.encode_whole(t)) for t in texts]
        splitter = self._splitter
        if splitter is not None and any(splitter.search(t) for t in texts):  # not pieces: the backend splits them
            return [len(enc.ids) for enc in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [len(enc.ids) for enc in self._encode_all(texts)]

    def clean_cut(self, text: str, limit: int) -> int | None:
        """The last place at or before ``limit`` where ``text`` can be cut so that the ids of
        ``text[:cut]`` are the ids of ``text`` that start before it, whatever follows the cut in
        another text that shares ``text[:limit]``: the end of an added token (pieces are encoded
        alone; no added token contains another). 0 when none; None without the fast path."""
        if self._splitter is None:
            return None
        cut = 0
        for match in self._splitter.finditer(text):  # from the start: the segmentation the tokenizer sees
            if match.end() > limit:
                break
            cut = match.end()
        return cut

    def settled_cut(self, text: str, join: int) -> int | None:
        """The end of the first added token that starts an added token's length or more after
        ``join``, in the segmentation the tokenizer makes of ``text``: after it, the ids of
        ``text`` are those of any text that ends the same way from ``join`` on, whatever
        comes before ``join`` (no match can reach across that far). None when there is none,
        or without the fast path."""
        if self._splitter is None:
            return None
        limit = join + max(map(len, self._token_ids))
        for match in self._splitter.finditer(text):
            if match.start() >= limit:
                return match.end()
        return None

    def offsets(self, text: str) -> tuple[list[int], Sequence[tuple[int, int]]]:
        """The ids of ``text`` and each one's character range, equal to the tokenizer's
        ``return_offsets_mapping``: the pieces between added tokens are encoded (ASCII ones by
        ascii_bpe.py, the rest in one batch); their ranges are read on demand
        (:class:`PieceOffsets`)."""
        if self._splitter is None:
            enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        pieces, tokens = self._split(text)
        encodings = self._encode_all(pieces)
        ids: list[int] = []
        for n, enc in enumerate(encodings):
            ids.extend(enc.ids)
            if n < len(tokens):
                ids.append(tokens[n][2])
        return ids, PieceOffsets(encodings, tokens)

    def _cache_pieces(self, pieces: list[str]) -> None:
        """Encode the pieces not cached yet, in one batch."""
        missing = list({p for p in pieces if p not in self.pieces})
        if missing:
            for piece, enc in zip(missing, self._encode_all(missing)):
                self.pieces[piece] = enc.ids

    def _encode_all(self, texts: list[str]) -> list[Any]:
        """Each text's encoding (``.ids``, ``.offsets``), as ``encode_batch`` makes them; the
        texts are pieces (no added token inside)."""
        return encode_pieces(self._backend, self._ascii, texts, self._checks)


class RenderState:
    """The previous text of one render sequence, as (piece, added token) pairs."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pairs: list[str] = []  # piece + token, to compare without slicing
        self.counts: list[int] = []  # ids after each pair

    def match(self, text: str) -> tuple[int, int]:
        pos = 0
        for n, pair in enumerate(self.pairs):
            if not text.startswith(pair, pos):
                return n, pos
            pos += len(pair)
        return len(self.pairs), pos

    def truncate(self, n: int) -> None:
        del self.pairs[n:], self.counts[n:]

    def push(self, piece: str, token: str, count: int) -> None:
        self.pairs.append(piece + token)
        self.counts.append(count)


_START, _END = itemgetter(0), itemgetter(1)


class PieceOffsets(Sequence[tuple[int, int]]):
    """Each id's character range in a text encoded piece by piece (:meth:`SegmentEncoder.offsets`),
    made on demand: a piece's ranges are taken from its encoding and shifted to where the
    piece stands only when one of them is read. A placement reads those around each step's
    span; making all ~70k pairs of a real-size episode cost more than placing its steps.

    ``encodings``: one per piece; ``tokens``: the (start, end, id) of the added token after
    each piece but the last. Indexed like a list (negative indexes and slices too)."""

    def __init__(self, encodings: Sequence[Any], tokens: Sequence[tuple[int, int, int]]) -> None:
        self._encodings = encodings
        self._tokens = tokens
        self._counts = [len(enc) for enc in encodings]
        self._firsts: list[int] = []  # the index of each piece's first id
        n = 0
        for count in self._counts:
            self._firsts.append(n)
            n += count + 1  # the piece's ids, then its added token
        self._len = n - 1 if encodings else 0  # no added token after the last piece
        self._shifted: dict[int, list[tuple[int, int]]] = {}
        self._starts = [0] + [b for _, b, _ in tokens]  # where each piece's text starts

    def __len__(self) -> int:
        return self._len

    def _piece(self, p: int) -> list[tuple[int, int]]:
        got = self._shifted.get(p)
        if got is None:
            at = self._tokens[p - 1][1] if p else 0  # a piece starts where the added token before it ends
            got = self._shifted[p] = [(a + at, b + at) for a, b in self._encodings[p].offsets]
        return got

    @overload
    def __getitem__(self, i: int) -> tuple[int, int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[int, int]]: ...
    def __getitem__(self, i: int | slice) -> tuple[int, int] | list[tuple[int, int]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("offset index out of range")
        p = bisect_right(self._firsts, i) - 1
        local = i - self._firsts[p]
        if local < self._counts[p]:
            return self._piece(p)[local]
        a, b, _ = self._tokens[p]
        return (a, b)

    def first_ending_after(self, char: int) -> int:
        """The first id whose characters end after ``char`` (len(self) when none): the piece or
        added token that holds ``char`` is found by its characters, then the piece's own ranges
        are searched. Equal to a bisection over the whole list (ends ascend)."""
        return self._first(char, end=True)

    def first_starting_from(self, char: int) -> int:
        """The first id whose characters start at or after ``char`` (len(self) when none)."""
        return self._first(char, end=False)

    def _first(self, char: int, *, end: bool) -> int:
        if not self._len:
            return 0
        p = max(bisect_right(self._starts, char) - 1, 0)
        if p < len(self._tokens) and char >= self._tokens[p][0]:  # in (or at) the added token after piece p
            a, b, _ = self._tokens[p]
            if (b > char) if end else (a >= char):
                return self._firsts[p] + self._counts[p]
            return self._firsts[p + 1]  # the next piece's first id, or its added token
        ranges = self._piece(p)
        local = bisect_right(ranges, char, key=_END) if end else bisect_left(ranges, char, key=_START)
        return self._firsts[p] + local  # past the piece's ids: its added token (or the end)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for p in range(len(self._encodings)):
            yield from self._piece(p)
            if p < len(self._tokens):
                yield self._tokens[p][:2]
