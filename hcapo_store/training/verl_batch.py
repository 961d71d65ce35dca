"""A verl batch's per-token advantages from the store, found by each sample's own token ids.

No verl import here (``training/verl.py`` plugs this into verl): plain ids and numpy.

How the rollouts get there: the agent loop writes each finished rollout as one JSONL line
(``episode_id``, ``uid``, ``reward``, ``messages``) under a folder the store follows,
``hcapo-store follow ROLLOUTS --batch-by field:uid --group-size N`` (N: verl's
``rollout.n``). Every GRPO group is then a published batch keyed by its uid, scored
against the same server the rollouts came from, with its own credit run (the group's own
statistics: the paper's per-group advantage).

How a sample finds its advantages (``VerlHandoff.advantages``):

1. its ``uid`` names its group's batch (waited for, ``wait_for_batch``; a uid the store has
   never seen is refused once the wait is over);
2. the batch must be the current one of its key (a superseded one is never returned), have
   a credit run, and be scored under the weight version this step trains (``weight_version``;
   without one, every batch of a step must share one version);
3. within the group, the sample is the member whose rendering its ids are: prompt + response
   equal to (or containing, header tokens included) every credited step's own tokens. The uid
   alone never picks a member; two members that both fit must carry the same advantages;
4. each step's advantage lands on that step's own tokens in the response; every such token
   must be one the response mask trains (tool results are not actions); 0 elsewhere.

Every refusal names the sample (its row in the batch and its uid) and, where there is one,
the step; nothing is zeroed in silence, and no NaN or inf is returned.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hcapo_store.credits.signal import CreditSignal
from hcapo_store.errors import BatchNotReady, EpisodeLookupError, HandoffError
from hcapo_store.online.batches import BatchInfo, BatchMember, list_batches, wait_for_batch
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import GLUE_TOKENS, Handoff, TokenCredit, float32_problem, with_lead_in


def write_rollout(
    root: str | Path,
    step: int,
    uid: str,
    episode_id: str,
    reward: float,
    messages: list[dict[str, Any]],
    **fields: Any,
) -> Path:
    """What the agent loop calls once per finished rollout: one JSONL line in
    ``root/step_NNNN/<uid>.jsonl`` (``episode_id``, ``uid``, ``reward``, ``messages`` and any
    ``fields``), written whole in one ``write`` so ``follow`` never reads half a line."""
    if not uid or "/" in uid or uid.startswith("."):
        raise HandoffError(f"uid {uid!r} cannot name a rollout file: give each GRPO group a plain id")
    path = Path(root) / f"step_{step:04d}" / f"{uid}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"episode_id": episode_id, "uid": uid, "reward": reward, "messages": messages, **fields}
    data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return path


@dataclass
class SampleCredit:
    """Where one verl sample's advantages came from."""

    row: int
    uid: str
    batch: int  # the ``batches`` row id of its group
    credit_run: str  # that batch's credit run
    episode: str  # the store's name of the member it is
    external_id: str | None  # the collector's id of that member
    weight_version: str | None
    steps: int  # steps placed in its ids
    how: str  # "turns" / "whole": the ids are that rendering of the member; "search": found in them

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _unexplained(own: np.ndarray, valid: np.ndarray) -> tuple[int, int] | None:
    """The first stretch [a, b) of trained response tokens (``valid``) outside the steps' own
    tokens (``own``) that is not glue: longer than GLUE_TOKENS, or touching no step. None: the
    steps explain the response (a sample with a policy turn the member lacks is not that member)."""
    loose = valid.astype(bool) & ~own.astype(bool)
    if not loose.any():
        return None
    edges = np.flatnonzero(np.diff(np.concatenate(([0], loose.view(np.int8), [0]))))
    for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
        touches = (a > 0 and own[a - 1]) or (b < len(own) and own[b])
        if b - a > GLUE_TOKENS or not touches:
            return a, b
    return None


def _failed_members(info: BatchInfo) -> str:
    """The first members a batch could not credit, with why ("" when none)."""
    return "; ".join(f"{f.name}: {f.reason}" for f in info.failed_episodes[:3])


