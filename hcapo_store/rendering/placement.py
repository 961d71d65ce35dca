"""Where each step's own tokens sit in one rendering of the whole conversation, in linear time.

The rule is the one of ``own_tokens.py``: a step's own text is where the conversation's
rendering differs from the same rendering with that assistant turn replaced by an empty one.
Applied step by step (:func:`place_exact`) that renders the whole conversation once per
step, which is quadratic in the episode's length (a 2,000-step session renders 2,000 times
4,000 messages). :func:`place` gets the same spans from three renderings in all:

* ``W``: the whole conversation;
* ``K``: the whole conversation with *every* step's turn empty (the skeleton);
* per step, a small local rendering (the first message, the last user message before the
  step, the step, the next user message after it; and the same with the turn empty) that
  gives the step's own text.

Walking ``W`` and ``K`` together, each step's own text is found in ``W`` after the previous
one, and everything between two own texts must be identical in ``W`` and ``K`` (the
template's text, tool results, user messages), up to the short wrapper the template writes
for an empty turn. So the located texts are exactly where ``W`` and ``K`` differ, one per
step, in order: the same characters the step-by-step rule finds. Whenever this check fails
(a template whose rendering of one turn depends on other turns in a way the local rendering
does not reproduce) the episode is placed with :func:`place_exact` instead: slower, never
different.

Characters become tokens through the fast tokenizer's offsets (one tokenization of ``W``);
every span's tokens must decode to exactly the text they cover.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hcapo_store.rendering.kept_renders import Digests, KeptRenders, pick, render_kept
from hcapo_store.rendering.own_tokens import EMPTY_TURN, NotOwn, OwnSpan, OwnTokenLocator, own_chars, own_pieces
from hcapo_store.rendering.segments import SegmentEncoder
from hcapo_store.rendering.strings import common_prefix
from hcapo_store.rendering.template import TemplateRejected

# How many characters after a step's own text must agree in W and K to resume the walk there.
RESYNC_CHARS = 64

Steps = list[tuple[int, int]]  # (step_index, message_index), in message order


@dataclass
class Placement:
    """One rendering of the whole conversation and each step's own tokens in it (or why not)."""

    text: str
    ids: list[int]
    offsets: Sequence[tuple[int, int]]  # each id's characters in text
    spans: dict[int, OwnSpan] = field(default_factory=dict)  # step_index -> span
    refused: dict[int, str] = field(default_factory=dict)  # step_index -> reason
    linear: bool = True  # False: placed step by step (place_exact)


class _Mismatch(Exception):
    """The linear walk cannot vouch for a span: place the episode step by step."""


def _resync(whole: str, end: int, skeleton: str, ka: int, most: int) -> int | None:
    """Where the skeleton goes on as ``whole`` does after a step's own text: past the short text
    the template writes for an empty turn (at most ``most`` characters). Of the places where the
    next characters agree, the one agreeing longest (up to RESYNC_CHARS; the next step may begin
    sooner), the nearest on a tie. The next segment's full comparison then vouches for it."""
    if end == len(whole):
        return len(skeleton) if len(skeleton) - ka <= most else None
    probe = whole[end : end + 8]
    best, best_len = None, 0
    j = skeleton.find(probe, ka, ka + most + len(probe))
    while j >= 0:
        n = common_prefix(whole, skeleton, end, j, RESYNC_CHARS)
        if n > best_len:
            best, best_len = j, n
        j = skeleton.find(probe, j + 1, ka + most + len(probe))
    return best


def _check_step(msgs: list[dict], m: int) -> str | None:
    if not 0 < m < len(msgs) or msgs[m].get("role") != "assistant":
        return f"message {m} is not an assistant message after the first message"
    return None


class UserTurns:
    """Per message index, the last user message before it and the next one after it (one pass
    each way, so finding them for every step stays linear)."""

    def __init__(self, msgs: list[dict]) -> None:
        n = len(msgs)
        self.msgs = msgs
        self.before: list[int | None] = [None] * n
        self.after: list[int | None] = [None] * n
        last: int | None = None
        for i in range(n):
            self.before[i] = last
            if i > 0 and msgs[i].get("role") == "user":
                last = i
        nxt: int | None = None
        for i in range(n - 1, -1, -1):
            self.after[i] = nxt
            if msgs[i].get("role") == "user":
                nxt = i

    def key(self, m: int) -> tuple[int | None, int | None]:
        """The user messages that :meth:`context` renders turn ``m`` between."""
        return self.before[m], self.after[m]

    def context(self, m: int) -> tuple[list[int], list[int]]:
        """The message indices to render turn ``m`` between, so that a template renders it as in
        the whole conversation: the first message and the last user message before it, and the
        next user message after it if there is one (Qwen3 renders a turn's reasoning only after
        the last)."""
        u, q = self.before[m], self.after[m]
        return [0] + ([u] if u is not None else []), [q] if q is not None else []


