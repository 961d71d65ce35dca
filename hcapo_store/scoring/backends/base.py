"""The interface every scoring backend implements, and the result it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hcapo_store.scoring.prompts import StepPrompt

if TYPE_CHECKING:
    from hcapo_store.scoring.grouping import GroupPrompt


@dataclass(frozen=True)
class BackendScore:
    """Verified logprobs of ``prompt.input_ids[prompt.first_scored:]``, one per token."""

    logprobs: list[float]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    model_id: str | None = None


class Backend(Protocol):
    kind: str

    async def start(self) -> None:
        """Connect / load; read the server's facts once (model id, context length)."""

    async def close(self) -> None: ...

    def identity(self) -> dict[str, Any]:
        """What about this backend determines the logprobs (goes into the scorer id)."""

    def context_length(self) -> int | None:
        """The server's or model's context length, when known."""

    async def score(self, prompt: StepPrompt) -> BackendScore:
        """Score one prompt; raise InferenceError (retryable or not) on any failure."""

    async def score_group(self, group: GroupPrompt) -> list[BackendScore]:
        """Score every member of a group with one request; one result per member, in order."""
