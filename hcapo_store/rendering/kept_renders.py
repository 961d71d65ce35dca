"""Chat-template renders kept by a digest of their messages, per tokenizer object.

A GRPO group's rows share their prompt and differ in the last turn. The hand-off places each
row in both renderings (``alignment.py``), and nearly all it renders is the same for every row
of the group: the history before the row's own turn (rendered four ways to cut out that turn),
the local renders ``placement.py`` makes per step, the skeleton with every turn empty. Those
renders are kept here, so the group's second row renders only what its own turn changes.

A render is kept under the digest of its messages (each message's ``repr``, exact for plain JSON
data in its key order; a message that is not plain data is never kept, nor any list holding one)
and the generation flag, per tokenizer object while its chat template, special tokens, size and
added tokens stay the same (``tokenizer_state``). What is kept is bounded by its size in memory
(``RENDER_BYTES``), the oldest dropped first.

A template is a function of its messages, except one that reads the clock (``strftime_now``).
So the kept render is the strategy :data:`verify.KEPT_RENDERS` and the template's render now is
its rule: the first hits of each process and one in 1024 after are rendered again and compared
(a kept piece, :data:`verify.KEPT_PIECES`: the first 2 and one in 4096, each five renders of a
whole history); a difference is counted, the fresh one is used, and nothing is kept for that
tokenizer object from then on. ``HCAPO_RENDERING=reference`` keeps nothing.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from hcapo_store.rendering import verify
from hcapo_store.rendering.own_tokens import EMPTY_TURN
from hcapo_store.rendering.template import plain_data, render_chat
from hcapo_store.rendering.tokenizers import PerTokenizer

# bytes of kept renders per tokenizer object (sys.getsizeof: a text outside Latin-1 takes 2 or 4
# bytes a character); a 99-step, 9k-token prompt's first row keeps ~2 MB: a few training steps' groups
RENDER_BYTES = 64 * 1024 * 1024
# ``turns`` pieces kept (alignment.py): a GRPO batch's rows share their prompt's ~100 steps, so
# its rows after the first render only their own last turn
TURN_PIECES = 4096
DIGEST_BYTES = 20

Digests = Sequence[bytes | None]


def message_digest(message: Any) -> bytes | None:
    """The digest of one message's ``repr``, or None when it is not plain data (str, int, float,
    bool, None, lists, dicts with str keys: whose ``repr`` is exact, in their order)."""
    if not plain_data(message):
        return None
    return hashlib.blake2b(repr(message).encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES).digest()


def message_digests(msgs: Sequence[Any]) -> list[bytes | None]:
    return [message_digest(m) for m in msgs]


def list_digest(digests: Digests) -> bytes | None:
    """One digest of a message list from its messages' digests (None if one is None). Equal to
    :func:`prefix_digests`' entry for a list's prefix."""
    chain = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for d in digests:
        if d is None:
            return None
        chain.update(d)
    return chain.digest()


def prefix_digests(digests: Digests) -> list[bytes | None]:
    """Per index ``m``, :func:`list_digest` of ``digests[: m + 1]``, in one pass; None from the
    first message that is not plain data on."""
    out: list[bytes | None] = []
    chain = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for d in digests:
        if d is None or (out and out[-1] is None):
            out.append(None)
            continue
        chain.update(d)
        out.append(chain.copy().digest())
    return out


EMPTY_DIGEST = message_digest(EMPTY_TURN)


def pick(msgs: Sequence[dict], digests: Digests | None, at: Iterable[int | None]) -> tuple[list[dict], Digests | None]:
    """The messages at the indices ``at`` (None: an empty assistant turn in its place) and their
    digests (None when ``digests`` is)."""
    at = list(at)
    chosen = [EMPTY_TURN if i is None else msgs[i] for i in at]
    return chosen, None if digests is None else [EMPTY_DIGEST if i is None else digests[i] for i in at]


def render_kept(
    kept: KeptRenders | None, tokenizer: Any, msgs: list[dict], digests: Digests | None, *, generation: bool
) -> str:
    """``render_chat``, through ``kept`` where there is one and the messages' digests are given."""
    if kept is not None and digests is not None:
        return kept.render(tokenizer, msgs, digests, generation=generation)
    return render_chat(tokenizer, msgs, generation=generation)


