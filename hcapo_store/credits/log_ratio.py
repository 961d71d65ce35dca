"""Log-ratio credit runs over two scorers: ``credits compute --variant log-ratio``.

The self-distillation family (docs/FAMILY.md: SDAR, AgentOPSD/OPSD, HinT-SD) scores the
policy's own sampled tokens twice, with a privileged teacher context and without it, and
credits each token with the log-ratio

    d_t = log π_teacher(a_t | privileged) − log π_student(a_t)

(the negative of the per-token reverse-KL estimate OPSD penalises). Both sides are stored
scores: the teacher is a scorer (e.g. the hindsight scorer), the student another scorer of
the same tokens (``score --no-hindsight``, or the rollout's own logprobs, scorer kind
``rollout``). Nothing here calls a model.

Per token the advantage handed to trainers is ``A_i + kl_coef · g_t · d_t``: ``g_t`` is 1,
or with ``gate="sigmoid"`` SDAR's gate σ(d_t / τ) on the detached signal; ``A_i`` is 0, or
with ``grpo=True`` the episode's group-normalised reward (GRPO's, per ``group_by`` tag): RL
stays the backbone and the log-ratio term is the dense auxiliary. ``clip`` bounds |d_t|
first. Per step the run stores the means (``step_credits``: ``q_h`` = mean d_t, ``micro`` =
mean of the log-ratio term, ``a_macro`` = A_i, ``advantage`` = their sum); per episode the
``episode_log_ratios`` view sums them back (the sequence-level log-ratio); per token
``token_credits`` holds d_t and the advantage, which the tokenized export and the trainers'
hand-offs place on the step's own tokens.

The two scorers must have scored the same tokens: the same tokenizer and action span, and
per step the same counts (scored, total, skipped); otherwise the run is refused naming the
first step that differs. Scorers of another engine, dtype or weights are refused unless
``allow_mixed`` (the precision gap between engines alone moves d_t).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.canonical import content_hash
from hcapo_store.credits.compute import CREDIT_COLUMNS, ComputeResult, _raw_stream, insert_run, scope_identities
from hcapo_store.credits.equations import grpo_advantages
from hcapo_store.credits.lookup import find_run, run_staleness, scope_sql
from hcapo_store.errors import CreditError, InvalidCreditParams
from hcapo_store.scoring.scorer import resolve_scorer
from hcapo_store.storage import db
from hcapo_store.storage.store import Store

VARIANT = "log-ratio"
GATES = ("none", "sigmoid")
# The students a per-batch run (``follow``, TRL's ``StoreAdvantages``) produces itself for each
# batch: the teacher's own scorer without the hindsight block, or the rollouts' own logprobs
# (``score-rollout``'s, from the ingested records). ``credits compute --against`` names a stored scorer.
NO_HINDSIGHT = "no-hindsight"
ROLLOUT = "rollout"
BATCH_STUDENTS = (NO_HINDSIGHT, ROLLOUT)

# Pass 1 (no blobs), aggregated by the database: per episode its steps, the steps each scorer
# scored, and the steps both scored over other tokens (counts of scored, action, skipped tokens).
_SAME = "COALESCE(t.{c}, -1) = COALESCE(u.{c}, -1)"
COUNTS_SQL = (
    """
SELECT e.id, e.name, e.reward, COUNT(*), COUNT(t.step_id), COUNT(u.step_id),
       SUM(CASE WHEN t.step_id IS NOT NULL AND u.step_id IS NOT NULL AND NOT ("""
    + " AND ".join(_SAME.format(c=c) for c in ("token_count", "total_action_tokens", "skipped_action_tokens"))
    + """) THEN 1 ELSE 0 END)
FROM episodes e
JOIN steps s ON s.episode_id = e.id
LEFT JOIN scores t ON t.step_id = s.id AND t.scorer_id = :teacher
LEFT JOIN scores u ON u.step_id = s.id AND u.scorer_id = :student
WHERE e.is_current IS TRUE{scope}
GROUP BY e.id, e.name, e.reward
ORDER BY e.id
"""
)

# The steps of one episode the two scorers scored over other tokens (to name the first).
OTHER_TOKENS_SQL = """
SELECT s.step_index, t.token_count, t.total_action_tokens, t.skipped_action_tokens,
       u.token_count, u.total_action_tokens, u.skipped_action_tokens
