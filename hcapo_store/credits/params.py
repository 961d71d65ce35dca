"""The hyperparameters of a credit run, kept apart from the math (no numpy) so that the
CLI takes its option defaults from them without loading the numerical stack."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from hcapo_store.errors import InvalidCreditParams

VARIANTS = ("original", "paper")

# The one line a dense run over steps without any subtask reward is refused with.
NO_SUBTASK_REWARDS = (
    "dense rewards (--dense-rewards) need subtask rewards, and no step of this run has one (outcome-only "
    "rollouts): every return and hindsight term would be 0; use --no-dense-rewards (terminal rewards) or "
    "--variant paper"
)
# What a run records when it chose terminal rewards itself (dense was not asked for).
TERMINAL_NOTE = (
    "terminal rewards: no step has a subtask reward, so the original's dense return would be 0 on every "
    "step (--dense-rewards asks for it and is refused on such data)"
)


@dataclass(frozen=True)
class CreditParams:
    """Hyperparameters of a credit run (defaults = the original script's defaults), the one
    home of every default: the CLI, ``follow`` and the trainer hooks read them from here.

    ``variant``: ``original`` (the scripts' Eq. 5–8, docs/ORIGINAL.md) or ``paper``
    (Algorithm 1 of the paper, ``credits/paper.py``). ``omega`` and ``group_by`` shape the
    stored advantage of both; ``min_reward`` selects the episodes an original run's
    advantages are computed over (those the default export keeps); ``success_threshold`` is
    the paper's do-no-harm test (reward >= X is a success).

    ``dense``: a step's return is its subtask's score (True) or the episode's reward
    (False: terminal). ``None`` (the default) means "by the variant and the data": the
    original's dense returns (``dense_default``), the paper's terminal one; and where no step
    of the run has a subtask reward, terminal (``compute_credits`` records its choice: the
    dense return of such data is zero on every step). A run given ``dense=True`` over such
    data is refused (``refuse_dense_without_subtask_rewards``).
    """

    t_temp: float = 5.0
    gamma: float = 0.95
    c_min: float = 0.8
    c_max: float = 1.2
    alpha: float = 0.5
    smooth: bool = True
    dense: bool | None = None  # None: dense_default (by the variant), terminal without subtask rewards
    max_logprob_tokens: int | None = None  # None: the stored span's mean
    variant: str = "original"
    omega: float = 1.0
    group_by: str | None = None
    min_reward: float = 0.2
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise InvalidCreditParams(f"variant (--variant) must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        _check("omega", self.omega, math.isfinite(self.omega), "a finite number")
        _check("min_reward", self.min_reward, math.isfinite(self.min_reward), "a finite number")
        _check("success_threshold", self.success_threshold, math.isfinite(self.success_threshold), "a finite number")
        if self.group_by is not None and not str(self.group_by).strip():
            raise InvalidCreditParams("group_by (--group-by) must name a tag, got an empty string")
        # NaN fails every comparison, so each check is written as "inside the range".
        _check("t_temp", self.t_temp, self.t_temp > 0 and math.isfinite(self.t_temp), "a finite number > 0")
        _check("gamma", self.gamma, 0.0 <= self.gamma <= 1.0, "in [0, 1]")
        _check("c_min", self.c_min, 0.0 <= self.c_min and math.isfinite(self.c_min), "a finite number >= 0")
        _check(
            "c_max",
            self.c_max,
            self.c_min <= self.c_max and math.isfinite(self.c_max),
            f"a finite number >= c_min ({self.c_min:g})",
        )
        _check("alpha", self.alpha, 0.0 <= self.alpha <= 1.0, "in [0, 1]")
        mlt = self.max_logprob_tokens
        _check(
            "max_logprob_tokens",
            mlt,
            mlt is None or (isinstance(mlt, int) and not isinstance(mlt, bool)),
            "an integer (<= 0 or none: all stored tokens)",
        )
        # The original treats <= 0 as "all tokens": normalise so both hash the same.
        if self.max_logprob_tokens is not None and self.max_logprob_tokens <= 0:
            object.__setattr__(self, "max_logprob_tokens", None)

    @property
    def dense_default(self) -> bool:
        """The return a variant uses when not asked: dense for ``original`` (the scripts'),
        terminal for ``paper`` (Algorithm 1)."""
        return self.variant == "original"

    @property
    def uses_dense(self) -> bool:
        """Whether this run's return is dense (``dense``, or the variant's default)."""
        return self.dense_default if self.dense is None else bool(self.dense)

    def for_data(self, has_subtask_rewards: bool) -> tuple[CreditParams, str | None]:
        """These parameters with ``dense`` decided for data that has (or lacks) subtask
        rewards, and the note that says what was chosen when it was not asked (else None).

        Asked for dense over data without a single subtask reward: refused in one line (every
        return, Q_H and hindsight term would be zero)."""
        if self.dense is not None:
            if self.dense and not has_subtask_rewards:
                raise InvalidCreditParams(NO_SUBTASK_REWARDS)
            return self, None
        if self.dense_default and not has_subtask_rewards:
            return replace(self, dense=False), TERMINAL_NOTE
        return replace(self, dense=self.dense_default), None

    def as_dict(self) -> dict[str, Any]:
        """The run's parameters as stored and hashed. Fields added after the first release are
        left out at their defaults, so a run computed before keeps its hash and name."""
        d = asdict(self)
        d["dense"] = self.uses_dense  # the run's return as it was computed
        for k in ("t_temp", "gamma", "c_min", "c_max", "alpha", "omega", "min_reward", "success_threshold"):
            d[k] = float(d[k])
        if self.variant == "original":
            for k in ("variant", "success_threshold"):
                del d[k]
            for k, default in (("omega", 1.0), ("group_by", None), ("min_reward", 0.2)):
                if d[k] == default:
                    del d[k]
        else:
            del d["min_reward"]  # the paper keeps every episode
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CreditParams:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @property
    def is_default(self) -> bool:
        """The parameters of a run no option changed (``dense`` left to the variant and data)."""
        return replace(self, dense=None) == CreditParams() and self.dense in (None, self.dense_default)


def _check(name: str, value: Any, ok: bool, valid: str) -> None:
    if not ok:
        flag = name.replace("_", "-")
        raise InvalidCreditParams(f"{name} (--{flag}) must be {valid}, got {value!r}")
