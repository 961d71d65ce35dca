"""The hyperparameters of a credit run, kept apart from the math (no numpy) so that the
CLI takes its option defaults from them without loading the numerical stack."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hcapo_store.errors import InvalidCreditParams

VARIANTS = ("original", "paper")


@dataclass(frozen=True)
class CreditParams:
    """Hyperparameters of a credit run (defaults = the original script's defaults).

    ``variant``: ``original`` (the scripts' Eq. 5–8, docs/ORIGINAL.md) or ``paper``
    (Algorithm 1 of the paper, ``credits/paper.py``). ``omega`` and ``group_by`` shape the
    stored advantage of both; ``min_reward`` selects the episodes an original run's
    advantages are computed over (those the default export keeps); ``success_threshold`` is
    the paper's do-no-harm test (reward >= X is a success).
    """

    t_temp: float = 5.0
    gamma: float = 0.95
    c_min: float = 0.8
    c_max: float = 1.2
    alpha: float = 0.5
    smooth: bool = True
    dense: bool = True
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

    def as_dict(self) -> dict[str, Any]:
        """The run's parameters as stored and hashed. Fields added after the first release are
        left out at their defaults, so a run computed before keeps its hash and name."""
        d = asdict(self)
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
        return self == CreditParams()


def _check(name: str, value: Any, ok: bool, valid: str) -> None:
    if not ok:
        flag = name.replace("_", "-")
        raise InvalidCreditParams(f"{name} (--{flag}) must be {valid}, got {value!r}")
