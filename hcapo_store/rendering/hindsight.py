"""The hindsight block: the trajectory's outcome, written into the first message of a
prompt (docs/SCORING.md "Hindsight"), and the check of a user's own template for it."""

from __future__ import annotations

import hashlib
import string
from collections.abc import Mapping, Sequence
from typing import Any, Literal

HINDSIGHT_TEMPLATE = """\
[HINDSIGHT — This is post-hoc scoring context, not visible during generation]
Trajectory outcome:
- Final reward: {reward:.4f}
- Phase reached: {phase}
- Plan score: {plan_score}
- Subtask scores: {scores_summary}
- Subtasks completed: {scored_count}/{plan_count}
- Current subtask: {current_subtask}
- Current subtask score: {current_subtask_score}"""

# The episode layout (rendering/episode_layout.py) has one hindsight block per episode: the
# outcome, without the per-step "current subtask" lines, which have no single value there.
EPISODE_HINDSIGHT_TEMPLATE = HINDSIGHT_TEMPLATE.split("\n- Current subtask:")[0]
PER_STEP_PLACEHOLDERS = ("current_subtask", "current_subtask_score")

PromptLayout = Literal["per-step", "episode"]
PROMPT_LAYOUTS: tuple[PromptLayout, ...] = ("per-step", "episode")


def template_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_field(obj: Any, name: str, default: Any = None) -> Any:
    """Outcomes and steps arrive as dicts or as dataclasses/ORM rows."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def hindsight_text(outcome: Any, step: Any, template: str = HINDSIGHT_TEMPLATE) -> str:
    """Fill the hindsight block the way the original ``build_hindsight_info`` did.

    A null ``plan_score`` prints as ``0`` (the store's rule: null counts as 0 where a number is needed; docs/ORIGINAL.md Q11).
    """
    frozen: Mapping[str, float] = read_field(outcome, "frozen_scores") or {}
    plan = read_field(outcome, "plan") or frozen
    plan_score = read_field(outcome, "plan_score")
    score = read_field(step, "subtask_reward")
    return template.format(
        reward=float(read_field(outcome, "reward")),
        phase=read_field(outcome, "phase") or "?",
        plan_score=0 if plan_score is None else plan_score,
        scores_summary=", ".join(f"{k}={v:.3f}" for k, v in frozen.items()) or "none",
        scored_count=len(frozen),
        plan_count=max(len(plan), 1),
        current_subtask=read_field(step, "subtask_id") or read_field(step, "phase"),
        current_subtask_score=f"{score:.3f}" if score is not None and score >= 0 else "n/a",
    )


# The fields ``hindsight_text`` fills, in the order of the default template.
HINDSIGHT_PLACEHOLDERS = (
    "reward",
    "phase",
    "plan_score",
    "scores_summary",
    "scored_count",
    "plan_count",
    "current_subtask",
    "current_subtask_score",
)


def layout_template(template: str, layout: PromptLayout) -> str:
    """The hindsight template a layout uses: the episode layout's default drops the per-step lines."""
    return EPISODE_HINDSIGHT_TEMPLATE if layout == "episode" and template == HINDSIGHT_TEMPLATE else template


def check_hindsight_template(template: str, layout: PromptLayout = "per-step") -> None:
    """Fail at configuration time, not at step 57, when a user template has unknown fields
    (or, for the episode layout, per-step fields that have no value there)."""
    names = [n for n in HINDSIGHT_PLACEHOLDERS if layout == "per-step" or n not in PER_STEP_PLACEHOLDERS]
    allowed = "allowed placeholders: " + ", ".join(f"{{{name}}}" for name in names)
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # e.g. a single "{" or "}"
        raise ValueError(
            f"hindsight template cannot be parsed ({exc}; write {{{{ and }}}} for literal braces); {allowed}"
        ) from exc
    unknown = [f for f in fields if f.split(".")[0].split("[")[0] not in names]
    if layout == "episode" and any(f.split(".")[0].split("[")[0] in PER_STEP_PLACEHOLDERS for f in fields):
        raise ValueError(
            "the episode layout has one hindsight block per episode, so {current_subtask} and "
            "{current_subtask_score} have no value there; leave them out of the template, or use "
            f"--prompt-layout per-step; {allowed}"
        )
    if unknown:
        raise ValueError(
            f"hindsight template has unknown placeholder(s) {', '.join('{' + f + '}' for f in unknown)}; {allowed}"
        )
    try:
        hindsight_text(
            {"reward": 0.0, "phase": "p", "plan_score": 0.0, "frozen_scores": {"S1": 0.0}},
            {"subtask_id": "S1", "phase": "executing", "subtask_reward": 0.0},
            template,
        )
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"hindsight template cannot be filled: {exc!r}; {allowed}") from exc


def inject_hindsight(messages: Sequence[Mapping[str, Any]], hindsight: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``hindsight`` appended to the first one's content (None: the plain
    conversation, for the baseline scorer π(a|s) of ``score --no-hindsight``). The first
    message is a copy; the others are the same objects (nothing changes a message once built,
    and renders recognise the messages they have already checked: template.py)."""
    out: list[dict[str, Any]] = [dict(m) for m in messages[:1]]
    if hindsight is not None and out:
        out[0]["content"] = (out[0].get("content") or "") + "\n\n" + hindsight
    # the rest as given: the stored, normalized and flattened messages are dicts
    return out + [m if isinstance(m, dict) else dict(m) for m in messages[1:]]
