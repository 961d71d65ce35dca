"""The interface every scoring backend implements, and the result it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from hcapo_store.errors import InferenceError
from hcapo_store.rendering.requests import GroupPrompt, StepPrompt

ROUTING_HEADER = "X-SMG-Routing-Key"  # the SGLang router's key for sticky routing (--policy manual)


def routing_headers(prompt: StepPrompt) -> dict[str, str]:
    return {ROUTING_HEADER: prompt.routing_key} if prompt.routing_key else {}


# A logprob below this is refused: e^-10000 is no probability a model computes honestly, and
# far lower values (-1e300) would become -inf once stored as float32.
LOGPROB_FLOOR = -1e4
# A logprob up to this above 0 is rounding (stored as 0); beyond it, no log-probability.
LOGPROB_ROUNDING = 1e-4


def outside_logprobs(values: Any) -> Any:
    """Which of ``values`` (an array's worth) are no log-probabilities a backend may store: not
    finite, above 0 beyond ``LOGPROB_ROUNDING``, or below ``LOGPROB_FLOOR`` (a numpy bool mask).
    numpy is imported here: the CLI loads this module without it."""
    import numpy as np

    array = np.asarray(values, dtype=np.float64)
    return ~(np.isfinite(array) & (array <= LOGPROB_ROUNDING) & (array >= LOGPROB_FLOOR))


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


def precision_identity(dtype: str, device: str) -> dict[str, str]:
    """The dtype and device type a model computes in, as they go into the scorer (in process,
    live, or a server that reports them, as the reference server's ``/model_info`` does): left
    out at float32 on the CPU (what every in-process scorer was before they could be chosen, so
    those scorers keep their ids); otherwise both, so bf16 and fp32 scores never share a scorer."""
    if dtype == "float32" and device == "cpu":
        return {}
    return {"dtype": dtype, "device": device}


@dataclass(frozen=True)
class BackendScore:
    """Verified logprobs of ``prompt.input_ids[prompt.first_scored:]``, one per token."""

    logprobs: list[float]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    model_id: str | None = None
    # ``score --top-k K`` (the backend's ``top_k``): per scored token its K most likely
    # (id, logprob), from the same request as ``logprobs`` (scoring/topk.py); None otherwise
    top: list[list[tuple[int, float]]] | None = None


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


def split_score(group: GroupPrompt, result: BackendScore) -> list[BackendScore]:
    """One request's verified result → one result per member (request facts shared)."""
    return [
        BackendScore(
            logprobs=values,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            latency_s=result.latency_s,
            model_id=result.model_id,
            top=top,
        )
        for values, top in zip(
            group.split(result.logprobs),
            group.split(result.top) if result.top is not None else [None] * len(group.members),
            strict=True,
        )
    ]
