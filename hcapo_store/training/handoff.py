"""A credit run's per-step advantages placed on the token ids a trainer holds.

    from hcapo_store.training.handoff import Handoff
    handoff = Handoff(store, "default", tokenizer="/models/Qwen3-8B")
    credit = handoff.advantages("pg-01/episode_001", token_ids)   # one float per trainer token
    credit = handoff.advantages("3-1", token_ids)   # the collector's own id (JSONL episode_id, Pi session id)

The trainer tokenized the conversation its own way; the store knows, per step, the policy's
own tokens (``rendering/alignment.py``: its reasoning, text, tool calls and end-of-turn token,
never a header or a wrapper the template inserts). If the trainer's ids are one of the two
renderings the tokenized export writes (``turns`` or ``whole``), the spans are those. Otherwise
each step's own tokens are looked up in order in the trainer's ids, right after the same
header tokens the rendering puts before them; a step whose tokens are not there exactly is
refused with a ``HandoffError`` naming it — never moved to a near match. Where several steps
have the same tokens (``ls`` run twice), a place goes to the step whose history agrees with
more of the ids before it (a window of the last turns holds the last steps), and when the ids
cannot tell the steps apart none of them is placed: one step's advantage never lands on
another's tokens.

``run``: a credit run's name, a published batch (``BatchInfo``) or a batch id (``int``): the
batch's own credit run.

A run whose hindsight term is zero on every step while its advantages are not (the group term
alone: plain GRPO, e.g. outcome-only rollouts credited with dense returns) is refused unless the
caller opts into plain GRPO by name (``allow_zero_hindsight=True``); ``signal`` says how much of
the run carries the hindsight term (``credits/signal.py``).

A run that no longer matches the store is refused unless the caller allows it
(``allow_stale=True``): a ``follow`` batch's run that a newer batch of the same key replaced
(the message names that batch and its run), or a run with superseded or missing episodes.

A stored advantage that is NaN, inf or beyond float32's range (finite in float64, inf once
cast) is refused naming its step, never passed on.

Which advantage: the run's stored one (``step_credits.advantage``): the Eq. 8 weight for an
``original`` run over its training selection (episodes under its ``min_reward`` get zeros and
``selected=False``), the signed advantage for a ``paper`` run; for a ``log-ratio`` run
(docs/FAMILY.md) each token's own stored advantage, placed only where the run's scorers scored
exactly the step's own tokens (else the step is refused with the reason, never shifted).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import bindparam, text

from hcapo_store.credits.log_ratio import VARIANT as LOG_RATIO
from hcapo_store.credits.lookup import RunInfo
from hcapo_store.credits.run_side import RunSide, no_credit_run, read_run_side, with_tokenizer
from hcapo_store.credits.signal import OPT_IN, CreditSignal
from hcapo_store.errors import EpisodeLookupError, HandoffError
from hcapo_store.online.batches import BatchInfo
from hcapo_store.rendering.alignment import Alignment, EpisodeRenderer, span_mismatch
from hcapo_store.rendering.placement import Placement
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_messages_of
from hcapo_store.storage.store import Store
from hcapo_store.storage.token_values import step_backbones, step_token_advantages

CONTEXT_TOKENS = 3  # header tokens that must precede a step's tokens in the trainer's ids


@dataclass
class TokenCredit:
    """One episode's advantages on a trainer's ids."""

    episode: str
    advantages: np.ndarray  # float32, len(token_ids); 0 outside the steps' own tokens
    mask: np.ndarray  # bool: the steps' own tokens (what a trainer should train on)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # step_index -> [start, end)
    step_advantages: dict[int, float] = field(default_factory=dict)
    selected: bool = True  # False: the run leaves the episode out of training (zeros)
    how: str = "turns"  # "turns" / "whole" (the ids are that rendering) or "search"
    refused: dict[int, str] = field(default_factory=dict)  # strict=False: steps left at 0, and why
    # step_index -> the value of a wrapper the policy wrote before the step's own tokens
    # (``with_lead_in``): the step's advantage; a log-ratio run's A_i (no d_t was scored there)
    lead_in: dict[int, float] = field(default_factory=dict)


class Handoff:
    """Per-token advantages of one credit run, on the token ids of a trainer.

    ``tokenizer``: the directory of the tokenizer the run's scorer used (checked against the
    scorer's fingerprint, as the tokenized export does). ``loaded_tokenizer``: the tokenizer
    already loaded from that directory (a trainer keeps one across its steps), checked the same
    way instead of being loaded again (read, never changed). ``allow_stale``: take a superseded
    batch's run or a stale run anyway (the reason stays in ``warnings``); by default it is
    refused with a ``HandoffError`` naming what replaced it."""

    def __init__(
        self,
        store: Store,
        run: str | int | BatchInfo | None = None,
        *,
        tokenizer: str | Path,
        allow_stale: bool = False,
        allow_zero_hindsight: bool = False,
        loaded_tokenizer: Any = None,
    ) -> None:
        self.store = store
        self.tokenizer_dir = tokenizer
        self._open(read_run_side(store, _run_arg(run), credited=True), allow_stale, allow_zero_hindsight)
        # loaded (or the given one checked) once the run is not refused
        self._take_tokenizer(with_tokenizer(self.side, tokenizer, loaded=loaded_tokenizer))

    def for_run(
        self, run: str | int | BatchInfo, *, allow_stale: bool = False, allow_zero_hindsight: bool = False
    ) -> Handoff:
        """The hand-off of another run of this store. When its scorer is this run's, the
        tokenizer loaded and checked for this one is shared (a trainer takes one run per GRPO
        group each step: loading it once per run cost more than placing the group)."""
        other = object.__new__(Handoff)
        other.store, other.tokenizer_dir = self.store, self.tokenizer_dir
        other._open(read_run_side(self.store, _run_arg(run), credited=True), allow_stale, allow_zero_hindsight)
        other._take_tokenizer(with_tokenizer(other.side, self.tokenizer_dir, like=self.side), self)
        return other

    def _open(self, side: RunSide, allow_stale: bool, allow_zero: bool) -> None:
        """Take the run side read for this run (``credits/run_side.py``): refused when stale or
        replaced unless ``allow_stale``, without its hindsight term unless ``allow_zero`` (what
        was allowed stays in ``warnings``)."""
        self.side = side
        self.run: RunInfo = side.run
        self.warnings: list[str] = [w for w in (side.replaced, side.run.stale) if w]
        if self.warnings and not allow_stale:
            raise HandoffError(f"{self.warnings[0]}; or pass allow_stale=True to train on it anyway")
        # whether HCAPO's hindsight term is in the advantages (None: a run without stored advantages)
        self.signal: CreditSignal | None = side.run.credit_signal
        if self.signal is not None and self.signal.plain_grpo:
            if not allow_zero:
                raise HandoffError(self.signal.refusal(f"credit run {self.run.name!r}"))
            self.warnings.append(f"credit run {self.run.name!r}: {self.signal.text()} ({OPT_IN}=True)")
        self.warnings.extend(side.weight_warnings)
        rw = side.weights
        self._names = {e.id: e.name for e in side.credited}
        # the collector's ids (JSONL episode_id, Pi session id)
        self._external = {e.id: e.external_id for e in side.credited if e.external_id is not None}
        self._weights = {int(ep["id"]): (ep, w) for ep, w in zip(rw.episodes, rw.weights)}
        # per episode: its messages, its credited (step_index, message_index), its alignments by rendering
        self._episodes: dict[int, tuple[list[dict[str, Any]], list[tuple[int, int]], dict[str, Alignment]]] = {}
        # per episode until its steps are placed in it: its ``whole`` rendering alone
        # (EpisodeRenderer.whole_rendering), for rows compared by ids
        self._whole: dict[int, Placement | None] = {}

    def _take_tokenizer(self, side: RunSide, shared: Handoff | None = None) -> None:
        """The run side with its scorer's tokenizer, loaded and checked once it is not refused;
        ``shared``'s renderer when it is that hand-off's tokenizer."""
        self.side = side
        self.tokenizer, self.fingerprint = side.tokenizer, side.fingerprint
        self.renderer: EpisodeRenderer = (
            shared.renderer
            if shared is not None and shared.tokenizer is side.tokenizer
            else EpisodeRenderer(side.tokenizer)
        )

    def _token_values(self, ep_id: int) -> tuple[dict[int, np.ndarray], dict[int, float]] | None:
        """A log-ratio run's per-token advantages and A_i by step index (None: a run of one
        value per step)."""
        if self.run.variant != LOG_RATIO:
            return None
        with db.read(self.store.engine) as conn:
            return step_token_advantages(conn, self.run.id, ep_id), step_backbones(conn, self.run.id, ep_id)

    def rendered_ids(self, episode: str | int, rendering: str = "turns") -> list[int]:
        """The ids of the episode's ``turns`` (as a multi-turn trainer accumulates them) or
        ``whole`` rendering: what ``advantages`` places exactly, without a search."""
        ep_id = self.episode_id(episode)
        if rendering == "whole":  # the rendering alone, until a step is placed in it
            messages, _, done = self._episode(ep_id)
            if "whole" not in done:
                if ep_id not in self._whole:
                    self._whole[ep_id] = self.renderer.whole_rendering(messages)
                known = self._whole[ep_id]
                if known is not None:
                    return known.ids
        return self._alignment(ep_id, rendering).input_ids

    # ---- lookup --------------------------------------------------------------------------------
    def episode_id(self, episode: str | int) -> int:
        """The run's episode meant by ``episode``: its store name, its row id, the id the
        collector wrote (the JSONL ``episode_id``, the Pi session id), or a unique name ending."""
        if isinstance(episode, (int, np.integer)) and int(episode) in self._names:
            return int(episode)
        value = str(episode)
        exact = [i for i, n in self._names.items() if n == value]
        if not exact and value.isdigit() and int(value) in self._names:
            exact = [int(value)]
        if not exact:
            exact = [i for i, x in self._external.items() if x == value]
        if not exact:
            exact = [i for i, n in self._names.items() if n.endswith("/" + value)]
        if len(exact) == 1:
            return exact[0]
        if exact:
            names = ", ".join(sorted(self._names[i] for i in exact)[:5])
            raise EpisodeLookupError(f"episode {value!r} is ambiguous in credit run {self.run.name!r}: {names}")
        raise EpisodeLookupError(
            f"credit run {self.run.name!r} has no episode {value!r} ({len(self._names)} credited episode(s); "
            "`hcapo-store credits show RUN` lists them)"
        )

    def _episode(self, ep_id: int) -> tuple[list[dict[str, Any]], list[tuple[int, int]], dict[str, Alignment]]:
        if ep_id not in self._episodes:
            self._read([ep_id])
        return self._episodes[ep_id]

    def prefetch(self, episodes: Iterable[int]) -> None:
        """Read these episodes' messages and credited steps now, in one query each (episode row
        ids; those the run does not credit, or read already, are skipped): what a trainer's
        hand-off does for a whole group before it matches the group's rows."""
        wanted = sorted({int(e) for e in episodes if int(e) in self._names} - set(self._episodes))
        if wanted:
            self._read(wanted)

    def _read(self, wanted: list[int]) -> None:
        with db.read(self.store.engine) as conn:
            messages = load_messages_of(conn, wanted)
            rows = conn.execute(
                text(
                    "SELECT s.episode_id, s.step_index, s.message_index FROM credits c JOIN steps s ON s.id = c.step_id "
                    "WHERE c.run_id = :run AND s.episode_id IN :eps ORDER BY s.episode_id, s.step_index"
                ).bindparams(bindparam("eps", expanding=True)),
                {"run": self.run.id, "eps": wanted},
            ).all()
        steps: dict[int, list[tuple[int, int]]] = {e: [] for e in wanted}
        for ep, index, message in rows:
            steps[int(ep)].append((int(index), int(message)))
        for e in wanted:
            self._episodes[e] = (messages[e], steps[e], {})

    def _alignment(self, ep_id: int, rendering: str) -> Alignment:
        messages, steps, done = self._episode(ep_id)
        if rendering not in done:
            known = self._whole.pop(ep_id, None) if rendering == "whole" else None
            done[rendering] = self.renderer.align(messages, steps, rendering, known=known)
        return done[rendering]

    # ---- placing -------------------------------------------------------------------------------
    def spans(
        self, episode: str | int, token_ids: Sequence[int], *, strict: bool = True
    ) -> tuple[dict[int, tuple[int, int]], str, dict[int, str]]:
        """Where each credited step's own tokens are in ``token_ids``, how they were found, and
        (``strict=False``) the steps that are not there with the reason; ``strict`` raises."""
        ep_id = self.episode_id(episode)
        ids = [int(t) for t in token_ids]
        for rendering in ("turns", "whole"):
            al = self._alignment(ep_id, rendering)
            if al.input_ids == ids:
                if al.refused and strict:
                    index, why = sorted(al.refused.items())[0]
                    raise HandoffError(f"episode {self._names[ep_id]}: step {index} cannot be placed: {why}")
                return dict(al.spans), rendering, dict(al.refused)
        refused: dict[int, str] = {}
        return self._search(ep_id, ids, None if strict else refused), "search", refused

    def _search(self, ep_id: int, ids: list[int], refused: dict[int, str] | None) -> dict[int, tuple[int, int]]:
        name = self._names[ep_id]
        turns, whole = self._alignment(ep_id, "turns"), self._alignment(ep_id, "whole")
        order = [index for index, _ in self._episode(ep_id)[1]]
        rank = {index: k for k, index in enumerate(order)}
        alike: dict[tuple[int, ...], set[int]] = {}  # own tokens -> the steps that have them
        for al in (turns, whole):
            for index, (a, b) in al.spans.items():
                alike.setdefault(tuple(al.input_ids[a:b]), set()).add(index)
        spans: dict[int, tuple[int, int]] = {}
        contested: dict[int, tuple[int, int]] = {}  # a later step -> (start, the step it ties with there)
        pos = 0
        for k, index in enumerate(order):
            found, where = None, None
            for al in (turns, whole):  # the earlier place of the two renderings' (turns' on a tie)
                place = _find_after(ids, *_pattern(al, index), pos) if index in al.spans else None
                if place is not None and (found is None or place[0] < found[0]):
                    found, where = place, al
            problem = None
            if found is not None and where is not None:
                tie = contested.get(index)
                if tie is not None and tie[0] == found[0]:
                    problem = _tied(found[0], tie[1])
                else:
                    same = alike[tuple(ids[found[0] : found[1]])]
                    later = sorted((j for j in same if rank[j] > k), key=rank.__getitem__)
                    problem = self._rivalry(ids, found, index, where, later, (turns, whole), contested)
            if found is None or problem is not None:
                why = turns.refused.get(index) or whole.refused.get(index)
                text_ = (
                    self.tokenizer.decode(turns.input_ids[slice(*turns.spans[index])]) if index in turns.spans else ""
                )
                shown = repr(text_[:60] + ("…" if len(text_) > 60 else "")) if text_ else ""
                missing = (
                    f"own tokens {shown} {problem}"
                    if problem
                    else f"own tokens {shown} are not in the given ids after position {pos}"
                    + (f" ({why})" if why else self._header_hint(ids, index, (turns, whole), pos))
                )
                if refused is None:
                    raise HandoffError(
                        f"episode {name}: step {index}'s {missing}: tokenize the conversation with the "
                        "scorer's tokenizer and chat template"
                    )
                refused[index] = f"its {missing}"
                continue
            assert found is not None
            spans[index] = found
            pos = found[1]
        return spans

    def _header_hint(self, ids: list[int], index: int, alignments: tuple[Alignment, ...], pos: int) -> str:
        """Why a step's own tokens that are in the ids were not taken: not after the header the
        chat template renders before them ("" when they are not in the ids at all)."""
        for al in alignments:
            if index not in al.spans:
                continue
            own, before = _pattern(al, index)
            bare = _find_after(ids, own, [], pos)
            if bare is not None and before:
                header = self.tokenizer.decode(before)
                return (
                    f" (they are at position {bare[0]}, but not after the {header!r} the chat template "
                    "writes before them: the rollout began that turn otherwise; with Qwen3 and thinking on, a "
                    "policy that wrote no think block: the template's empty one is in that header)"
                )
        return ""

    @staticmethod
    def _rivalry(
        ids: list[int],
        found: tuple[int, int],
        index: int,
        where: Alignment,
        later: list[int],
        alignments: tuple[Alignment, Alignment],
        contested: dict[int, tuple[int, int]],
    ) -> str | None:
        """Why the tokens found at ``found`` for step ``index`` are not that step's, or None.

        ``later``: the later steps with the same own tokens (an agent that runs ``ls`` twice).
        Those whose header matches there too are rivals for these tokens. The step whose
        rendering agrees with more of the ids before them has them (all of its history there
        beats any part): ids holding the last turns only are a later step's. When the best agree
        equally and the ids hold fewer such places than such steps, nothing tells which step
        these are: this one is refused and so are its rivals here, never guessed; with a place
        for every one of them, they are taken in order."""
        if not later:  # no other step has these tokens: nothing to weigh (the common case, every step)
            return None
        start, end = found
        mine = _agreement(ids, start, where.input_ids, where.spans[index][0])
        tied = []
        for j in later:
            theirs = -1.0  # compared with ``mine`` only: a stuck agent's hundred equal turns stay linear
            for al in alignments:
                if j not in al.spans:
                    continue
                own, before = _pattern(al, j)
                if ids[start:end] == own and _header_fits(ids, start, before):
                    theirs = max(theirs, _against(ids, start, al.input_ids, al.spans[j][0], mine))
            if theirs > mine:
                return (
                    f"at position {start} are step {j}'s (the same tokens, the ids before them are step {j}'s context)"
                )
            if theirs == mine:
                tied.append(j)
        if not tied:
            return None
        own, before = _pattern(where, index)
        places, at = 0, start
        while (place := _find_after(ids, own, before, at)) is not None:
            places, at = places + 1, place[1]
        if places >= 1 + len(later):
            return None  # a place for every step with these tokens: in order, the first is this one's
        for j in tied:
            contested[j] = (start, index)
        return _tied(start, tied[0])

    def advantages(self, episode: str | int, token_ids: Sequence[int], *, strict: bool = True) -> TokenCredit:
        """One float per token of ``token_ids``: each step's advantage on its own tokens.

        ``strict`` (default): a step whose own tokens are not in the ids raises a
        ``HandoffError`` naming it. ``strict=False``: that step stays at 0 and is listed in
        ``refused`` with the reason (e.g. Qwen3's whole-conversation rendering drops the
        reasoning of earlier turns: those steps' own tokens are not in it)."""
        ep_id = self.episode_id(episode)
        spans, how, refused = self.spans(ep_id, token_ids, strict=strict)
        adv = np.zeros(len(token_ids), dtype=np.float32)
        mask = np.zeros(len(token_ids), dtype=bool)
        selected = ep_id in self._weights
        step_adv: dict[int, float] = {}
        if selected:
            ep, weights = self._weights[ep_id]
            step_adv = {int(i): float(w) for i, w in zip(ep["step_indices"], weights)}
        token_values = self._token_values(ep_id)  # a log-ratio run's per-token advantages and A_i, else None
        per_token, backbone = token_values if token_values is not None else (None, {})
        lead_in: dict[int, float] = {}
        for index, (a, b) in list(spans.items()):
            value = step_adv.get(index, 0.0)
            why = float32_problem(value)
            if why:  # a NaN or inf never reaches a trainer, placed or not
                raise HandoffError(
                    f"episode {self._names[ep_id]}: step {index}'s stored advantage {why}: "
                    f"recompute credit run {self.run.name!r} (`hcapo-store credits compute --recompute`)"
                )
            values = None if per_token is None or not selected else per_token.get(index)
            why = None if values is None else span_mismatch(values, a, b)
            if why is not None:
                if strict:
                    raise HandoffError(f"episode {self._names[ep_id]}: step {index} cannot be placed: {why}")
                refused[index] = why
                del spans[index]
                continue
            adv[a:b] = value if values is None else values
            mask[a:b] = True
            if selected:
                lead_in[index] = float(np.float32(value if values is None else backbone.get(index, 0.0)))
        return TokenCredit(self._names[ep_id], adv, mask, spans, step_adv, selected, how, refused, lead_in)


