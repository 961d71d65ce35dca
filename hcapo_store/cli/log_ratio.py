"""The options of ``credits compute --variant log-ratio`` (docs/FAMILY.md); their defaults are
``LogRatioParams``' own (one home: credits/log_ratio.py, read without loading numpy here)."""

from __future__ import annotations

from typing import Any

import click

from hcapo_store.cli.params import FiniteFloat, apply_options

# LogRatioParams' defaults, mirrored for --help without importing numpy at start-up;
# tests/test_log_ratio.py holds the two equal.
DEFAULTS = {"kl_coef": 1.0, "gate": "none", "gate_temperature": 1.0}

OPTIONS = [
    click.option(
        "--against",
        metavar="SCORER",
        help="log-ratio: the student scorer (id, prefix or label), e.g. a --no-hindsight or rollout scorer of the "
        "same tokens; --scorer is the teacher. follow: no-hindsight or rollout (made per batch).",
    ),
    click.option(
        "--allow-mixed",
        is_flag=True,
        help="log-ratio: accept scorers of other engines, dtypes or weights (refused by default).",
    ),
    click.option(
        "--kl-coef",
        type=FiniteFloat(),
        default=DEFAULTS["kl_coef"],
        show_default=True,
        help="log-ratio: weight λ of the per-token term λ·g_t·(log π_teacher − log π_student).",
    ),
    click.option(
        "--gate",
        type=click.Choice(["none", "sigmoid"]),
        default=DEFAULTS["gate"],
        show_default=True,
        help="log-ratio: g_t = 1, or SDAR's gate σ(d_t / τ) on the detached log-ratio.",
    ),
    click.option(
        "--gate-temperature",
        type=FiniteFloat(),
        default=DEFAULTS["gate_temperature"],
        show_default=True,
        help="log-ratio: τ of the sigmoid gate.",
    ),
    click.option(
        "--grpo",
        is_flag=True,
        help="log-ratio: add the episode's GRPO advantage A_i (per --group-by tag) to each token.",
    ),
    click.option("--clip", type=FiniteFloat(), help="log-ratio: clip each token's log-ratio to [-C, C] first."),
]
KEYWORDS = ("against", "allow_mixed", "kl_coef", "gate", "gate_temperature", "grpo", "clip")

# HCAPO's options, which a log-ratio run does not read: refused when given.
HCAPO_ONLY = (
    "t_temp",
    "gamma",
    "c_min",
    "c_max",
    "alpha",
    "no_smooth",
    "dense_rewards",
    "omega",
    "min_reward",
    "success_threshold",
    "max_logprob_tokens",
)


log_ratio_options = apply_options(OPTIONS)


def _given(option: str) -> bool:
    return click.get_current_context().get_parameter_source(option) is click.core.ParameterSource.COMMANDLINE


def split(variant: str, kw: dict[str, Any]) -> dict[str, Any]:
    """Takes the log-ratio options out of ``kw``; an option of the other kind is refused."""
    mine = {k: kw.pop(k) for k in KEYWORDS}
    if variant != "log-ratio":
        given = [k for k in KEYWORDS if _given(k)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise click.UsageError(f"{flag} applies to --variant log-ratio only (this run is --variant {variant})")
    else:
        given = [k for k in HCAPO_ONLY if _given(k)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise click.UsageError(f"{flag} does not apply to --variant log-ratio (HCAPO's estimator only)")
        if not mine["against"]:
            raise click.UsageError("--variant log-ratio needs --against SCORER (the student side of the ratio)")
    return mine


def params_of(mine: dict, group_by: str | None) -> Any:
    """``LogRatioParams`` of the options (bad values refused by it, one line)."""
    from hcapo_store.credits.log_ratio import LogRatioParams

    return LogRatioParams(
        kl_coef=mine["kl_coef"],
        gate=mine["gate"],
        gate_temperature=mine["gate_temperature"],
        grpo=mine["grpo"],
        group_by=group_by,
        clip=mine["clip"],
    )


def follow_student(store: Any, cfg: Any, prep: Any, follow_cfg: Any) -> Any:
    """``follow --variant log-ratio --against no-hindsight``: the follower's scorer without the
    hindsight block (the same backend), its pair checked before anything is scored; else None."""
    import dataclasses

    from hcapo_store.credits.log_ratio import NO_HINDSIGHT, check_pair
    from hcapo_store.errors import CreditError
    from hcapo_store.scoring.job import prepare

    if follow_cfg.log_ratio is None or follow_cfg.against != NO_HINDSIGHT:
        return None
    if not cfg.hindsight:
        raise click.UsageError("--against no-hindsight: the follower's own scorer is --no-hindsight already")
    student = prepare(store, dataclasses.replace(cfg, hindsight=False), prep.backend)
    try:
        check_pair(prep.spec, student.spec, follow_cfg.allow_mixed)
    except CreditError as exc:
        raise click.UsageError(str(exc)) from exc
    return student


def compute(state: Any, name: str | None, scorer: str | None, recompute: bool, group_by: str | None, mine: dict) -> Any:
    from hcapo_store.credits.log_ratio import compute_log_ratio

    params = params_of(mine, group_by)
    return compute_log_ratio(
        state.store(create=False),
        params,
        scorer=scorer,
        against=mine["against"],
        name=name,
        allow_mixed=mine["allow_mixed"],
        replace=recompute,
    )
