"""A step as the pipeline passes it around: which message, which phase, which subtask.

Shared by ingestion (which maps steps to subtasks) and storage (which loads them back), so
it sits below both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    step_index: int
    message_index: int
    phase: str
    subtask_id: str | None
    subtask_reward: float | None