# trained tokens next to a step that its own tokens leave out: the template's glue (a newline
# after the end-of-turn token) or a wrapper it also writes (Qwen3's empty think block, 4 tokens),
# which a policy with thinking on generates itself; a longer stretch of trained tokens that no
# step holds is not glue (a turn, a tool result)
GLUE_TOKENS = 4


def with_lead_in(credit: TokenCredit, trained: np.ndarray, start: int) -> np.ndarray:
    """``credit.advantages[start:]`` (the part of a trainer's row it generated), each step's
    advantage also on the trained tokens just before its own tokens that no step holds: what
    the policy wrote in that turn before its own text, at most GLUE_TOKENS of them, back to an
    untrained token, another step's tokens or ``start``. With Qwen3 and thinking on, a policy
    that thinks nothing writes ``<think>\n\n</think>\n\n`` itself; the store's rendering has
    the template write it, so it is no step's own, and the trainer would train it at 0.
    ``trained``: the loss mask over ``[start, len(ids))``. A stretch longer than GLUE_TOKENS
    stays at 0 (not a wrapper). The value is ``credit.lead_in``'s: a log-ratio run's wrapper
    gets the step's A_i alone (neither scorer scored it: it has no d_t)."""
    values = credit.advantages[start:].astype(np.float64)
    loose = np.asarray(trained, dtype=bool) & ~credit.mask[start:]
    for index, (a, _) in credit.spans.items():
        a = k = a - start
        while k > 0 and loose[k - 1] and a - k <= GLUE_TOKENS:  # back over the stretch, one past the bound
            k -= 1
        value = credit.lead_in.get(index)
        if 0 < a - k <= GLUE_TOKENS and value is not None:  # longer: not a wrapper of this step's turn
            values[k:a] = value
    return values


