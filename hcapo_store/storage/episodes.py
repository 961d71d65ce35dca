"""Reading stored episodes back: converted messages, outcome and steps, for prompts and exports."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, select, text

from hcapo_store.errors import EpisodeLookupError
from hcapo_store.steps import StepInfo
from hcapo_store.storage.models import Episode, Message, Step, Subtask
from hcapo_store.tool_arguments import arguments_text


@dataclass(frozen=True)
class Outcome:
    reward: float
    phase: str | None
    plan_score: float | None
    frozen_scores: dict[str, float]
    plan: list[dict[str, Any]]


@dataclass(frozen=True)
class StoredEpisode:
    id: int
    name: str
    outcome: Outcome
    messages: list[dict[str, Any]]
    steps: list[StepInfo]
    step_ids: list[int]


def loader_message(
    role: str, content: str, tool_calls: str | None, name: str | None, tool_call_id: str | None
) -> dict[str, Any]:
    """A stored message in the original loader's shape (docs/ORIGINAL.md §1): tool_calls only
    when present, arguments as JSON strings (what the trainer expects)."""
    if role == "tool":
        return {"role": "tool", "name": name or "unknown", "tool_call_id": tool_call_id or "", "content": content}
    msg: dict[str, Any] = {"role": role, "content": content}
    calls = json.loads(tool_calls) if tool_calls else None
    if calls:
        for call in calls:
            fn = call.get("function") or {}
            fn["arguments"] = arguments_text(fn.get("arguments"))
        msg["tool_calls"] = calls
    return msg


def load_messages(conn: Connection, episode_id: int) -> list[dict[str, Any]]:
    return load_messages_of(conn, [episode_id])[int(episode_id)]


def load_messages_of(conn: Connection, episode_ids: Sequence[int]) -> dict[int, list[dict[str, Any]]]:
    """Each episode's messages in the original loader's shape (:func:`loader_message`), in order,
    read in one query (an episode without messages: an empty list)."""
    ids = sorted({int(i) for i in episode_ids})
    out: dict[int, list[dict[str, Any]]] = {i: [] for i in ids}
    if not ids:
        return out
    rows = conn.execute(
        select(
            Message.episode_id, Message.role, Message.content, Message.tool_calls, Message.name, Message.tool_call_id
        )
        .where(Message.episode_id.in_(ids))
        .order_by(Message.episode_id, Message.message_index)
    ).all()
    for r in rows:
        out[int(r.episode_id)].append(loader_message(r.role, r.content, r.tool_calls, r.name, r.tool_call_id))
    return out


def load_episode(conn: Connection, episode_id: int) -> StoredEpisode:
    ep = conn.execute(
        select(
            Episode.id, Episode.name, Episode.reward, Episode.phase, Episode.plan_score, Episode.frozen_scores
        ).where(Episode.id == episode_id)
    ).one()
    plan = [
        {"id": sid, "description": d, "acceptance_criteria": a}
        for sid, d, a in conn.execute(
            select(Subtask.subtask_id, Subtask.description, Subtask.acceptance_criteria)
            .where(Subtask.episode_id == episode_id)
            .order_by(Subtask.position)
        )
    ]
    steps = conn.execute(
        select(Step.id, Step.step_index, Step.message_index, Step.phase, Step.subtask_id, Step.subtask_reward)
        .where(Step.episode_id == episode_id)
        .order_by(Step.step_index)
    ).all()
    outcome = Outcome(
        reward=ep.reward,
        phase=ep.phase,
        plan_score=ep.plan_score,
        frozen_scores=json.loads(ep.frozen_scores),
        plan=plan,
    )
    return StoredEpisode(
        id=ep.id,
        name=ep.name,
        outcome=outcome,
        messages=load_messages(conn, episode_id),
        steps=[StepInfo(s.step_index, s.message_index, s.phase, s.subtask_id, s.subtask_reward) for s in steps],
        step_ids=[s.id for s in steps],
    )


# An exact name, episode key or row id; else the end of a name after a "/" or the source's
# own episode id (result.json / JSONL), among current episodes.
_EXACT_SQL = "SELECT DISTINCT source_key FROM episodes WHERE name = :v OR source_key = :v OR CAST(id AS TEXT) = :v"
_LOOSE_SQL = """SELECT source_key, name, id FROM episodes
WHERE is_current AND (substr(name, length(name) - length(:v)) = :slash_v OR external_id = :v)
ORDER BY name"""
LISTED = 10


def resolve_episode(conn: Connection, value: str) -> str:
    """The key of the episode a user means by ``value`` (a name, an id, or an unambiguous part).

    ``episode_001`` matches ``pg-01/episode_001`` when it is the only such name; with two
    roots it is refused, listing the candidates.
    """
    exact = [k for (k,) in conn.execute(text(_EXACT_SQL), {"v": value})]
    if len(exact) == 1:
        return exact[0]
    if exact:  # a name that is also another episode's id
        listed = conn.execute(
            text(
                "SELECT source_key, name, id FROM episodes WHERE is_current AND source_key IN "
                "(" + ", ".join(f":k{i}" for i in range(len(exact))) + ") ORDER BY name"
            ),
            {f"k{i}": k for i, k in enumerate(exact)},
        ).all()
        raise _ambiguous(value, listed)
    loose = conn.execute(text(_LOOSE_SQL), {"v": value, "slash_v": "/" + value}).all()
    if len({r[0] for r in loose}) == 1:
        return loose[0][0]
    if not loose:
        raise EpisodeLookupError(f"no episode {value!r}: give a name (SELECT name FROM episodes) or an id")
    raise _ambiguous(value, loose)


def _ambiguous(value: str, rows: Sequence[Row]) -> EpisodeLookupError:
    shown = ", ".join(f"{name} (id {ep_id})" for _, name, ep_id in rows[:LISTED])
    more = f" and {len(rows) - LISTED} more" if len(rows) > LISTED else ""
    return EpisodeLookupError(
        f"episode {value!r} is ambiguous: it matches {len(rows)} episodes: {shown}{more}; give the full name or the id"
    )


def resolve_episodes(conn: Connection, values: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(resolve_episode(conn, v) for v in values))
