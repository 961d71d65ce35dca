"""Whether HCAPO's hindsight signal is in a credit run's advantages: ``CreditSignal``.

A run's advantage is the group (macro) term A_i plus ω times the hindsight (micro) term, the
z-scored Q_H. On data where every Q_H is the same (outcome-only rollouts under dense returns,
ω = 0) the hindsight term is zero on every step and the advantage is GRPO's alone, which no
equality between two trainer paths would notice. So every run measures, when it is computed
(``credit_runs.signal``), and every place advantages leave the store reports:

- the share of credited steps whose hindsight term ω·micro is non-zero;
- the spread of advantages within an episode (the population standard deviation of each
  episode's step advantages, averaged over episodes) and how many episodes' advantages vary.

- the steps whose ratio ρ_raw is not 1: where the stored hindsight scores reach the credit at
  all. The ratio is over an episode's own steps, so on one-step episodes (single-turn GRPO) it
  is 1 everywhere, and the hindsight term is then the return's z-score (GRPO's term again,
  whatever the policy scored).

``plain_grpo``: the hindsight term is zero on every step, or no step's ratio moves off 1, while
some advantage is not: what a trainer hook refuses unless its caller opts into plain GRPO by
name (``allow_zero_hindsight``).
A run whose advantages are all zero (every reward of a group the same) carries no signal of
either kind and is not refused: plain GRPO gives the same zeros.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, text

NONZERO = 1e-9  # |value| above this counts as non-zero (z-scores are O(1); float noise is ~1e-16)

# The name a caller passes to train on a run without a hindsight term (plain GRPO), everywhere.
OPT_IN = "allow_zero_hindsight"


@dataclass(frozen=True)
class CreditSignal:
    """The hindsight signal of a set of credited steps (a run, a batch, an export)."""

    steps: int  # steps with an advantage
    hindsight_nonzero_steps: int  # of them, those whose hindsight term ω·micro is non-zero
    advantage_nonzero_steps: int  # of them, those whose advantage is non-zero
    episodes: int  # episodes with an advantage
    varying_episodes: int  # of them, those whose step advantages are not all equal
    advantage_spread: float  # mean over episodes of the std of the episode's step advantages
    note: str | None = None  # what the run chose itself (e.g. terminal rewards on outcome-only data)
    # of the steps, those whose ratio rho_raw is not 1 and weighs a return that is not 0 (only
    # there can the scores move Q_H = rho * G); None: not measured, a record from before
    ratio_varying_steps: int | None = None

    @property
    def scores_unused(self) -> bool:
        """No step's ratio moves off 1 where its return is not 0: the hindsight scores reach no advantage."""
        return self.ratio_varying_steps == 0 and self.steps > 0

    @property
    def hindsight_share(self) -> float:
        if self.scores_unused:
            return 0.0
        return self.hindsight_nonzero_steps / self.steps if self.steps else 0.0

    @property
    def zero(self) -> bool:
        """The hindsight term is zero on every step, or carries none of the scores."""
        return self.hindsight_nonzero_steps == 0 or self.scores_unused

    @property
    def plain_grpo(self) -> bool:
        """No hindsight term anywhere, yet advantages: the group term alone (plain GRPO)."""
        return self.zero and self.advantage_nonzero_steps > 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hindsight_share": round(self.hindsight_share, 6)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> CreditSignal | None:
        if not d:
            return None
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def text(self) -> str:
        """One line: ``hindsight term non-zero on 24 of 24 steps (100%); ...`` or ``... zero ...``."""
        if not self.steps:
            return "hindsight term: no step has an advantage"
        if self.scores_unused and self.hindsight_nonzero_steps:
            head = (
                f"hindsight scores reach no advantage: the ratio rho is 1, or weighs a return of 0, on all "
                f"{self.steps} steps (one step per episode, steps that all scored the same: the ratio compares an "
                "episode's own steps, or longer episodes only where their reward is 0), so the hindsight term is "
                "the return's z-score"
            )
            head += ": the advantage is GRPO's group term alone" if self.plain_grpo else ""
        elif self.zero:
            head = f"hindsight term zero on all {self.steps} steps"
            head += (
                ": the advantage is GRPO's group term alone"
                if self.plain_grpo
                else ": every advantage is 0 (no reward spread)"
            )
        else:
            head = (
                f"hindsight term non-zero on {self.hindsight_nonzero_steps} of {self.steps} steps "
                f"({100 * self.hindsight_share:.0f}%)"
            )
        spread = (
            f"; advantage spread within an episode {self.advantage_spread:.4g} "
            f"({self.varying_episodes} of {self.episodes} episodes vary)"
        )
        if self.ratio_varying_steps is not None and not self.scores_unused:
            spread += f"; ratio rho off 1 on {self.ratio_varying_steps} of {self.steps} steps (of non-zero return)"
        return head + spread + (f"; {self.note}" if self.note else "")

    def refusal(self, what: str) -> str:
        """The one line a trainer hook refuses a plain-GRPO batch with."""
        if self.scores_unused and self.hindsight_nonzero_steps:
            return (
                f"{what}: the ratio rho is 1, or weighs a return of 0, on all {self.steps} steps, so the hindsight "
                "scores reach no advantage and it is GRPO's group term alone: HCAPO's ratio compares an episode's "
                "own steps, and these episodes have one step each (single-turn rollouts: give them their earlier "
                "turns, a multi-turn prompt or tool calls), steps that all scored the same, or more steps only where "
                "the reward is 0; pass "
                f"{OPT_IN}=True to train plain GRPO on purpose"
            )
        return (
            f"{what}: hindsight term zero on all {self.steps} steps, the advantages are GRPO's group term alone "
            "(outcome-only rollouts credited with dense rewards, or omega 0?): recompute with terminal rewards "
            f"(--variant paper / --no-dense-rewards), or pass {OPT_IN}=True to train plain GRPO on purpose"
        )


