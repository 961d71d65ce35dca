"""Why a ``score`` run (or dry run) found nothing to score, in one line: read-only SQL."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from hcapo_store.scoring.work_queue import Filters
from hcapo_store.storage import db
from hcapo_store.storage.store import Store


def _options_text(include_thinking: bool, max_tool_result_chars: int) -> str:
    thinking = "--include-thinking" if include_thinking else "--no-thinking"
    return f"{thinking} --max-tool-result-chars {max_tool_result_chars}"


def _unknown_episodes(conn: Connection, names: tuple[str, ...]) -> list[str]:
    sql = text(
        "SELECT 1 FROM episodes e WHERE e.is_current AND "
        "(e.name = :n OR e.source_key = :n OR CAST(e.id AS TEXT) = :n) LIMIT 1"
    )
    return [n for n in names if conn.execute(sql, {"n": n}).first() is None]


def why_nothing_to_score(store: Store, scorer_id: str, conversion: dict[str, Any], filters: Filters) -> str:
    """The first reason that applies: no episodes, unknown --episode, other conversion
    options, --min-reward, or every step already scored (or failed, or leased)."""
    with db.read(store.engine) as conn:
        if not conn.execute(text("SELECT 1 FROM episodes WHERE is_current LIMIT 1")).first():
            return "no episodes in this database: run `hcapo-store ingest PATH` first"
        unknown = _unknown_episodes(conn, filters.episodes)
        if unknown:
            return (
                f"--episode {', '.join(unknown)}: no such episode (give names, source paths or ids: "
                'hcapo-store sql "SELECT id, name FROM episodes WHERE is_current")'
            )
        params: dict[str, Any] = {}
        where = Filters(episodes=filters.episodes).sql(params)
        groups = conn.execute(
            text(
                "SELECT e.include_thinking, e.max_tool_result_chars, COUNT(*) FROM episodes e "
                f"WHERE e.is_current{where} GROUP BY e.include_thinking, e.max_tool_result_chars"
            ),
            params,
        ).all()
        wanted = (bool(conversion["include_thinking"]), int(conversion["max_tool_result_chars"]))
        if not any((bool(t), int(c)) == wanted for t, c, _ in groups):
            found = "; ".join(f"{n} with {_options_text(bool(t), int(c))}" for t, c, n in groups)
            return (
                f"no episode was ingested with {_options_text(*wanted)} (this scorer's options): {found}; "
                "score with the same options"
            )
        if filters.min_reward is not None:
            where = filters.sql(params)
            if not conn.execute(text(f"SELECT 1 FROM episodes e WHERE e.is_current{where} LIMIT 1"), params).first():
                return f"no episode has reward >= {filters.min_reward}"
        params.update(scorer=scorer_id, include_thinking=wanted[0], max_tool_result_chars=wanted[1])
        where = filters.sql(params)
        states: dict[str, int] = dict(
            conn.execute(
                text(
                    "SELECT a.status, COUNT(*) FROM attempts a JOIN episodes e ON e.id = a.episode_id "
                    "WHERE a.scorer_id = :scorer AND e.is_current AND e.include_thinking = :include_thinking "
                    f"AND e.max_tool_result_chars = :max_tool_result_chars{where} GROUP BY a.status"
                ),
                params,
            ).all()
        )
    done, failed, leased = states.get("done", 0), states.get("failed", 0), states.get("leased", 0)
    parts = [f"{done} already scored by this scorer"]
    if failed:
        parts.append(f"{failed} failed (--retry-failed to try them again)")
    if leased:
        parts.append(f"{leased} leased by other running workers (`hcapo-store status`)")
    return "every step is done: " + ", ".join(parts)