class VerlBatchError(HandoffError):
    """Samples of a verl batch whose advantages cannot be given; one line per sample."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        more = f" (+{len(problems) - 1} more: {'; '.join(problems[1:4])}{' …' if len(problems) > 4 else ''})"
        super().__init__(problems[0] + (more if len(problems) > 1 else ""))


class VerlHandoff:
    """The store's advantages for verl batches, one group (uid) at a time.

    ``tokenizer``: the scorer's tokenizer directory (the policy's). ``weight_version``: the
    version the step's rollouts were generated by (a string, or a callable returning it);
    ``wait``: seconds to wait for a group's batch to be published (0: only what is there);
    ``allow_stale``: take superseded or stale runs anyway (refused by default). ``exact``: a
    sample's ids must be one of the member's renderings token for token (tool results and
    headers included); by default a sample whose ids differ from both is still taken when
    every step's own tokens are found in it after their header tokens (``how="search"``).
    ``allow_zero_hindsight``: take a group whose run has no hindsight term on any step while its
    advantages are not zero (plain GRPO; refused by default, ``Handoff``)."""

    def __init__(
        self,
        store: Store,
        tokenizer: str | Path,
        *,
        weight_version: str | Callable[[], str | None] | None = None,
        wait: float = 0.0,
        poll: float = 0.2,
        allow_stale: bool = False,
        exact: bool = False,
        allow_zero_hindsight: bool = False,
    ) -> None:
        self.store = store
        self.allow_zero_hindsight = allow_zero_hindsight
        self.exact = exact
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.wait = wait
        self.poll = poll
        self.allow_stale = allow_stale
        self._handoffs: dict[str, Handoff] = {}  # credit run name -> its hand-off (renderings cached)
        self._base: Handoff | None = None  # the first hand-off: its tokenizer is shared with the others
        self.last: list[SampleCredit] = []  # the samples of the last call, for logs and tests
        self.signals: dict[str, CreditSignal] = {}  # credit run -> its hindsight signal, of the last call

    def _expected_version(self) -> str | None:
        v = self.weight_version() if callable(self.weight_version) else self.weight_version
        return None if v is None else str(v)

    def _handoff(self, run: str) -> Handoff:
        if run not in self._handoffs:
            zero = self.allow_zero_hindsight
            if self._base is None:
                self._base = Handoff(
                    self.store, run, tokenizer=self.tokenizer, allow_stale=self.allow_stale, allow_zero_hindsight=zero
                )
                self._handoffs[run] = self._base
            else:
                self._handoffs[run] = self._base.for_run(run, allow_stale=self.allow_stale, allow_zero_hindsight=zero)
        return self._handoffs[run]

    def _batches(self, uids: Sequence[str], rows: dict[str, list[int]], problems: list[str]) -> dict[str, BatchInfo]:
        found: dict[str, BatchInfo] = {}
        deadline = time.monotonic() + self.wait  # one wait for the whole step, not one per group
        for uid in uids:
            first = rows[uid][0]
            try:
                left = max(0.0, deadline - time.monotonic())
                info = wait_for_batch(self.store, uid, timeout=left, poll=self.poll)
            except BatchNotReady:
                problems.append(
                    f"sample {first} (uid {uid}): the store has no batch for this uid after {self.wait:g} s "
                    f"({len(rows[uid])} sample(s) of it): is `hcapo-store follow --batch-by field:uid` following "
                    "the agent loop's rollouts?"
                )
                continue
            if info.status != "ready" or not info.credit_run:
                failed = _failed_members(info)
                problems.append(
                    f"sample {first} (uid {uid}): its batch {info.id} has no credits ({info.status}: {failed or 'no member could be credited'})"
                )
                continue
            found[uid] = info
        expected = self._expected_version()
        versions = {info.weight_version for info in found.values()}
        if expected is None and len(versions) > 1:
            # no version given: the step's groups must agree; the most common one is the step's
            counts = [info.weight_version for info in found.values()]
            expected = max(versions, key=lambda v: (counts.count(v), str(v)))
        if expected is not None:
            for uid, info in list(found.items()):
                if info.weight_version != expected:
                    problems.append(
                        f"sample {rows[uid][0]} (uid {uid}): its batch {info.id} was scored under weight version "
                        f"{info.weight_version!r}, this step trains {expected!r}: scores of another policy version"
                    )
                    del found[uid]
        return found

    def _match(
        self, handoff: Handoff, info: BatchInfo, ids: list[int], where: str, start: int, valid: np.ndarray
    ) -> tuple[BatchMember, TokenCredit]:
        """The member of the group whose rendering ``ids`` are; else the one whose every credited
        step is in them and whose steps explain every policy token of the response (``valid``
        from position ``start``: a member with fewer steps than the sample is never it)."""
        members = info.members
        exact: dict[int, tuple[BatchMember, TokenCredit]] = {}  # episode id -> (member, credit)
        handoff.prefetch(m.episode_id for m in members)  # the group's episodes in one read
        for rendering in ("turns", "whole"):  # the sample is a member's rendering exactly: no search
            for m in members:
                if m.episode_id in exact:
                    continue
                try:
                    if handoff.rendered_ids(m.episode_id, rendering) != ids:
                        continue
                except EpisodeLookupError:  # a member the run does not credit
                    continue
                credit = handoff.advantages(m.episode_id, ids, strict=False)
                if not credit.refused and credit.spans:
                    exact[m.episode_id] = (m, credit)
        if exact:
            # identical members (the same conversation token for token) with other advantages: the
            # ids cannot tell which one this sample is, so it gets neither (never both the same)
            hits = list(exact.values())
            first = hits[0][1]
            if any(o.spans != first.spans or not np.array_equal(o.advantages, first.advantages) for _, o in hits[1:]):
                names = ", ".join(
                    f"{m.external_id or m.name} ({c.step_advantages.get(min(c.spans), 0.0):+.4g})" for m, c in hits[:4]
                )
                raise HandoffError(
                    f"{where}: its ids are the rendering of {len(hits)} members of its group with other advantages "
                    f"({names}): identical rollouts with different rewards cannot be told apart, refused"
                )
            return hits[0]
        if self.exact:
            raise HandoffError(
                f"{where}: its ids are no member's rendering token for token (exact=True): the rollout's ids "
                "differ from the stored episode"
            )
        fits: list[tuple[BatchMember, TokenCredit]] = []
        best: tuple[int, int, str] | None = None  # (steps placed, first refused step, why) of the nearest miss
        left_out = ""  # the first member whose steps are all there but leave policy tokens unexplained
        for m in members:
            try:
                credit = handoff.advantages(m.episode_id, ids, strict=False)
            except EpisodeLookupError:  # a member the run does not credit (its steps failed for good)
                continue
            total = len(credit.spans) + len(credit.refused)
            if credit.refused or not credit.spans:
                if credit.refused and (best is None or len(credit.spans) > best[0]):
                    step = min(credit.refused)
                    best = (len(credit.spans), step, f"{m.external_id or m.name}, step {step}: {credit.refused[step]}")
                continue
            if total and credit.how in ("turns", "whole"):
                return m, credit  # the ids are this member's rendering, exactly
            unexplained = _unexplained(credit.mask[start : len(ids)], valid[: len(ids) - start])
            if unexplained is not None:
                a, b = unexplained
                left = f"{m.external_id or m.name} leaves the policy's tokens at response positions {a}-{b - 1} unexplained"
                left_out = left_out or left
                continue
            fits.append((m, credit))
        if not fits:
            # members the batch could not credit (not ingested, steps failed): the sample may be one
            failed = _failed_members(info)
            failed = f"; its batch could not credit {len(info.failed_episodes)} member(s) ({failed})" if failed else ""
            if left_out:
                raise HandoffError(
                    f"{where}: no member of its group has every policy turn of its response ({left_out}): "
                    f"a member with fewer steps is not this rollout{failed}"
                )
            if best is None:
                raise HandoffError(f"{where}: no member of its group has credited steps{failed}")
            raise HandoffError(
                f"{where}: step {best[1]} is not in its ids for any member of its group "
                f"(nearest: {best[2]}): the rollout's ids differ from the stored episode{failed}"
            )
        first = fits[0][1]
        for _m, other in fits[1:]:
            if other.spans != first.spans or not np.array_equal(other.advantages, first.advantages):
                names = ", ".join(m.external_id or m.name for m, _ in fits[:4])
                raise HandoffError(f"{where}: its ids fit several members of its group ({names}) with other advantages")
        return fits[0]

    def _without_uid(
        self,
        orphans: list[int],
        prompt_ids: Sequence[Sequence[int]],
        sample: Callable[[int], tuple[list[int], int, np.ndarray]],
        out: np.ndarray,
        problems: list[str],
    ) -> None:
        expected = self._expected_version()
        if expected is None:
            problems.append(
                f"sample {orphans[0]} (no uid): a row without its uid is looked up among the batches of this "
                "step's weight version: give weight_version"
            )
            return
        infos = [
            b
            for b in list_batches(self.store)
            if b.status == "ready" and b.credit_run and b.weight_version == expected and b.superseded_by is None
        ]
        # every member's exact renderings, once: a row is found by its ids alone, never guessed
        index: dict[tuple[int, ...], dict[tuple[int, int], tuple[BatchInfo, BatchMember]]] = {}
        for info in infos:
            handoff = self._handoff(str(info.credit_run))
            for m in info.members:
                for rendering in ("turns", "whole"):
                    try:
                        key = tuple(handoff.rendered_ids(m.episode_id, rendering))
                    except EpisodeLookupError:
                        continue
                    index.setdefault(key, {})[(info.id, m.episode_id)] = (info, m)
        for i in orphans:
            where = f"sample {i} (no uid)"
            ids, length, valid = sample(i)
            hits = list(index.get(tuple(ids), {}).values())
            if not hits:
                problems.append(
                    f"{where}: its ids are no episode's rendering in the {len(infos)} ready batch(es) of weight "
                    f"version {expected!r}: the rollout's ids differ from the stored episodes, or its batch is not published"
                )
                continue
            placed = []
            for info, m in hits:
                credit = self._handoff(str(info.credit_run)).advantages(m.episode_id, ids, strict=False)
                placed.append((info, m, credit))
            first = placed[0][2]
            if any(not np.array_equal(c.advantages, first.advantages) for _, _, c in placed[1:]):
                names = ", ".join(f"{m.external_id or m.name} (batch {b.id})" for b, m, _ in placed[:4])
                problems.append(
                    f"{where}: its ids are the rendering of several episodes with other advantages: {names}"
                )
                continue
            info, m, credit = placed[0]
            try:
                out[i, :length] = self._place(credit, len(prompt_ids[i]), valid[:length], where)
            except HandoffError as exc:
                problems.append(str(exc))
                continue
            self.last.append(
                SampleCredit(
                    i,
                    info.key,
                    info.id,
                    str(info.credit_run),
                    m.name,
                    m.external_id,
                    info.weight_version,
                    len(credit.spans),
                    credit.how,
                )
            )

    def advantages(
        self,
        uids: Sequence[object],
        prompt_ids: Sequence[Sequence[int]],
        response_ids: np.ndarray | Sequence[Sequence[int]],
        response_mask: np.ndarray | Sequence[Sequence[int]],
        response_lengths: Sequence[int] | None = None,
    ) -> np.ndarray:
        """(batch, response_length) float32: row i's step advantages on its response's action
        tokens (``prompt_ids[i]`` unpadded, ``response_ids[i]`` right-padded to
        ``response_lengths[i]`` real ids (default: up to the last masked-in one), ``response_mask``
        1 on the policy's own tokens). Raises ``VerlBatchError`` naming every refused sample.

        A row whose uid is None (verl's v1 colocated reward path drops the uid) is looked up
        among every ready batch scored under this step's weight version, which must then be
        known: its ids must be one member's rendering exactly, and one only."""
        responses = np.asarray(response_ids)
        masks = np.asarray(response_mask)
        if responses.ndim != 2 or responses.shape != masks.shape:
            raise HandoffError(f"responses {responses.shape} and response_mask {masks.shape} must be one (B, T) shape")
        if not len(uids) == len(prompt_ids) == len(responses):
            raise HandoffError(f"{len(uids)} uids, {len(prompt_ids)} prompts, {len(responses)} responses")
        rows: dict[str, list[int]] = {}
        orphans: list[int] = []  # rows without a uid
        for i, u in enumerate(uids):
            if u is None:
                orphans.append(i)
            else:
                rows.setdefault(str(u), []).append(i)
        problems: list[str] = []
        batches = self._batches(list(rows), rows, problems)
        out = np.zeros(responses.shape, dtype=np.float32)
        self.last = []

        def sample(i: int) -> tuple[list[int], int, np.ndarray]:
            valid = masks[i].astype(bool)
            if response_lengths is not None:
                length = int(response_lengths[i])
            else:
                length = int(np.flatnonzero(valid).max()) + 1 if valid.any() else 0
            return [int(t) for t in prompt_ids[i]] + [int(t) for t in responses[i, :length]], length, valid

        if orphans:
            self._without_uid(orphans, prompt_ids, sample, out, problems)
        for uid, info in batches.items():
            try:
                handoff = self._handoff(str(info.credit_run))
            except HandoffError as exc:  # a stale run: named with the sample that needs it
                problems.append(f"sample {rows[uid][0]} (uid {uid}): {exc}")
                continue
            for i in rows[uid]:
                where = f"sample {i} (uid {uid})"
                ids, length, valid = sample(i)
                start = len(prompt_ids[i])
                try:
                    member, credit = self._match(handoff, info, ids, where, start, valid)
                    out[i, :length] = self._place(credit, start, valid[:length], where)
                except HandoffError as exc:
                    problems.append(str(exc))
                    continue
                self.last.append(
                    SampleCredit(
                        i,
                        uid,
                        info.id,
                        str(info.credit_run),
                        member.name,
                        member.external_id,
                        info.weight_version,
                        len(credit.spans),
                        credit.how,
                    )
                )
        # a training run brings new groups every step: keep only this call's hand-offs (and renderings)
        used = {s.credit_run for s in self.last}
        self._handoffs = {run: h for run, h in self._handoffs.items() if run in used}
        # each group's hindsight signal (credits/signal.py), for the trainer's logs
        self.signals = {run: h.signal for run, h in self._handoffs.items() if h.signal is not None}
        if problems:
            raise VerlBatchError(problems)
        return out

    @staticmethod
    def _place(credit: TokenCredit, start: int, valid: np.ndarray, where: str) -> np.ndarray:
        """The response part of ``credit``: every action token in it must be trained, every
        value finite (a NaN or inf never reaches a trainer)."""
        own = credit.mask[start:]
        for index, (a, b) in sorted(credit.spans.items()):
            why = float32_problem(credit.step_advantages.get(index, 0.0))
            if why:  # checked after the cast to float32: 1e39 is finite in float64, inf in float32
                raise HandoffError(f"{where}: step {index}'s stored advantage {why}")
            if b > start and a < start:
                raise HandoffError(f"{where}: step {index}'s own tokens straddle the prompt and the response")
        untrained = own & ~valid
        if untrained.any():
            at = start + int(np.flatnonzero(untrained)[0])
            step = next((i for i, (a, b) in credit.spans.items() if a <= at < b), None)
            raise HandoffError(
                f"{where}: step {step}'s token at response position {at - start} is an action token but the "
                "response mask leaves it out: the trainer's mask and the store's spans disagree"
            )
        # a wrapper the policy wrote before a step (Qwen3's empty think block with thinking on) is
        # trained: it carries the step's advantage (handoff.with_lead_in)
        return with_lead_in(credit, valid, start).astype(np.float32)