class Placer:
    """Places the steps of one conversation in its whole rendering (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        reasoning_required: bool = True,
        encoder: SegmentEncoder | None = None,
        renders: KeptRenders | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.locator = OwnTokenLocator(tokenizer, encoder)
        # False: a turn the template renders without its reasoning (Qwen3, before the last user
        # message) is placed as rendered, its text and tool calls, instead of refused.
        self.reasoning_required = reasoning_required
        # renders kept by their messages' digests (kept_renders.py), used where ``place`` is
        # given the digests: the hand-off's rows share all but their last turn
        self.renders = renders

    def _render(self, msgs: list[dict], generation: bool = False, digests: Digests | None = None) -> str:
        return render_kept(self.renders, self.tokenizer, msgs, digests, generation=generation)

    def place(
        self, msgs: list[dict], steps: Steps, *, digests: Digests | None = None, known: Placement | None = None
    ) -> Placement:
        """Raises :class:`TemplateRejected` when the template cannot render the conversation.
        ``digests``: each message's (``kept_renders.message_digest``), to render through the
        kept renders. ``known``: a :meth:`rendering` made earlier (used where its text is this one)."""
        out = self.rendering(msgs, digests=digests, known=known)  # its spans and refusals filled below
        whole = out.text
        try:
            chars = self._walk(msgs, steps, whole, digests)
        except (_Mismatch, TemplateRejected):
            return self._exact(msgs, steps, out, digests)
        return self._tokens(msgs, steps, out, chars, linear=True)

    def rendering(
        self, msgs: list[dict], *, digests: Digests | None = None, known: Placement | None = None
    ) -> Placement:
        """The whole conversation rendered and tokenized with offsets, no step placed: the
        rendering :meth:`place` places the steps in, and the only part of it that raises
        :class:`TemplateRejected`. ``known``: one made earlier, whose ids and offsets are taken
        where its text is this render's (they are the tokenization of that text)."""
        whole = self._render(msgs, digests=digests)
        if known is not None and known.text == whole:
            return Placement(whole, known.ids, known.offsets)
        return Placement(whole, *self.locator.offsets(whole))

    def place_exact(self, msgs: list[dict], steps: Steps) -> Placement:
        """Step by step: the whole conversation rendered again with each step's turn empty."""
        whole = self._render(msgs)
        return self._exact(msgs, steps, Placement(whole, *self.locator.offsets(whole)), None)

    # -- the linear walk

    def _walk(
        self, msgs: list[dict], steps: Steps, whole: str, digests: Digests | None
    ) -> dict[int, tuple[int, int] | str]:
        emptied = set()
        chars: dict[int, tuple[int, int] | str] = {}
        for index, m in steps:
            problem = _check_step(msgs, m)
            if problem:
                chars[index] = problem
            else:
                emptied.add(m)
        emptied_msgs, emptied_digests = pick(msgs, digests, (None if i in emptied else i for i in range(len(msgs))))
        skeleton = self._render(emptied_msgs, digests=emptied_digests)
        users = UserTurns(msgs)
        empties: dict[tuple[int | None, int | None], str] = {}
        pw = pk = 0  # positions in whole / skeleton; everything before them is accounted for
        for index, m in steps:
            if index in chars:
                continue
            before, after = users.context(m)
            window, window_digests = pick(msgs, digests, (*before, m, *after))
            local = self._render(window, digests=window_digests)
            key = users.key(m)  # turns between the same user messages share their empty rendering
            if key not in empties:
                window, window_digests = pick(msgs, digests, (*before, None, *after))
                empties[key] = self._render(window, digests=window_digests)
            local_empty = empties[key]
            cs, ce = own_chars(local, local_empty, msgs[m])
            own = local[cs:ce]
            if not own:  # renders as an empty turn does: W and K agree over it (checked next)
                chars[index] = (cs, cs)  # the same refusal as step by step: no own tokens
                continue
            a = whole.find(own, pw)
            if a < 0:
                raise _Mismatch(f"step {index}: its own text is not in the whole rendering")
            ka = pk + (a - pw)
            if whole[pw:a] != skeleton[pk:ka]:
                raise _Mismatch(f"step {index}: the text before it differs from the skeleton")
            end = a + len(own)
            kend = _resync(whole, end, skeleton, ka, len(local_empty))
            if kend is None:
                raise _Mismatch(f"step {index}: the text after it is not in the skeleton")
            chars[index] = (a, end)
            pw, pk = end, kend
        if whole[pw:] != skeleton[pk:]:
            raise _Mismatch("the text after the last step differs from the skeleton")
        return chars

    # -- step by step (the reference rule; the fallback)

    def _exact(self, msgs: list[dict], steps: Steps, out: Placement, digests: Digests | None) -> Placement:
        chars: dict[int, tuple[int, int] | str] = {}
        for index, m in steps:
            problem = _check_step(msgs, m)
            if problem:
                chars[index] = problem
                continue
            try:
                emptied, emptied_digests = pick(msgs, digests, (None if i == m else i for i in range(len(msgs))))
                empty = self._render(emptied, digests=emptied_digests)
            except TemplateRejected as exc:
                chars[index] = f"template: the template cannot render this turn empty ({exc})"
                continue
            chars[index] = own_chars(out.text, empty, msgs[m])
        return self._tokens(msgs, steps, out, chars, linear=False)

    def _tokens(
        self, msgs: list[dict], steps: Steps, out: Placement, chars: dict[int, tuple[int, int] | str], *, linear: bool
    ) -> Placement:
        """``out`` (the whole rendering, its ids and offsets) with each step's span or refusal."""
        whole, ids, offsets = out.text, out.ids, out.offsets
        out.linear = linear
        search_from = 0
        for index, m in steps:
            where = chars[index]
            if isinstance(where, str):
                out.refused[index] = where
                continue
            try:
                span = self.locator.token_span(
                    whole,
                    *where,
                    msgs[m],
                    ids,
                    offsets,
                    search_from=search_from,
                    reasoning_required=self.reasoning_required,
                )
                self.locator.check_decodes(whole, ids, offsets, span)
            except NotOwn as exc:
                out.refused[index] = exc.reason
                continue
            out.spans[index] = span
            search_from = span.start
        return out


