"""Grouped requests: consecutive steps whose prompts are prefixes of one another share one request.

Steps of one subtask share the hindsight block; with a prefix-stable chat template step
k's prompt ids are a prefix of step k+1's, so one request carrying the conversation up
to the group's last step yields the logprobs of every member's scored span. Exactness
is checked, never assumed: a step joins the group only if its own prompt ids (built
exactly as for a per-step request) equal the group's ids up to its end, position for
position. Where they differ (a template that rewrites history, a new hindsight block,
a truncated prompt) the group splits, so every stored value is the one a per-step
request would give (up to float reduction order on the server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

from hcapo_store.rendering.episode_layout import EpisodeLayout, conversation_tokens
from hcapo_store.rendering.prompts import PromptBuilder, read_field
from hcapo_store.rendering.requests import GroupPrompt, PromptFailure, StepPrompt

Grouping = Literal["per-step", "grouped"]
GROUPINGS: tuple[Grouping, ...] = ("per-step", "grouped")

T = TypeVar("T")


def joins(group: list[StepPrompt], prompt: StepPrompt, max_tokens: int | None) -> bool:
    """Can ``prompt`` extend ``group`` exactly? Its ids must start with the group's ids and
    its first scored token must come after the group's last one (spans never overlap).
    A step under sliding truncation never passes (its tail starts later than the previous
    step's), so it goes alone; under ``--truncation window`` the steps of one window do."""
    if not group:
        return False
    ids, last = prompt.input_ids, group[-1].input_ids
    if max_tokens is not None and len(ids) > max_tokens:
        return False
    return len(ids) > len(last) and prompt.first_scored >= len(last) and ids[: len(last)] == last


def group_prompts(
    prompts: Sequence[StepPrompt | PromptFailure], *, grouping: Grouping = "grouped", max_tokens: int | None = None
) -> list[GroupPrompt | PromptFailure]:
    """Requests for the prompts of one episode, in step order: failures stay on their own;
    with ``per-step`` every prompt is its own request."""
    out: list[GroupPrompt | PromptFailure] = []
    current: list[StepPrompt] = []
    for prompt in prompts:
        if isinstance(prompt, PromptFailure):
            out.append(prompt)
            continue
        if grouping == "grouped" and joins(current, prompt, max_tokens):
            current.append(prompt)
            continue
        if current:
            out.append(GroupPrompt(tuple(current)))
        current = [prompt]
    if current:
        out.append(GroupPrompt(tuple(current)))
    return out


def plan_requests(
    builder: PromptBuilder,
    messages: Sequence[Mapping[str, Any]],
    outcome: Any,
    steps: Sequence[Any],
    *,
    grouping: Grouping = "grouped",
) -> list[GroupPrompt | PromptFailure]:
    """The requests that score ``steps`` of one episode, in the builder's layout: per step
    (grouped as ``grouping`` says), or one rendering per episode (``episode_layout.py``)."""
    if builder.layout == "episode":
        return EpisodeLayout(builder).requests(messages, outcome, steps)
    prompts = builder.build_episode(messages, outcome, steps)
    return group_prompts(prompts, grouping=grouping, max_tokens=builder.max_context)


def plan_requests_and_floor(
    builder: PromptBuilder,
    messages: Sequence[Mapping[str, Any]],
    outcome: Any,
    steps: Sequence[Any],
    all_steps: Sequence[Any],
    *,
    grouping: Grouping = "grouped",
) -> tuple[list[GroupPrompt | PromptFailure], int]:
    """:func:`plan_requests` and the episode's conversation tokens (its prefill floor, over
    ``all_steps``); the episode layout counts them on the rendering it placed when that is
    the floor's own."""
    if builder.layout == "episode":
        through = max((read_field(s, "message_index") for s in all_steps), default=-1)
        requests, floor = EpisodeLayout(builder).requests_and_floor(messages, outcome, steps, through)
        if floor is None:
            floor = conversation_tokens(builder, messages, outcome, all_steps)
        return requests, floor
    # The floor first: the per-step renders are made of the same pieces, so they find them
    # encoded (counting the floor on its own took about as long as the whole build).
    floor = conversation_tokens(builder, messages, outcome, all_steps, keep_pieces=True)
    return plan_requests(builder, messages, outcome, steps, grouping=grouping), floor