FROM steps s
JOIN scores t ON t.step_id = s.id AND t.scorer_id = :teacher
JOIN scores u ON u.step_id = s.id AND u.scorer_id = :student
WHERE s.episode_id = :episode
ORDER BY s.step_index
"""

# Pass 2: the values, block by block.
STREAM_SQL = """
SELECT e.id, s.id, t.token_logprobs, t.token_count, t.mean_logprob, u.token_logprobs
FROM episodes e
JOIN steps s ON s.episode_id = e.id
LEFT JOIN scores t ON t.step_id = s.id AND t.scorer_id = :teacher
LEFT JOIN scores u ON u.step_id = s.id AND u.scorer_id = :student
WHERE e.is_current IS TRUE{scope}
ORDER BY e.id, s.step_index
"""


@dataclass(frozen=True)
class LogRatioParams:
    """The options of a log-ratio run (module doc). Defaults: the plain per-token log-ratio
    (OPSD's per-token reward), no gate, no GRPO term, no clip (docs/FAMILY.md says which
    paper values could not be checked)."""

    kl_coef: float = 1.0
    gate: str = "none"
    gate_temperature: float = 1.0
    grpo: bool = False
    group_by: str | None = None
    clip: float | None = None

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise InvalidCreditParams(f"gate (--gate) must be one of {', '.join(GATES)}, got {self.gate!r}")
        if not math.isfinite(self.kl_coef):
            raise InvalidCreditParams(f"kl_coef (--kl-coef) must be a finite number, got {self.kl_coef!r}")
        if not (math.isfinite(self.gate_temperature) and self.gate_temperature > 0):
            raise InvalidCreditParams(
                f"gate_temperature (--gate-temperature) must be a finite number > 0, got {self.gate_temperature!r}"
            )
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise InvalidCreditParams(f"clip (--clip) must be a finite number > 0, got {self.clip!r}")
        if self.group_by is not None and not self.grpo:
            raise InvalidCreditParams("group_by (--group-by) applies with --grpo only (the GRPO term's groups)")

    def as_dict(self, against: str) -> dict[str, Any]:
        d = asdict(self)
        d["kl_coef"], d["gate_temperature"] = float(self.kl_coef), float(self.gate_temperature)
        d["clip"] = None if self.clip is None else float(self.clip)
        return {"against": against, **d}


# ---- the math (no database) -------------------------------------------------------------------


@dataclass
class LogRatioArrays:
    """Per token (flat, in step order) and per step of a set of whole episodes."""

    log_ratio: np.ndarray  # d_t after the clip, per token
    advantage: np.ndarray  # A_i + kl_coef · g_t · d_t, per token
    step_log_ratio: np.ndarray  # mean d_t per step (0 for a step of no token)
    step_raw_log_ratio: np.ndarray  # mean d_t before the clip
    step_term: np.ndarray  # mean of kl_coef · g_t · d_t per step
    a_macro: np.ndarray  # A_i per step


def step_means(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Mean of each step's run of ``counts[i]`` values (0 where a step has none). Each step's
    sum is its own (``reduceat``), not a difference of one running sum: a value cannot reach
    another step's mean, nor a long block's running sum round a short step's away."""
    sums = np.zeros(len(counts))
    some = counts > 0
    if some.any():
        starts = (np.cumsum(counts) - counts)[some]
        sums[some] = np.add.reduceat(np.asarray(values, dtype=np.float64), starts)
    return np.divide(sums, counts, out=np.zeros(len(counts)), where=some)


def log_ratio_credits(
    teacher: np.ndarray, student: np.ndarray, counts: np.ndarray, a_step: np.ndarray, params: LogRatioParams
) -> LogRatioArrays:
    """The module doc's values. ``teacher``/``student``: per-token logprobs, flat; ``counts``:
    tokens per step; ``a_step``: each step's A_i (its episode's GRPO advantage, or 0)."""
    raw = teacher.astype(np.float64) - student.astype(np.float64)
    d = raw if params.clip is None else np.clip(raw, -params.clip, params.clip)
    gate = 1.0 / (1.0 + np.exp(-d / params.gate_temperature)) if params.gate == "sigmoid" else 1.0
    term = params.kl_coef * gate * d
    advantage = np.repeat(a_step, counts) + term
    return LogRatioArrays(
        log_ratio=d,
        advantage=advantage,
        step_log_ratio=step_means(d, counts),
        step_raw_log_ratio=step_means(raw, counts),
        step_term=step_means(np.broadcast_to(term, d.shape), counts),
        a_macro=a_step,
    )


# ---- the two scorers ---------------------------------------------------------------------------


def _spec(conn: Connection, scorer_id: str) -> dict[str, Any]:
    spec = conn.execute(text("SELECT spec FROM scorers WHERE id = :id"), {"id": scorer_id}).scalar()
    return json.loads(spec) if spec else {}