def float32_problem(value: float) -> str | None:
    """Why ``value`` cannot reach a trainer as float32 (NaN, inf, or beyond float32's range,
    which the cast turns into inf), or None. Checked after the cast: a float64 1e39 is finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        cast = np.float32(value)
    if np.isfinite(cast):
        return None
    if np.isfinite(value):
        return f"is {float(value)!r}, beyond float32's range (±{float(np.finfo(np.float32).max):.4g}): refused, never passed on as inf"
    return f"is {value}: refused, never passed on"


def _run_arg(run: str | int | BatchInfo | None) -> str | int | None:
    """The credit run meant by ``run`` as ``read_run_side`` takes it: a run name (or None: the
    only run) or a batch id (``int``: the ``batches`` row ``hcapo-store batches`` lists); a
    published batch (a ``BatchInfo``) by its credit run, refused by name when it has none
    (every member failed)."""
    if run is None or isinstance(run, str):
        return run
    if isinstance(run, BatchInfo):
        if not run.credit_run:
            raise no_credit_run(run.id, run.key, run.status)
        return str(run.credit_run)
    if isinstance(run, (int, np.integer)) and not isinstance(run, bool):
        return int(run)
    raise HandoffError(f"run must be a credit run name, a BatchInfo or a batch id, got {type(run).__name__}")


def _pattern(al: Alignment, index: int) -> tuple[list[int], list[int]]:
    """A step's own tokens in a rendering and the header tokens before them."""
    a, b = al.spans[index]
    return al.input_ids[a:b], al.input_ids[max(0, a - CONTEXT_TOKENS) : a]


