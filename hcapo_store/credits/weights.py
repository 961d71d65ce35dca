"""A credit run's per-step weights as the exports and the trainer hand-off read them: the run's
stored advantages, or Eq. 8 computed again for other options (and the rows they come from)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.credits.equations import hcapo_weights
from hcapo_store.credits.lookup import RunInfo
from hcapo_store.errors import ExportError
from hcapo_store.ingestion import fields as episode_fields

# Runs whose stored advantages are signed and fixed at compute time (every episode kept).
SIGNED_VARIANTS = ("paper", "log-ratio")

FETCH_ROWS = 20_000


def stream(conn: Connection, sql: str, params: dict[str, Any]) -> Iterator[Any]:
    result = conn.execution_options(stream_results=True).execute(text(sql), params)
    for block in result.partitions(FETCH_ROWS):
        yield from block


SELECT_SQL = """
SELECT e.id, e.name, e.external_id, e.reward, s.message_index, c.{q}, c.advantage, c.a_macro, s.step_index
FROM credits c
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
WHERE c.run_id = :run AND e.reward >= :min_reward
ORDER BY e.name, e.id, s.step_index
"""


def selected_episodes(conn: Connection, run: RunInfo, min_reward: float, use_smoothed: bool) -> list[dict[str, Any]]:
    sql = SELECT_SQL.format(q="q_h_smoothed" if use_smoothed else "q_h")
    episodes: list[dict[str, Any]] = []
    rows = stream(conn, sql, {"run": run.id, "min_reward": min_reward})
    for ep_id, group in itertools.groupby(rows, key=lambda r: r[0]):
        g = list(group)
        episodes.append(
            {
                "id": ep_id,
                "name": g[0][1],
                "external_id": g[0][2],
                "reward": g[0][3],
                "indices": [r[4] for r in g],  # message indices of the credited steps, in step order
                "step_indices": [r[8] for r in g],
                "q": np.asarray([r[5] for r in g], dtype=np.float64),
                "advantage": np.asarray([np.nan if r[6] is None else r[6] for r in g], dtype=np.float64),
                "a_macro": np.nan if g[0][7] is None else float(g[0][7]),
            }
        )
    return episodes


# Every episode: the paper keeps them all (and a SQL bound both databases accept).
NO_MIN_REWARD = -1e308


@dataclass
class RunWeights:
    """The per-step weights an export writes, and where they came from."""

    episodes: list[dict[str, Any]]
    grpo: np.ndarray  # the macro term A_i per episode
    weights: list[np.ndarray]  # per step, per episode
    signed: bool  # paper: signed advantages, every episode kept; original: Eq. 8 weights >= 0
    source: str  # "stored" (the run's advantages) or "computed" (Eq. 8 with this export's options)
    omega: float
    min_reward: float | None
    group_by: str | None
    use_smoothed: bool

    def config(self) -> dict[str, Any]:
        return {
            "omega": self.omega,
            "min_reward": self.min_reward,
            "use_smoothed": self.use_smoothed,
            "group_by": self.group_by,
            "advantages": self.source,
        }


def run_weights(
    conn: Connection,
    run: RunInfo,
    warnings: list[str],
    *,
    omega: float | None = None,
    min_reward: float | None = None,
    group_by: str | None = None,
    use_smoothed: bool | None = None,
) -> RunWeights:
    """The run's stored advantages when the options are the run's own (None = the run's);
    Eq. 8 computed here, as before revision 0003, for other options or an older run.

    A paper run's advantages are fixed when it is computed (they are signed and use the
    group's statistics), so other options are refused, not silently recomputed the
    original's way."""
    p = run.credit_params
    if run.variant in SIGNED_VARIANTS:
        asked = {"--omega": (omega, p.omega), "--group-by": (group_by, p.group_by), "--no-smooth": (use_smoothed, True)}
        clash = [f"{flag} {given!r}" for flag, (given, own) in asked.items() if given is not None and given != own]
        if min_reward is not None:
            clash.append(f"--min-reward {min_reward!r}")
        if clash:
            raise ExportError(
                f"credit run {run.name!r} is a {run.variant} run: its signed advantages were fixed by `credits compute` "
                f"(omega {p.omega:g}, group-by {p.group_by or 'none'}, every episode kept); "
                f"drop {', '.join(clash)} or compute another run with `credits compute --variant paper ...`"
            )
        episodes = selected_episodes(conn, run, NO_MIN_REWARD, True)
        return RunWeights(
            episodes,
            np.asarray([e["a_macro"] for e in episodes], dtype=np.float64),
            [e["advantage"] for e in episodes],
            True,
            "stored",
            p.omega,
            None,
            p.group_by,
            True,
        )
    omega = p.omega if omega is None else omega
    min_reward = p.min_reward if min_reward is None else min_reward
    group_by = p.group_by if group_by is None else group_by
    use_smoothed = True if use_smoothed is None else use_smoothed
    episodes = selected_episodes(conn, run, min_reward, use_smoothed)
    own = (omega, min_reward, group_by, use_smoothed) == (p.omega, p.min_reward, p.group_by, True)
    if own and run.stored_advantages and all(not np.isnan(e["advantage"]).any() for e in episodes):
        grpo = np.asarray([e["a_macro"] for e in episodes], dtype=np.float64)
        weights = [e["advantage"] for e in episodes]
        return RunWeights(episodes, grpo, weights, False, "stored", omega, min_reward, group_by, use_smoothed)
    eq8 = hcapo_weights(
        np.asarray([e["reward"] for e in episodes], dtype=np.float64),
        [e["q"] for e in episodes],
        omega,
        episode_groups(conn, episodes, group_by, warnings),
    )
    return RunWeights(episodes, eq8.grpo, eq8.weights, False, "computed", omega, min_reward, group_by, use_smoothed)


def episode_groups(
    conn: Connection, episodes: list[dict[str, Any]], group_by: str | None, warnings: list[str]
) -> list[Any] | None:
    if group_by is None:
        return None
    groups = episode_fields.group_values(conn, [e["id"] for e in episodes], group_by)
    untagged = groups.count(None)
    what = episode_fields.kind(group_by)
    if episodes and untagged == len(episodes):
        warnings.append(
            f"--group-by {group_by}: no exported episode has this {what}, so all form one group "
            f"({episode_fields.known_keys(conn, group_by)})"
        )
    elif untagged:
        warnings.append(
            f"--group-by {group_by}: {untagged} of {len(episodes)} episode(s) lack this {what} "
            "and form one group of their own"
        )
    return groups