def _weights(spec: dict[str, Any]) -> dict[str, Any]:
    b = spec.get("backend") or {}
    found = {k: b[k] for k in ("model", "model_sha256", "server_model", "weight_version") if b.get(k) is not None}
    if spec.get("weight_version") is not None:
        found["weight_version"] = spec["weight_version"]
    return found


def check_pair(teacher: dict[str, Any], student: dict[str, Any], allow_mixed: bool) -> list[str]:
    """Refuses two scorers whose tokens cannot be compared (another tokenizer or action span,
    always), or of another engine, dtype or weights (unless ``allow_mixed``: then those
    differences come back as warnings)."""
    tok_t = (teacher.get("tokenizer") or {}).get("files_sha256")
    tok_s = (student.get("tokenizer") or {}).get("files_sha256")
    if tok_t != tok_s:
        raise CreditError(
            f"--variant log-ratio: the two scorers use other tokenizers (files {str(tok_t)[:12]} vs "
            f"{str(tok_s)[:12]}): their per-token logprobs are of other tokens; score both with one tokenizer"
        )
    span_t, span_s = teacher.get("action_span", "rendered"), student.get("action_span", "rendered")
    if span_t != span_s:
        raise CreditError(
            f"--variant log-ratio: the two scorers score other action spans ({span_t} vs {span_s}); "
            "score both with the same --action-span"
        )
    bt, bs = teacher.get("backend") or {}, student.get("backend") or {}
    mixed = []
    engine_t, engine_s = bt.get("engine") or bt.get("kind"), bs.get("engine") or bs.get("kind")
    if engine_t != engine_s:  # a rollout scorer names the engine that sampled it
        mixed.append(f"engines {engine_t} vs {engine_s}")
    if bt.get("dtype") != bs.get("dtype"):
        mixed.append(f"dtypes {bt.get('dtype')} vs {bs.get('dtype')}")
    wt, ws = _weights(teacher), _weights(student)
    common = sorted(set(wt) & set(ws))
    if not common:
        mixed.append(f"weights (nothing to compare: {wt or 'none named'} vs {ws or 'none named'})")
    elif any(wt[k] != ws[k] for k in common):
        mixed.append("weights " + ", ".join(f"{k} {wt[k]} vs {ws[k]}" for k in common if wt[k] != ws[k]))
    if mixed and not allow_mixed:
        raise CreditError(
            "--variant log-ratio: the two scorers differ in " + "; ".join(mixed) + ": the precision gap "
            "between engines, dtypes or weight versions moves every log-ratio (slime #714); "
            "pass --allow-mixed to compute it anyway"
        )
    return [f"the two scorers differ in {m} (--allow-mixed)" for m in mixed]


# ---- the run -------------------------------------------------------------------------------------


