"""What a scoring request is, in ids: one step's prompt with the exact span of its action
(:class:`StepPrompt`), a step that could not be built (:class:`PromptFailure`), and several
steps served by one request (:class:`GroupPrompt`). The rendering engine makes them; the
scheduler and the backends send them."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal, TypeVar, overload

# "context": the hindsight block and the action do not fit --max-context together (prompts.py)
FailureReason = Literal["alignment", "context", "empty_action", "template"]

T = TypeVar("T")


class IdsView(Sequence[int]):
    """Ids held otherwise than in a list of their own, read as one: an index is an int, a slice
    a list (as a list's are). Not hashable, as a list is not."""

    __slots__ = ()

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._slice(index) if isinstance(index, slice) else self._item(index)

    def _item(self, index: int) -> int:
        raise NotImplementedError

    def _slice(self, index: slice) -> list[int]:
        raise NotImplementedError

    __hash__ = None  # type: ignore[assignment]


class IdsPrefix(IdsView):
    """The first ``end`` ids of a shared list, without a copy: the steps of one episode-layout
    window all end inside the window's ids, and copying them per step would be quadratic."""

    __slots__ = ("_end", "_ids")

    def __init__(self, ids: list[int], end: int) -> None:
        if not 0 <= end <= len(ids):
            raise ValueError(f"end {end} outside [0, {len(ids)}]")
        self._ids, self._end = ids, end

    def __len__(self) -> int:
        return self._end

    def _item(self, index: int) -> int:
        if not -self._end <= index < self._end:
            raise IndexError("IdsPrefix index out of range")
        return self._ids[index % self._end]

    def _slice(self, index: slice) -> list[int]:
        return self._ids[slice(*index.indices(self._end))]

    def __iter__(self) -> Iterator[int]:
        return islice(self._ids, self._end)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, IdsPrefix)):
            return NotImplemented
        return len(other) == self._end and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"IdsPrefix({self._end} of {len(self._ids)} ids)"


class PackedIds(IdsView):
    """A request's ids as one buffer of 32-bit integers, read as the list they were made from:
    what worker processes send back (scoring/preparing.py). A list pickles and unpickles one
    object per id (a real-size per-step episode's requests: ~2.7M ids, ~0.1 s in the parent's
    GIL); a buffer is copied whole. Slices are lists, as a list's are; ``as_array`` is the
    buffer itself, for the wire (scoring/backends/http.py ``wire_ids``)."""

    __slots__ = ("_ids",)

    def __init__(self, ids: array) -> None:
        if ids.typecode != "i":
            raise ValueError(f"PackedIds holds typecode 'i', not {ids.typecode!r}")
        self._ids = ids

    @classmethod
    def of(cls, ids: list[int]) -> PackedIds | list[int]:
        """``ids`` packed, or the list itself where an id does not fit in 32 bits."""
        # struct packs a list of ints in one C loop, ~2.5x faster than array's constructor (a
        # per-step episode sends ~2.7M ids); the same native C ints (tests/test_packed_ids.py)
        packed = array("i")
        try:
            packed.frombytes(struct.pack(f"{len(ids)}i", *ids))
        except (struct.error, OverflowError, TypeError):
            return ids
        return cls(packed)

    @property
    def as_array(self) -> array:
        return self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _item(self, index: int) -> int:
        return self._ids[index]

    def _slice(self, index: slice) -> list[int]:
        return self._ids[index].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedIds):
            return self._ids == other._ids
        if isinstance(other, list):
            return self._ids.tolist() == other
        if isinstance(other, IdsPrefix):
            return other == self._ids.tolist()
        return NotImplemented

    def __reduce__(self) -> tuple[type[PackedIds], tuple[array]]:
        return (PackedIds, (self._ids,))

    def __repr__(self) -> str:
        return f"PackedIds({len(self._ids)} ids)"


@dataclass(frozen=True)
class StepPrompt:
    """One scoring request: ``input_ids[first_scored:]`` are exactly the scored action tokens."""

    step_index: int
    # a list, an IdsPrefix of a window's ids (episode layout) or PackedIds (from a worker process)
    input_ids: Sequence[int]
    first_scored: int
    total_action_tokens: int
    skipped_action_tokens: int
    truncated_prefix_tokens: int
    flattened: bool
    # An opaque key of the request's hindsight context (the episode) for routers that keep one
    # context on one worker (SGLang router: X-SMG-Routing-Key); never text, a path or a secret.
    # Not part of what is scored, so not part of equality.
    routing_key: str | None = field(default=None, compare=False)

    @property
    def scored_tokens(self) -> int:
        return len(self.input_ids) - self.first_scored


@dataclass(frozen=True)
class PromptFailure:
    step_index: int
    reason: FailureReason
    message: str


@dataclass(frozen=True)
class GroupPrompt:
    """One request: ``input_ids`` is the last member's ids; every member's ids are a prefix of it."""

    members: tuple[StepPrompt, ...]

    @property
    def input_ids(self) -> Sequence[int]:
        return self.members[-1].input_ids

    @property
    def first_scored(self) -> int:
        return self.members[0].first_scored

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Per member, the positions ``[first_scored, end)`` of its scored tokens in ``input_ids``."""
        return [(m.first_scored, len(m.input_ids)) for m in self.members]

    def as_prompt(self) -> StepPrompt:
        """The whole request as one prompt: every position from the first member's first
        scored token to the end is scored (the backends' per-step path then verifies it)."""
        last = self.members[-1]
        return StepPrompt(
            step_index=last.step_index,
            input_ids=last.input_ids,
            first_scored=self.first_scored,
            total_action_tokens=0,
            skipped_action_tokens=0,
            truncated_prefix_tokens=0,
            flattened=last.flattened,
            routing_key=last.routing_key,
        )

    def split(self, logprobs: Sequence[T]) -> list[list[T]]:
        """Per member, its scored values out of the values of ``input_ids[first_scored:]``."""
        offset = self.first_scored
        return [list(logprobs[start - offset : end - offset]) for start, end in self.spans]