def tokenizer_state(tokenizer: Any) -> tuple[Any, ...]:
    """What a tokenizer object's renders and pieces are made from: its chat template, special
    tokens, size and added tokens (a test or a trainer may change the object)."""
    added = getattr(tokenizer, "added_tokens_encoder", None)
    specials = getattr(tokenizer, "special_tokens_map", None)
    return (
        getattr(tokenizer, "chat_template", None),
        repr(specials),
        _size(tokenizer),
        dict(added) if added else None,
    )


def _size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return None


class KeptRenders:
    """One tokenizer object's renders by (digest of the messages, generation), and the ``turns``
    alignment's pieces (``alignment.py``: kept by the digest of the messages up to the turn, never
    changed once put); thread-safe."""

    def __init__(self, budget: int = RENDER_BYTES) -> None:
        self.budget = budget
        self.on = True  # False once a kept render or piece differed from the one made now
        self.misses = 0  # renders made because none was kept
        self._kept: OrderedDict[tuple[bytes, bool], str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.pieces: dict[Any, Any] = {}

    def piece(self, key: Any) -> Any:
        return self.pieces.get(key) if self.on else None

    def put_piece(self, key: Any, value: Any) -> None:
        if not self.on:
            return
        if len(self.pieces) >= TURN_PIECES:
            self.pieces.clear()
        self.pieces[key] = value

    def render(self, tokenizer: Any, msgs: list[dict], digests: Digests | None, *, generation: bool) -> str:
        """``render_chat(tokenizer, msgs, generation=...)``; ``digests``: each message's
        :func:`message_digest` (None: not kept)."""
        digest = list_digest(digests) if digests is not None and self.on else None
        if digest is None:
            return render_chat(tokenizer, msgs, generation=generation)
        key = (digest, generation)
        with self._lock:
            text = self._kept.get(key)
            if text is not None:
                self._kept.move_to_end(key)
        if text is None:
            text = render_chat(tokenizer, msgs, generation=generation)
            self._put(key, text)
            return text
        if verify.due(verify.KEPT_RENDERS):
            fresh = render_chat(tokenizer, msgs, generation=generation)
            if fresh != text:
                self.switch_off(
                    verify.KEPT_RENDERS, f"a kept render of {len(msgs)} message(s) differs from the render now"
                )
                return fresh
        return text

    def _put(self, key: tuple[bytes, bool], text: str) -> None:
        with self._lock:
            self.misses += 1
            size = sys.getsizeof(text)
            if not self.on or key in self._kept or size > self.budget:
                return
            self._kept[key] = text
            self._bytes += size
            while self._bytes > self.budget:
                _, old = self._kept.popitem(last=False)
                self._bytes -= sys.getsizeof(old)

    def switch_off(self, strategy: verify.Strategy, detail: str) -> None:
        """A kept render or piece differed from the one made now: counted as ``strategy``'s
        fallback, nothing kept from now on."""
        verify.disagreed(strategy, detail)
        with self._lock:
            self.on = False
            self._kept.clear()
            self._bytes = 0
            self.pieces.clear()

    def __len__(self) -> int:
        return len(self._kept)


_RENDERS = PerTokenizer()


def kept_renders(tokenizer: Any) -> KeptRenders | None:
    """The renders kept for ``tokenizer`` (a new store when its state changed, one of its own
    when it cannot be weakly referenced), or None in reference mode (the rules only)."""
    if verify.reference_mode():
        return None
    renders: KeptRenders = _RENDERS.get(tokenizer, tokenizer_state(tokenizer), KeptRenders)
    return renders