def compute_log_ratio(
    store: Store,
    params: LogRatioParams = LogRatioParams(),
    *,
    scorer: str | None,
    against: str,
    name: str | None = None,
    allow_mixed: bool = False,
    replace: bool = False,
    episodes: Sequence[int] | None = None,
) -> ComputeResult:
    """Compute (or find) the log-ratio run of (teacher ``scorer``, student ``against``, params).
    ``episodes``: the run covers only these episode ids (a batch of ``follow`` or of TRL's
    ``StoreAdvantages``: its GRPO statistics are the batch's own); part of the run's identity,
    by the episodes' content, as ``compute_credits``' scoped runs."""
    started = time.perf_counter()
    scope = None if episodes is None else sorted({int(i) for i in episodes})
    with db.write(store.engine) as conn:
        teacher_id, _ = resolve_scorer(conn, scorer)
        try:
            student_id, _ = resolve_scorer(conn, against)
        except CreditError as exc:
            raise CreditError(str(exc).replace("--scorer", "--against", 1)) from exc
        if teacher_id == student_id:
            raise CreditError("--variant log-ratio: --scorer and --against name the same scorer: every ratio is 0")
        warnings = check_pair(_spec(conn, teacher_id), _spec(conn, student_id), allow_mixed)
        stored = params.as_dict(student_id)
        identity: dict[str, Any] = {"scorer_id": teacher_id, "variant": VARIANT, "params": stored}
        if scope is not None:
            identity["episodes"] = scope_identities(conn, scope)
        h = content_hash(identity, ascii_only=True)
        existing = find_run(conn, "r.run_hash = :h", h=h)
        if existing is not None and not replace:
            run_staleness(conn, existing)
            msg = f"credit run {existing.name!r} already has these scorers and parameters: returned it"
            if name is not None and name != existing.name:
                msg += f" (the name {name!r} was not used)"
            msg += f"; warning: {existing.stale}" if existing.stale else "; use --recompute to compute it again"
            return ComputeResult(existing, False, msg, seconds=time.perf_counter() - started)
        run_name = name or (existing.name if existing is not None else f"log-ratio-{h[:8]}")
        other = find_run(conn, "r.name = :n", n=run_name)
        if other is not None and other.run_hash != h:
            raise CreditError(f"the name {run_name!r} is already used by another credit run; pick another --name")
        if existing is not None:
            for table in ("token_credits", "credits"):
                conn.execute(text(f"DELETE FROM {table} WHERE run_id = :id"), {"id": existing.id})
            conn.execute(text("DELETE FROM credit_runs WHERE id = :id"), {"id": existing.id})
        run_id = insert_run(conn, run_name, teacher_id, stored, VARIANT, h, scope)
        if run_id is None:  # another writer (a second follower on the same batch) stored it first
            raced = find_run(conn, "r.run_hash = :h", h=h)
            if raced is None:
                raise CreditError(f"the name {run_name!r} is already used by another credit run; pick another --name")
            msg = f"credit run {raced.name!r} already has these scorers and parameters: returned it"
            return ComputeResult(raced, False, msg, seconds=time.perf_counter() - started)
        n_episodes, steps, incomplete = _fill(conn, run_id, teacher_id, student_id, params, warnings, scope)
        if n_episodes == 0:
            raise CreditError(
                f"no episode is completely scored under both scorers {teacher_id[:12]} and {student_id[:12]} "
                f"({len(incomplete)} incomplete): nothing to credit, no run stored; score the missing steps first"
            )
        conn.execute(
            text(
                "UPDATE credit_runs SET episodes = :e, steps = :s, incomplete_episodes = :ni, "
                "incomplete = :inc WHERE id = :id"
            ),
            {"e": n_episodes, "s": steps, "ni": len(incomplete), "inc": json.dumps(incomplete[:10_000]), "id": run_id},
        )
        run = find_run(conn, "r.id = :id", id=run_id)
    assert run is not None
    verb = "recomputed" if existing is not None else "computed"
    msg = (
        f"{verb} log-ratio credit run {run.name!r}: {run.steps} steps of {run.episodes} episodes"
        f"; {run.incomplete_episodes} incomplete episode(s) skipped"
    )
    for warning in warnings:
        msg += f"; warning: {warning}"
    return ComputeResult(run, True, msg, seconds=time.perf_counter() - started)


def _fill(
    conn: Connection,
    run_id: int,
    teacher_id: str,
    student_id: str,
    params: LogRatioParams,
    warnings: list[str],
    scope: Sequence[int] | None = None,
) -> tuple[int, int, list[str]]:
    """Pass 1 finds the complete episodes (and refuses a step scored over other tokens); pass 2
    streams the blobs and writes each block's credits: memory is one block's, whatever the store."""
    bind = {"teacher": teacher_id, "student": student_id}
    where = scope_sql(scope)
    complete: dict[int, float] = {}  # episode id -> reward
    incomplete: list[str] = []
    for ep_id, ep_name, reward, n, n_teacher, n_student, other in conn.execute(
        text(COUNTS_SQL.format(scope=where)), bind
    ):
        if n_teacher < n or n_student < n:
            incomplete.append(ep_name)
        elif other:
            _refuse_other_tokens(conn, bind, int(ep_id), ep_name)
        else:
            complete[int(ep_id)] = float(reward)
    if not complete:
        return 0, 0, incomplete
    ids = list(complete)
    if params.grpo:
        groups = _groups(conn, ids, params.group_by, warnings)
        a_by_episode = dict(zip(ids, grpo_advantages(np.asarray(list(complete.values())), groups).tolist()))
    else:
        a_by_episode = dict.fromkeys(ids, 0.0)
    credit_sql, token_sql = (
        _insert_sql(conn, "credits", CREDIT_COLUMNS),
        _insert_sql(conn, "token_credits", TOKEN_COLUMNS),
    )
    steps = 0
    for block in _raw_stream(conn, text(STREAM_SQL.format(scope=where)), bind):
        rows = [r for r in block if r[0] in a_by_episode]
        if rows:
            _write_block(conn, run_id, rows, a_by_episode, complete, params, credit_sql, token_sql)
            steps += len(rows)
    return len(complete), steps, incomplete


def _refuse_other_tokens(conn: Connection, bind: dict[str, Any], episode_id: int, name: str) -> None:
    for r in conn.execute(text(OTHER_TOKENS_SQL), {**bind, "episode": episode_id}):
        if tuple(r[1:4]) != tuple(r[4:7]):
            raise CreditError(
                f"--variant log-ratio: episode {name} step {r[0]}: the two scorers scored other tokens "
                f"(teacher {r[1]} of {r[2]} action tokens, {r[3]} skipped; student {r[4]} of {r[5]}, "
                f"{r[6]} skipped): score both with the same --action-span, --max-context and "
                "--max-logprob-tokens"
            )