def measure(
    episode: np.ndarray,
    micro: np.ndarray,
    advantage: np.ndarray,
    omega: float = 1.0,
    note: str | None = None,
    rho_raw: np.ndarray | None = None,
    q_h: np.ndarray | None = None,
) -> CreditSignal:
    """The signal of per-step arrays (one entry per step, ``episode`` any per-episode key, steps of
    an episode adjacent). Steps without an advantage (NaN: an original run's unselected episodes)
    are left out. ``rho_raw``: each step's ratio before the clip (None: not counted); ``q_h``: each
    step's rho * G before smoothing (a ratio off 1 counts only where it is not 0: it weighs nothing
    on a return of 0, e.g. every step of a reward-0 episode under terminal returns)."""
    episode = np.asarray(episode)
    micro = np.asarray(micro, dtype=np.float64)
    advantage = np.asarray(advantage, dtype=np.float64)
    keep = np.isfinite(advantage)
    episode, micro, advantage = episode[keep], micro[keep], advantage[keep]
    varying = None
    if rho_raw is not None:
        ratio = np.asarray(rho_raw, dtype=np.float64)[keep]
        moves = np.abs(ratio - 1.0) > NONZERO
        if q_h is not None:
            moves &= np.abs(np.asarray(q_h, dtype=np.float64)[keep]) > NONZERO
        varying = int(moves.sum())
    hind = np.nan_to_num(omega * micro, nan=0.0)
    if len(episode):
        starts = np.flatnonzero(np.concatenate(([True], episode[1:] != episode[:-1])))
        counts = np.diff(np.append(starts, len(episode)))
        mean = np.add.reduceat(advantage, starts) / counts
        var = np.add.reduceat((advantage - np.repeat(mean, counts)) ** 2, starts) / counts
        std = np.sqrt(var)
        std[std <= NONZERO] = 0.0  # float noise of equal values is no spread
    else:
        std = np.zeros(0)
    return CreditSignal(
        steps=int(len(advantage)),
        hindsight_nonzero_steps=int((np.abs(hind) > NONZERO).sum()),
        advantage_nonzero_steps=int((np.abs(advantage) > NONZERO).sum()),
        episodes=int(len(std)),
        varying_episodes=int((std > NONZERO).sum()),
        advantage_spread=float(std.mean()) if len(std) else 0.0,
        note=note,
        ratio_varying_steps=varying,
    )


RUN_STEPS_SQL = """
SELECT s.episode_id, c.micro, c.advantage, c.rho_raw, c.q_h FROM credits c JOIN steps s ON s.id = c.step_id
WHERE c.run_id = :run ORDER BY s.episode_id, s.step_index
"""


def measure_run(conn: Connection, run_id: int, omega: float = 1.0, note: str | None = None) -> CreditSignal | None:
    """A stored run's signal, read from its credits (runs from before revision 0003 have no
    stored advantages: None)."""
    rows = conn.execute(text(RUN_STEPS_SQL), {"run": run_id}).all()
    if not rows or all(r[2] is None for r in rows):
        return None
    ep = np.asarray([r[0] for r in rows], dtype=np.int64)
    micro = np.asarray([np.nan if r[1] is None else r[1] for r in rows], dtype=np.float64)
    adv = np.asarray([np.nan if r[2] is None else r[2] for r in rows], dtype=np.float64)
    rho = np.asarray([np.nan if r[3] is None else r[3] for r in rows], dtype=np.float64)
    q_h = np.asarray([np.nan if r[4] is None else r[4] for r in rows], dtype=np.float64)
    return measure(ep, micro, adv, omega, note, rho_raw=rho, q_h=q_h)


def run_signal(conn: Connection, run_id: int, stored: str | None, omega: float = 1.0) -> CreditSignal | None:
    """The run's recorded signal (``credit_runs.signal``), or measured from its credits when the
    run predates the record (revision 0008)."""
    if stored:
        return CreditSignal.from_dict(json.loads(stored))
    return measure_run(conn, run_id, omega)


def combine(signals: list[CreditSignal]) -> CreditSignal:
    """The signal of several runs' steps together (e.g. a training step's GRPO groups): counts
    summed, the spread averaged over all their episodes."""
    episodes = sum(s.episodes for s in signals)
    varying = [s.ratio_varying_steps for s in signals]
    return CreditSignal(
        steps=sum(s.steps for s in signals),
        hindsight_nonzero_steps=sum(s.hindsight_nonzero_steps for s in signals),
        advantage_nonzero_steps=sum(s.advantage_nonzero_steps for s in signals),
        episodes=episodes,
        varying_episodes=sum(s.varying_episodes for s in signals),
        advantage_spread=sum(s.advantage_spread * s.episodes for s in signals) / episodes if episodes else 0.0,
        ratio_varying_steps=None if None in varying else sum(v for v in varying if v is not None),
    )