def _agreement(ids: list[int], start: int, rendered: list[int], a: int) -> float:
    """How many tokens before ``start`` in ``ids`` equal those before ``a`` in ``rendered``;
    infinite when that is all of the rendering's (the step's whole history is in the ids).
    A binary search over slice comparisons (equal suffixes of length k are equal below k)."""
    lo, hi = 0, min(start, a)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ids[start - mid : start] == rendered[a - mid : a]:
            lo = mid
        else:
            hi = mid - 1
    return math.inf if lo == a else float(lo)


def _against(ids: list[int], start: int, rendered: list[int], a: int, other: float) -> float:
    """``_agreement`` where it is ``other`` or more, else -1 (below ``other``): at most three
    slice comparisons."""
    if a <= start and ids[start - a : start] == rendered[:a]:
        return math.inf
    if other == math.inf:
        return -1.0
    k = int(other)
    if k > min(start, a) or ids[start - k : start] != rendered[a - k : a]:
        return -1.0
    return float(k + 1) if k + 1 <= min(start, a) and ids[start - k - 1] == rendered[a - k - 1] else other


def _header_fits(ids: list[int], start: int, before: list[int]) -> bool:
    """Whether ``before`` precedes ``start`` (as much of it as fits before the start of ``ids``)."""
    k = min(len(before), start)
    return ids[start - k : start] == before[len(before) - k :]


def _tied(start: int, other: int) -> str:
    return (
        f"at position {start} are also step {other}'s (the same tokens and context as far as the ids go back): "
        "the ids do not tell which step they are"
    )


def _find_after(ids: list[int], own: list[int], before: list[int], pos: int) -> tuple[int, int] | None:
    """The first occurrence of ``own`` at or after ``pos`` that ``before`` precedes (as much of
    it as fits before the start of ``ids``)."""
    if not own:
        return None
    n, first = len(own), own[0]
    for start in range(pos, len(ids) - n + 1):
        if ids[start] != first or ids[start : start + n] != own:
            continue
        k = min(len(before), start)
        if k and ids[start - k : start] != before[len(before) - k :]:
            continue
        return start, start + n
    return None
