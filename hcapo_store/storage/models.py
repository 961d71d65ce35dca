"""Typed SQLAlchemy 2.0 models: the schema of a hcapo-store database.

The schema changes only through Alembic revisions in ``migrations/versions``; those
revisions never import this module (they are frozen history). ``tests/test_migrations.py``
checks that the models and the revisions agree.

Times that leases are judged by are epoch seconds (floats) so that SQLite and
PostgreSQL compare them the same way; bookkeeping times are ISO text.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


TAG_KEY_LENGTH = 200
WORKER_ID_LENGTH = 200


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Episode(Base):
    """One version of one trajectory. A changed source becomes a new row (version + 1).

    ``source_key`` is the episode's identity, independent of where its files sit, and
    ``name`` its unique readable name; all versions share both (ingestion/episode_keys.py).
    """

    __tablename__ = "episodes"
    __table_args__ = (
        UniqueConstraint("source_key", "version"),
        # With versions numbered from 1 per key, a name belongs to one key only.
        Index("ix_episodes_name_version", "name", "version", unique=True),
        Index("ix_episodes_current", "is_current", "source_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_key: Mapped[str] = mapped_column(Text)
    source_path: Mapped[str | None] = mapped_column(Text)  # the directory or file this version was read from
    version: Mapped[int] = mapped_column(Integer)
    is_current: Mapped[bool] = mapped_column(Boolean, default=True)
    content_hash: Mapped[str] = mapped_column(String(64))
    source_format: Mapped[str] = mapped_column(String(32))
    external_id: Mapped[str | None] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    reward: Mapped[float] = mapped_column(Float)
    phase: Mapped[str | None] = mapped_column(Text)
    plan_score: Mapped[float | None] = mapped_column(Float)
    frozen_scores: Mapped[str] = mapped_column(Text)  # JSON object id -> score
    turns: Mapped[int | None] = mapped_column(Integer)
    tool_call_count: Mapped[int | None] = mapped_column(Integer)
    reward_backfilled: Mapped[bool] = mapped_column(Boolean, default=False)
    include_thinking: Mapped[bool] = mapped_column(Boolean)
    max_tool_result_chars: Mapped[int] = mapped_column(Integer)
    num_messages: Mapped[int] = mapped_column(Integer)
    num_steps: Mapped[int] = mapped_column(Integer)
    warnings: Mapped[str | None] = mapped_column(Text)  # JSON list of ingest warnings
    raw_source: Mapped[bytes] = mapped_column(LargeBinary)  # zlib-compressed JSON of the inputs
    ingested_at: Mapped[str] = mapped_column(String(40))


class Tag(Base):
    """Free labels (task=postgres, run=pg-01) for SQL filters and export grouping."""

    __tablename__ = "tags"

    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(TAG_KEY_LENGTH), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Subtask(Base):
    """One item of the episode's plan (from result.json), with its final frozen score."""

    __tablename__ = "subtasks"
    __table_args__ = (UniqueConstraint("episode_id", "position"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    subtask_id: Mapped[str] = mapped_column(Text)
    description: Mapped[str | None] = mapped_column(Text)
    acceptance_criteria: Mapped[str | None] = mapped_column(Text)
    frozen_score: Mapped[float | None] = mapped_column(Float)


class Message(Base):
    """The converted message list (the original loader's output, with its fixes)."""

    __tablename__ = "messages"
    __table_args__ = (UniqueConstraint("episode_id", "message_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"))
    message_index: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    tool_calls: Mapped[str | None] = mapped_column(Text)  # JSON list, OpenAI shape
    name: Mapped[str | None] = mapped_column(Text)
    tool_call_id: Mapped[str | None] = mapped_column(Text)


class Step(Base):
    """One assistant message: the unit that gets a hindsight score and a credit."""

    __tablename__ = "steps"
    __table_args__ = (UniqueConstraint("episode_id", "step_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"))
    step_index: Mapped[int] = mapped_column(Integer)
    message_index: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(16))
    subtask_id: Mapped[str | None] = mapped_column(Text)
    subtask_reward: Mapped[float | None] = mapped_column(Float)


class Scorer(Base):
    """Everything that determines a step's logprobs, as canonical JSON; id = its hash."""

    __tablename__ = "scorers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    label: Mapped[str] = mapped_column(Text)
    spec: Mapped[str] = mapped_column(Text)
    created_at: Mapped[str] = mapped_column(String(40))


class Score(Base):
    """A successful result for (step, scorer). Failures never land here."""

    __tablename__ = "scores"
    __table_args__ = (
        UniqueConstraint("step_id", "scorer_id"),
        Index("ix_scores_scorer_step", "scorer_id", "step_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id", ondelete="CASCADE"))
    scorer_id: Mapped[str] = mapped_column(ForeignKey("scorers.id", ondelete="CASCADE"))
    token_logprobs: Mapped[bytes] = mapped_column(LargeBinary)  # little-endian float32
    token_count: Mapped[int] = mapped_column(Integer)
    mean_logprob: Mapped[float] = mapped_column(Float)
    total_action_tokens: Mapped[int] = mapped_column(Integer)
    skipped_action_tokens: Mapped[int] = mapped_column(Integer)
    truncated_prefix_tokens: Mapped[int] = mapped_column(Integer)
    input_tokens: Mapped[int] = mapped_column(Integer)
    logprob_start_len: Mapped[int] = mapped_column(Integer)
    flattened: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_s: Mapped[float | None] = mapped_column(Float)
    server_model: Mapped[str | None] = mapped_column(Text)
    worker_id: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[str] = mapped_column(String(40))
    # This step's share of its request's tokens sent / reported cached (they add up per request).
    sent_tokens: Mapped[int | None] = mapped_column(Integer)
    sent_cached_tokens: Mapped[int | None] = mapped_column(Integer)


class EpisodeFloor(Base):
    """Per scorer and episode: the conversation's tokens (the prefill floor of scoring it)."""

    __tablename__ = "episode_floors"

    scorer_id: Mapped[str] = mapped_column(ForeignKey("scorers.id", ondelete="CASCADE"), primary_key=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    conversation_tokens: Mapped[int] = mapped_column(Integer)


class TokenizerLocation(Base):
    """A directory a tokenizer with these files was loaded from (to find it again unasked)."""

    __tablename__ = "tokenizer_locations"

    files_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str] = mapped_column(String(4096), primary_key=True)
    seen_at: Mapped[str] = mapped_column(String(40))


class Attempt(Base):
    """The queue row of (step, scorer): state, lease and the last error.

    status: pending → leased → done | failed (after the attempt limit); an expired
    lease is reclaimable by any worker.
    """

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("step_id", "scorer_id"),
        Index("ix_attempts_claim", "scorer_id", "status", "lease_expires_at"),
        # An episode filter's rows and a worker's leases, by index (migration 0007).
        Index("ix_attempts_episode", "episode_id", "scorer_id", "status", "lease_expires_at"),
        Index("ix_attempts_lease_owner", "lease_owner"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id", ondelete="CASCADE"))
    scorer_id: Mapped[str] = mapped_column(ForeignKey("scorers.id", ondelete="CASCADE"))
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"))
    step_index: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    lease_owner: Mapped[str | None] = mapped_column(Text)
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    last_error_kind: Mapped[str | None] = mapped_column(String(64))
    last_error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[float] = mapped_column(Float)


class AttemptError(Base):
    """Every failed attempt, kept for diagnosis (kind, message, time, worker)."""

    __tablename__ = "attempt_errors"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    worker_id: Mapped[str | None] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)


class Worker(Base):
    """A live or finished ``score`` process, for ``status`` (last heartbeat, leases)."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(WORKER_ID_LENGTH), primary_key=True)
    scorer_id: Mapped[str | None] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16))
    scored: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)


class CreditRun(Base):
    """(scorer, hyperparameters) → credits. Same inputs hash to the same run."""

    __tablename__ = "credit_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    scorer_id: Mapped[str] = mapped_column(ForeignKey("scorers.id", ondelete="CASCADE"))
    params: Mapped[str] = mapped_column(Text)  # canonical JSON of the hyperparameters
    run_hash: Mapped[str] = mapped_column(String(64), unique=True)
    episodes: Mapped[int] = mapped_column(Integer, default=0)
    steps: Mapped[int] = mapped_column(Integer, default=0)
    incomplete_episodes: Mapped[int] = mapped_column(Integer, default=0)
    incomplete: Mapped[str | None] = mapped_column(Text)  # JSON list of incomplete episode ids
    created_at: Mapped[str] = mapped_column(String(40))
    # original | paper (docs/CREDITS.md); runs from before revision 0003 read as original
    variant: Mapped[str] = mapped_column(String(16), server_default="original")
    # JSON list of the episode ids a batch's run covers (follow); NULL: every complete episode
    episode_scope: Mapped[str | None] = mapped_column(Text)
    # JSON of credits/signal.py's CreditSignal (hindsight term non-zero share, advantage spread);
    # NULL for runs from before revision 0008 (measured from their credits when read)
    signal: Mapped[str | None] = mapped_column(Text)


class Credit(Base):
    """Per-step result of a credit run (Eq. 5–7)."""

    __tablename__ = "credits"
    __table_args__ = (Index("ix_credits_step", "step_id"),)

    run_id: Mapped[int] = mapped_column(ForeignKey("credit_runs.id", ondelete="CASCADE"), primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id", ondelete="CASCADE"), primary_key=True)
    mean_logprob: Mapped[float] = mapped_column(Float)
    token_count: Mapped[int] = mapped_column(Integer)
    pi_hind: Mapped[float] = mapped_column(Float)
    rho_raw: Mapped[float] = mapped_column(Float)
    rho: Mapped[float] = mapped_column(Float)
    r_t: Mapped[float] = mapped_column(Float)
    discount: Mapped[float] = mapped_column(Float)
    q_h: Mapped[float] = mapped_column(Float)
    q_h_smoothed: Mapped[float] = mapped_column(Float)
    # The advantage and its parts (NULL for runs from before revision 0003, and for an
    # original run's episodes below its min_reward, which the default export leaves out).
    a_macro: Mapped[float | None] = mapped_column(Float)
    micro: Mapped[float | None] = mapped_column(Float)
    advantage: Mapped[float | None] = mapped_column(Float)


class Batch(Base):
    """A batch `follow` published: the episodes sharing a key, credited together (a change feed)."""

    __tablename__ = "batches"
    __table_args__ = (UniqueConstraint("batch_hash", name="uq_batches_batch_hash"), Index("ix_batches_key", "key"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(500))
    batch_hash: Mapped[str] = mapped_column(String(64))  # scorer + parameters + episode versions
    status: Mapped[str] = mapped_column(String(16))  # ready | superseded
    episodes: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)
    scored: Mapped[int] = mapped_column(Integer)
    failed: Mapped[int] = mapped_column(Integer)
    failed_episodes: Mapped[str | None] = mapped_column(Text)  # JSON list of names
    scorer_id: Mapped[str] = mapped_column(ForeignKey("scorers.id", ondelete="CASCADE"))
    credit_run_id: Mapped[int | None] = mapped_column(ForeignKey("credit_runs.id", ondelete="SET NULL"))
    credit_run: Mapped[str | None] = mapped_column(String(200))
    weight_version: Mapped[str | None] = mapped_column(String(200))
    complete_at: Mapped[str] = mapped_column(String(40))
    ready_at: Mapped[str] = mapped_column(String(40))
    lag_s: Mapped[float | None] = mapped_column(Float)
    superseded_by: Mapped[int | None] = mapped_column(Integer)


class BatchEpisode(Base):
    __tablename__ = "batch_episodes"

    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)


class TokenCredit(Base):
    """Per-token values of a ``log-ratio`` credit run (migration 0009, docs/FAMILY.md): one
    little-endian float32 per scored token of the step, in the scored order."""

    __tablename__ = "token_credits"

    run_id: Mapped[int] = mapped_column(ForeignKey("credit_runs.id", ondelete="CASCADE"), primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id", ondelete="CASCADE"), primary_key=True)
    token_count: Mapped[int] = mapped_column(Integer)
    log_ratios: Mapped[bytes] = mapped_column(LargeBinary)  # log π_teacher − log π_student
    advantages: Mapped[bytes] = mapped_column(LargeBinary)  # what the trainers' hand-offs place


class TopkScore(Base):
    """The K most likely ids and their logprobs at every scored position of a step (``score
    --top-k K``, migration 0009): int32 ids and float16 logprobs, token_count × K, position-major."""

    __tablename__ = "topk_scores"

    scorer_id: Mapped[str] = mapped_column(ForeignKey("scorers.id", ondelete="CASCADE"), primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id", ondelete="CASCADE"), primary_key=True)
    k: Mapped[int] = mapped_column(Integer)
    token_count: Mapped[int] = mapped_column(Integer)
    ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