def _write_block(
    conn: Connection,
    run_id: int,
    rows: list[Any],
    a_by_episode: dict[int, float],
    rewards: dict[int, float],
    params: LogRatioParams,
    credit_sql: str,
    token_sql: str,
) -> None:
    """One block's credits and per-token values, written in two ``executemany``: the arithmetic
    is numpy's over the block's tokens at once; per row only the slicing of the two blobs."""
    n_rows = len(rows)
    episode, step_id, t_blob, count_col, t_mean_col, s_blob = zip(*rows)
    counts = np.fromiter(count_col, dtype=np.int64, count=n_rows)
    teacher = np.frombuffer(b"".join(t_blob), dtype="<f4")
    student = np.frombuffer(b"".join(s_blob), dtype="<f4")
    if len(teacher) != int(counts.sum()) or len(student) != len(teacher):
        raise CreditError("--variant log-ratio: a stored score's values do not match its token count")
    bad = ~(np.isfinite(teacher) & np.isfinite(student))
    if bad.any():  # the scorers refuse these; a store written otherwise gets one line, not a NULL credit
        row = int(np.searchsorted(np.cumsum(counts), int(np.flatnonzero(bad)[0]), side="right"))
        raise CreditError(
            f"--variant log-ratio: step id {step_id[row]}'s stored score holds a logprob that is not finite "
            "(`score` refuses such values: it was written another way); credit scorers whose scores are finite"
        )
    a_step = np.fromiter((a_by_episode[e] for e in episode), dtype=np.float64, count=n_rows)
    arr = log_ratio_credits(teacher, student, counts, a_step, params)
    t_mean = np.fromiter(t_mean_col, dtype=np.float64, count=n_rows)
    columns = [
        step_id,
        t_mean,  # mean_logprob: the teacher's, as an HCAPO run stores its scorer's
        counts,  # token_count
        np.exp(t_mean),  # pi_hind
        np.exp(arr.step_raw_log_ratio),  # rho_raw: the step's geometric-mean ratio π_teacher / π_student
        np.exp(arr.step_log_ratio),  # rho: the same after the clip
        [rewards[e] for e in episode],  # r_t: the episode's reward
        np.ones(n_rows),  # discount: none
        arr.step_log_ratio,  # q_h: mean d_t
        arr.step_log_ratio,  # q_h_smoothed: no smoothing
        arr.a_macro,  # A_i (0 without --grpo)
        arr.step_term,  # micro: mean kl_coef · g_t · d_t
        arr.a_macro + arr.step_term,  # advantage: the mean of the per-token advantages
    ]
    run = [run_id] * n_rows
    conn.exec_driver_sql(credit_sql, list(zip(run, *(c.tolist() if isinstance(c, np.ndarray) else c for c in columns))))
    # per step, its bytes of the two float32 arrays (4 bytes per token)
    ends = (np.cumsum(counts) * 4).tolist()
    starts = [0, *ends[:-1]]
    lr, adv = arr.log_ratio.astype("<f4").tobytes(), arr.advantage.astype("<f4").tobytes()
    conn.exec_driver_sql(
        token_sql,
        list(
            zip(
                run,
                step_id,
                counts.tolist(),
                [lr[a:b] for a, b in zip(starts, ends)],
                [adv[a:b] for a, b in zip(starts, ends)],
            )
        ),
    )


TOKEN_COLUMNS = ("run_id", "step_id", "token_count", "log_ratios", "advantages")


def _insert_sql(conn: Connection, table: str, columns: Sequence[str]) -> str:
    style = conn.dialect.paramstyle
    marks = ["?" if style == "qmark" else f":{i + 1}" if style == "numeric" else "%s" for i in range(len(columns))]
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(marks)})"


def _groups(conn: Connection, episode_ids: list[int], tag: str | None, warnings: list[str]) -> list[Any] | None:
    if tag is None:
        return None
    values: dict[int, str] = dict(
        conn.execute(text("SELECT episode_id, value FROM tags WHERE key = :k"), {"k": tag}).all()
    )
    groups = [values.get(e) for e in episode_ids]
    if all(g is None for g in groups):
        raise CreditError(f"--group-by {tag}: no credited episode has this tag; tag the episodes at ingest")
    if None in groups:
        warnings.append(f"--group-by {tag}: {groups.count(None)} episode(s) lack this tag and form one group")
    return groups
