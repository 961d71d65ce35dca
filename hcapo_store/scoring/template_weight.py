"""How much the chat template's own tokens weigh in a scorer's per-step means.

A scorer with the original's span (``--action-span rendered``) averages over every token the
template renders for a turn, wrappers included (Qwen3's empty think block, the newline after
``<|im_end|>``). Near-certain template tokens pull those steps' means towards 0, and only the
steps that have them. This module re-renders each stored step's action, finds the policy's
own tokens in it (``own_tokens.py``) and compares the stored mean with the mean over the own
tokens alone, from the stored per-token log-probabilities: no model call.

The own span inside the action does not depend on the hindsight block (that lives in the
first message), so the default hindsight template and no truncation are used to render; a
step whose action length differs from the stored ``total_action_tokens`` is counted as not
comparable, never guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import text

from hcapo_store.errors import ScoringError
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import PromptFailure
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.scoring.scorer import resolve_scorer, scorer_spec
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_episode
from hcapo_store.storage.store import Store

_NO_LIMIT = 1 << 30


def template_token_weight(
    store: Store, scorer: str | None, tokenizer_dir: str | Path, *, max_episodes: int | None = None
) -> dict[str, Any]:
    """Share of scored tokens that are the template's and how far they move the step means."""
    with db.read(store.engine) as conn:
        scorer_id, _ = resolve_scorer(conn, scorer)
    spec = scorer_spec(store, scorer_id)
    try:
        tok = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ScoringError(f"cannot load tokenizer {tokenizer_dir}: {exc}") from exc
    mine = tokenizer_fingerprint(tok, tokenizer_dir)
    theirs = spec.get("tokenizer") or {}
    if theirs.get("chat_template_sha256") != mine["chat_template_sha256"]:
        raise ScoringError(
            f"tokenizer {tokenizer_dir} has another chat template than scorer {scorer_id[:12]} "
            f"(which used {theirs.get('name', '?')!r}): pass that tokenizer directory"
        )
    if spec.get("action_span") == "policy":
        return {
            "scorer_id": scorer_id,
            "action_span": "policy",
            "template_token_share": 0.0,
            "note": "this scorer scores the policy's own tokens only: no template token is in its means",
        }
    rendered = PromptBuilder(tok, max_context=_NO_LIMIT, max_logprob_tokens=0)
    policy = PromptBuilder(tok, max_context=_NO_LIMIT, max_logprob_tokens=0, action_span="policy")
    stored_tokens = template_tokens = steps = not_comparable = 0
    shifts: list[float] = []
    with db.read(store.engine) as conn:
        episodes = [
            r[0]
            for r in conn.execute(
                text(
                    "SELECT DISTINCT s.episode_id FROM scores sc JOIN steps s ON s.id = sc.step_id "
                    "JOIN episodes e ON e.id = s.episode_id WHERE sc.scorer_id = :s AND e.is_current "
                    "ORDER BY s.episode_id"
                ),
                {"s": scorer_id},
            )
        ][:max_episodes]
        for ep_id in episodes:
            stored = {
                index: (np.frombuffer(blob, "<f4").astype(np.float64), total)
                for index, blob, total in conn.execute(
                    text(
                        "SELECT s.step_index, sc.token_logprobs, sc.total_action_tokens FROM scores sc "
                        "JOIN steps s ON s.id = sc.step_id WHERE sc.scorer_id = :s AND s.episode_id = :e"
                    ),
                    {"s": scorer_id, "e": ep_id},
                )
            }
            episode = load_episode(conn, ep_id)
            steps_here = [s for s in episode.steps if s.step_index in stored]
            r_prompts = rendered.build_episode(episode.messages, episode.outcome, steps_here)
            p_prompts = policy.build_episode(episode.messages, episode.outcome, steps_here)
            for step, r, p in zip(steps_here, r_prompts, p_prompts):
                values, total = stored[step.step_index]
                if isinstance(r, PromptFailure) or isinstance(p, PromptFailure) or r.total_action_tokens != total:
                    not_comparable += 1
                    continue
                prefix = len(r.input_ids) - total
                own = np.zeros(total, dtype=bool)
                own[p.first_scored - prefix : len(p.input_ids) - prefix] = True
                own = own[total - len(values) :]  # the stored values are the action's last tokens
                steps += 1
                stored_tokens += len(values)
                template_tokens += int((~own).sum())
                if own.any() and len(values):
                    shifts.append(float(values.mean() - values[own].mean()))
    shift = np.asarray(shifts)
    return {
        "scorer_id": scorer_id,
        "action_span": "rendered",
        "steps": steps,
        "not_comparable": not_comparable,
        "scored_tokens": stored_tokens,
        "template_tokens": template_tokens,
        "template_token_share": template_tokens / stored_tokens if stored_tokens else None,
        "steps_with_template_tokens": int((np.abs(shift) > 0).sum()) if len(shift) else 0,
        "mean_shift": float(shift.mean()) if len(shift) else None,
        "max_abs_shift": float(np.abs(shift).max()) if len(shift) else None,
    }
