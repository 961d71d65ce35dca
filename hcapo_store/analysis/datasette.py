"""datasette metadata: table and column descriptions and the example queries of docs/DATABASE.md.

``hcapo-store datasette-metadata metadata.json`` writes it; then
``datasette hcapo.db --metadata metadata.json`` shows the descriptions and lists the
queries as canned queries. The database key is the SQLite file's stem (datasette's name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_EPISODE = "episode name (unique per version; see episodes.name)"
_STEP_COLUMNS = {
    "step_id": "steps.id",
    "step_index": "0-based index of the assistant step in its episode",
    "message_index": "index of the step's assistant message in the converted messages",
    "phase": "planning / executing / ...",
    "subtask_id": "plan item the step works on (NULL while planning)",
    "subtask_reward": "frozen score of the step's subtask (the plan score while planning)",
    "mean_logprob": "mean hindsight log-probability of the scored action tokens",
    "token_count": "action tokens in the mean",
}
_CREDIT_COLUMNS = {
    "pi_hind": "exp(mean_logprob / t_temp) (Eq. 5)",
    "rho_raw": "pi_hind / episode mean of pi_hind",
    "rho": "rho_raw clipped to [c_min, c_max] (Eq. 6)",
    "r_t": "reward used for the step (dense or sparse)",
    "discount": "gamma ** (steps to the end of the step's subtask)",
    "q_h": "rho * discount * r_t (Eq. 7)",
    "q_h_smoothed": "backward-smoothed q_h (alpha); the default input of Eq. 8",
    "a_macro": "the step's episode-level advantage (original: the group-normalised reward of Eq. 8; "
    "paper: the group-normalised return of Algorithm 1)",
    "micro": "the step's hindsight term (original: q used by Eq. 8; paper: the micro advantage after do-no-harm)",
    "advantage": "what training uses: the Eq. 8 weight (original) or the signed a_macro + omega * micro (paper)",
}

TABLES: dict[str, dict[str, Any]] = {
    "episodes": {
        "description": "one row per version of an episode; is_current marks the latest",
        "columns": {
            "name": _EPISODE,
            "source_key": "the episode's identity, shared by all its versions and independent of where "
            "the files sit: pi:<session id>, pi-sha256:<hash of an id-less session>, "
            "jsonl:<file name>#<episode_id>, or jsonl-sha256:<hash of an id-less line>",
            "version": "1, 2, ... as the source changes",
            "is_current": "1 for the latest version",
            "reward": "episode reward",
            "phase": "phase reached",
            "plan_score": "score of the plan",
            "frozen_scores": "per-subtask scores (JSON)",
            "raw_source": "original files (zlib)",
        },
    },
    "messages": {
        "description": "converted messages of each episode version",
        "columns": {
            "message_index": "position in the conversation",
            "role": "system / user / assistant / tool",
            "content": "text",
            "tool_calls": "assistant tool calls (JSON)",
        },
    },
    "steps": {
        "description": "one row per assistant message (a step)",
        "columns": {
            k: v
            for k, v in _STEP_COLUMNS.items()
            if k in ("step_index", "message_index", "phase", "subtask_id", "subtask_reward")
        },
    },
    "scorers": {
        "description": "a scorer: model, tokenizer, templates and limits; its id is the spec's hash",
        "columns": {"label": "short readable name", "spec": "canonical JSON of everything that fixes the logprobs"},
    },
    "scores": {
        "description": "one (step, scorer) result",
        "columns": {
            "token_logprobs": "per-token hindsight logprobs, little-endian float32 blob "
            "(`hcapo-store export scores` writes them as a Parquet list)",
            "token_count": "scored action tokens",
            "mean_logprob": "mean of token_logprobs",
            "total_action_tokens": "action length before truncation",
            "skipped_action_tokens": "action tokens not scored (max_logprob_tokens, context)",
            "latency_s": "request latency in seconds",
        },
    },
    "attempts": {
        "description": "the scoring queue: one row per (step, scorer)",
        "columns": {
            "status": "queued / leased / done / failed",
            "attempt_count": "tries so far",
            "last_error_kind": "kind of the last failure (http_503, timeout, ...)",
        },
    },
    "credit_runs": {
        "description": "a credit run: scorer + hyperparameters",
        "columns": {
            "name": "run name (--credits NAME)",
            "params": "hyperparameters (JSON)",
            "incomplete_episodes": "episodes skipped because a step had no score",
        },
    },
    "credits": {"description": "per-step credits of a run", "columns": dict(_CREDIT_COLUMNS)},
    "step_credits": {
        "description": "credited steps with their episode and subtask (one row per run x step)",
        "columns": {
            "run": "credit run name",
            "variant": "estimator: original (the scripts') or paper (Algorithm 1)",
            "episode": _EPISODE,
            "reward": "episode reward",
            **_STEP_COLUMNS,
            **_CREDIT_COLUMNS,
        },
    },
    "step_scores": {
        "description": "scored steps of current episodes with their episode and subtask",
        "columns": {"scorer_id": "scorers.id", "episode": _EPISODE, **_STEP_COLUMNS},
    },
    "subtask_credits": {
        "description": "run x episode x subtask: step count and mean credits",
        "columns": {
            "subtask": "subtask_id, or the phase when there is none",
            "first_step": "first step_index",
            "steps": "steps in the subtask",
            "rho": "mean rho",
            "q_h": "mean q_h",
            "q_h_smoothed": "mean q_h_smoothed",
        },
    },
}

# The example queries of docs/DATABASE.md, verbatim (tests check both lists agree); in
# datasette the run and the subtask are the query's parameters (``PARAMETERS``), with the
# documented values as the form's starting point.
DOCUMENTED: dict[str, dict[str, str]] = {
    "top_steps_by_rho": {
        "title": "Top steps by rho in a subtask",
        "sql": "SELECT episode, step_index, rho, q_h_smoothed FROM step_credits\n"
        "WHERE run = 'default' AND subtask_id = 'S2' ORDER BY rho DESC LIMIT 10;",
    },
    "mean_q_h_per_subtask": {
        "title": "Mean Q_H per subtask across episodes",
        "sql": "SELECT subtask, count(*) AS episodes, avg(q_h) FROM subtask_credits WHERE run = 'default' "
        "GROUP BY subtask;",
    },
    "failures_by_kind": {
        "title": "Scoring failures by kind",
        "sql": "SELECT last_error_kind, count(*) FROM attempts WHERE status = 'failed' GROUP BY 1;",
    },
}
PARAMETERS = {"run": "'default'", "subtask": "'S2'"}  # parameter -> the literal it stands for


def _parameterised(sql: str) -> tuple[str, list[str]]:
    params = [p for p, literal in PARAMETERS.items() if literal in sql]
    for p in params:
        sql = sql.replace(PARAMETERS[p], f":{p}")
    return sql, params


QUERIES: dict[str, dict[str, Any]] = {}
for _key, _query in DOCUMENTED.items():
    _sql, _params = _parameterised(_query["sql"])
    QUERIES[_key] = {**_query, "sql": _sql, **({"params": _params} if _params else {})}


@dataclass(frozen=True)
class DatasetteMetadata:
    """datasette's metadata for one database; ``as_dict()`` is the document datasette reads
    (``datasette --metadata``, or ``Datasette(metadata=...)``)."""

    database: str  # datasette's name of the database: the SQLite file's stem
    tables: dict[str, dict[str, Any]]  # table -> {"description": ..., "columns": {column: description}}
    queries: dict[str, dict[str, Any]]  # name -> {"title": ..., "sql": ..., "params": [...] if it has any}
    title: str = "hcapo-store"
    description: str = "LLM-agent trajectories, hindsight log-probabilities and HCAPO credits"

    def as_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "description": self.description,
            "databases": {self.database: {"tables": self.tables, "queries": self.queries}},
        }


def datasette_metadata(database: str = "hcapo") -> DatasetteMetadata:
    """datasette's metadata for a database named ``database`` (the file's stem)."""
    return DatasetteMetadata(database, TABLES, QUERIES)