class _Places(Protocol):
    def place(self, msgs: list[dict], steps: Steps) -> Placement: ...


def place_with_fallback(
    placer: _Places, msgs: list[dict], steps: Steps, flatten: Callable[[], list[dict]]
) -> tuple[Placement, list[dict], bool]:
    """``placer.place`` on the messages, else on ``flatten()`` (tool traffic as text) when the
    template rejects them; (placement, the messages placed, flattened). Raises
    TemplateRejected when both fail."""
    try:
        return placer.place(msgs, steps), msgs, False
    except TemplateRejected:
        flat = flatten()
        return placer.place(flat, steps), flat, True


def place_by_rule(tokenizer: Any, msgs: list[dict], steps: Steps, *, reasoning_required: bool = True) -> Placement:
    """The placement rule, stated plainly and slowly: the reference :meth:`Placer.place` must equal.

    The whole conversation rendered once by ``tokenizer.apply_chat_template`` and tokenized
    once with offsets. For each step ``(index, m)``: the conversation rendered again with turn
    ``m`` empty; the step's own characters are where the two differ (widened back over an
    opening ``<think>``: :func:`own_chars`); its tokens are every token overlapping them, plus
    the special token that starts right where they end (the end of turn). Refused, with a
    reason, when the own text misses a piece of the message or is empty, or the tokens do
    not decode to exactly the text they cover. Quadratic in the episode; tests only."""
    whole = tokenizer.apply_chat_template(msgs, tokenize=False)
    enc = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    specials = {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
    added = [t.content for t in tokenizer.added_tokens_decoder.values()]
    out = Placement(whole, ids, offsets, linear=False)
    for index, m in steps:
        problem = _check_step(msgs, m)
        if problem:
            out.refused[index] = problem
            continue
        try:
            empty = tokenizer.apply_chat_template([*msgs[:m], EMPTY_TURN, *msgs[m + 1 :]], tokenize=False)
        except Exception as exc:  # the template's own refusal (raise_exception): this step only
            out.refused[index] = f"template: the template cannot render this turn empty ({exc})"
            continue
        cs, ce = own_chars(whole, empty, msgs[m])
        # An added token is whole or not at all: a diff edge inside one (the shared "<" of an
        # empty turn's "<|im_end|>" and the own text's "<think>") moves to the token's start.
        cs, ce = _token_start(whole, cs, added), _token_start(whole, ce, added)
        if ce <= cs:
            out.refused[index] = "empty_action: the action renders to no tokens of its own"
            continue
        if any(p not in whole[cs:ce] for p in own_pieces(msgs[m], reasoning=reasoning_required)):
            out.refused[index] = "rendering: the whole conversation leaves out part of this step's own text"
            continue
        covering = [i for i, (a, b) in enumerate(offsets) if a < ce and b > cs]
        if not covering:
            out.refused[index] = "alignment: no token covers the action's own characters"
            continue
        start, end = covering[0], covering[-1] + 1
        eot = end < len(ids) and ids[end] in specials and offsets[end][0] == ce
        end += eot
        if tokenizer.decode(ids[start:end]) != whole[offsets[start][0] : offsets[end - 1][1]]:
            out.refused[index] = "alignment: the span's tokens do not decode to the text they cover"
            continue
        out.spans[index] = OwnSpan(start, end, cs, ce, eot)
    return out


def _token_start(text: str, at: int, tokens: list[str]) -> int:
    """``at``, or the start of the added token whose text ``at`` falls strictly inside."""
    for token in tokens:
        for k in range(1, len(token)):
            if at - k >= 0 and text.startswith(token, at - k):
                return at - k
    return at
