"""The interface every scoring backend implements, and the result it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from hcapo_store.errors import InferenceError
from hcapo_store.scoring.prompts import StepPrompt

ROUTING_HEADER = "X-SMG-Routing-Key"  # the SGLang router's key for sticky routing (--policy manual)


def routing_headers(prompt: StepPrompt) -> dict[str, str]:
    return {ROUTING_HEADER: prompt.routing_key} if prompt.routing_key else {}


# A logprob below this is refused: e^-10000 is no probability a model computes honestly, and
# far lower values (-1e300) would become -inf once stored as float32.
LOGPROB_FLOOR = -1e4

T = TypeVar("T")


def checked_cached_tokens(value: Any, prompt_tokens: int) -> int | None:
    """A server's count of prompt tokens it served from cache: an int in [0, prompt_tokens],
    or None when absent; anything else refuses the response (it would reach the database)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= prompt_tokens:
        raise InferenceError(
            "bad_response",
            f"cached_tokens {str(value)[:40]} is not a count of the {prompt_tokens} prompt tokens sent",
            retryable=False,
        )
    return value


@dataclass(frozen=True)
class BackendScore:
    """Verified logprobs of ``prompt.input_ids[prompt.first_scored:]``, one per token."""

    logprobs: list[float]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    model_id: str | None = None


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


class Backend(Protocol):
    kind: str

    async def start(self) -> None:
        """Connect / load; read the server's facts once (model id, context length)."""

    async def close(self) -> None: ...

    def identity(self) -> dict[str, Any]:
        """What about this backend determines the logprobs (goes into the scorer id)."""

    def context_length(self) -> int | None:
        """The most input tokens one request may carry (the server's or model's limit), when known."""

    async def score(self, prompt: StepPrompt) -> BackendScore:
        """Score one prompt; raise InferenceError (retryable or not) on any failure."""

    async def score_group(self, group: GroupPrompt) -> list[BackendScore]:
        """Score every member of a group with one request; one result per member, in order."""
