"""``credits``: credit runs computed from stored logprobs, without the model."""

from __future__ import annotations

from typing import Any

import click

from hcapo_store import formatting
from hcapo_store.cli import log_ratio
from hcapo_store.cli.log_ratio import log_ratio_options
from hcapo_store.cli.main import Ctx, Group, cli, echo_json, pass_ctx, warn
from hcapo_store.cli.params import FiniteFloat, apply_options, int_range
from hcapo_store.credits.params import CreditParams


@cli.group(
    cls=Group,
    short_help="Credit runs (Eq. 5-7): no model calls.",
    epilog="Reference: docs/CREDITS.md in the hcapo-store repository.",
)
def credits() -> None:
    """Credit runs (Eq. 5-7) computed from stored logprobs, without the model."""


# The estimator's hyperparameters: shared by ``credits compute`` and ``follow``; their defaults
# are CreditParams' own (one home: credits/params.py).
_DEFAULTS = CreditParams()
CREDIT_OPTIONS = [
    click.option(
        "--t-temp",
        type=FiniteFloat(),
        default=_DEFAULTS.t_temp,
        show_default=True,
        help="Temperature T of the hindsight ratio: pi_hind = exp(mean logprob / T).",
    ),
    click.option(
        "--gamma",
        type=FiniteFloat(),
        default=_DEFAULTS.gamma,
        show_default=True,
        help="Discount γ: a step's reward is discounted by γ per step to its subtask's end.",
    ),
    click.option(
        "--c-min",
        type=FiniteFloat(),
        default=_DEFAULTS.c_min,
        show_default=True,
        help="Lower clip c_min of the ratio ρ = pi_hind / episode mean.",
    ),
    click.option(
        "--c-max",
        type=FiniteFloat(),
        default=_DEFAULTS.c_max,
        show_default=True,
        help="Upper clip c_max of the ratio ρ.",
    ),
    click.option(
        "--alpha",
        type=FiniteFloat(),
        default=_DEFAULTS.alpha,
        show_default=True,
        help="Backward smoothing weight α of q_h into q_h_smoothed.",
    ),
    click.option("--no-smooth", is_flag=True, help="No smoothing (q_h_smoothed = q_h)."),
    click.option(
        "--variant",
        type=click.Choice(["original", "paper", "log-ratio"]),
        default=_DEFAULTS.variant,
        show_default=True,
        help="original: the scripts' estimator (recursive smoothing, global statistics, Eq. 8 weights >= 0 for "
        "weighted SFT); paper: Algorithm 1 (one-step smoothing, per-group statistics, signed advantages for "
        "PPO/GRPO); log-ratio: per-token log π_teacher − log π_student of --scorer against --against "
        "(docs/FAMILY.md). docs/CREDITS.md lists the differences.",
    ),
    click.option(
        "--dense-rewards/--no-dense-rewards",
        default=None,
        help="Dense: a step's return is its subtask's score discounted to the subtask's end; sparse: the episode "
        "reward discounted to the episode end. Default: dense for original, sparse (terminal) for paper, and "
        "terminal where no step has a subtask reward (outcome-only rollouts; the run records it). "
        "--dense-rewards on such data is refused.",
    ),
    click.option(
        "--omega",
        type=FiniteFloat(),
        default=_DEFAULTS.omega,
        show_default=True,
        help="Weight ω of the micro (step) term.",
    ),
    click.option(
        "--group-by",
        metavar="TAG|tag:KEY|field:NAME",
        help="Macro advantage (and, for paper, μ_H/σ_H) per value of this tag, or of a top-level field of "
        "result.json / the JSONL line (field:task_id for τ-bench), e.g. a GRPO group id; episodes without "
        "it form one group.",
    ),
    click.option(
        "--min-reward",
        type=FiniteFloat(),
        default=_DEFAULTS.min_reward,
        show_default=True,
        help="original: advantages over the episodes with reward >= X (those the export keeps).",
    ),
    click.option(
        "--success-threshold",
        type=FiniteFloat(),
        default=_DEFAULTS.success_threshold,
        show_default=True,
        help="paper: a trajectory with reward >= X is successful; do-no-harm clears its negative micro terms.",
    ),
]


# The keyword arguments CREDIT_OPTIONS give a command (credit_params takes them).
CREDIT_KEYWORDS = (
    "t_temp",
    "gamma",
    "c_min",
    "c_max",
    "alpha",
    "no_smooth",
    "variant",
    "dense_rewards",
    "omega",
    "group_by",
    "min_reward",
    "success_threshold",
)


credit_options = apply_options(CREDIT_OPTIONS)


def credit_params(
    *,
    t_temp,
    gamma,
    c_min,
    c_max,
    alpha,
    no_smooth,
    variant,
    dense_rewards,
    omega,
    group_by,
    min_reward,
    success_threshold,
    max_logprob_tokens=None,
) -> Any:
    """``CreditParams`` of the credit options; an option of the other variant is refused."""
    from hcapo_store.credits.equations import CreditParams

    given = click.get_current_context().get_parameter_source
    for option, only in (("success_threshold", "paper"), ("min_reward", "original")):
        if variant != only and given(option) is click.core.ParameterSource.COMMANDLINE:
            flag = "--" + option.replace("_", "-")
            raise click.UsageError(f"{flag} applies to --variant {only} only (this run is --variant {variant})")
    # Invalid values are refused by CreditParams itself (one line, with the valid range).
    return CreditParams(
        t_temp=t_temp,
        gamma=gamma,
        c_min=c_min,
        c_max=c_max,
        alpha=alpha,
        smooth=not no_smooth,
        dense=dense_rewards,  # None: CreditParams decides (by the variant and the data)
        max_logprob_tokens=max_logprob_tokens,
        variant=variant,
        omega=omega,
        group_by=group_by,
        min_reward=min_reward,
        success_threshold=success_threshold,
    )


@credits.command("compute")
@click.option("--name", help="A label for the run (default: 'default' for the default parameters).")
@click.option("--scorer", help="Scorer id, unique id prefix or label (default: the only scorer).")
@credit_options
@click.option("--max-logprob-tokens", type=int_range(1), help="Re-aggregate only the last N stored token logprobs.")
@click.option("--recompute", is_flag=True, help="Recompute an existing run (e.g. after more steps were scored).")
@log_ratio_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def credits_compute(
    state: Ctx,
    name,
    scorer,
    max_logprob_tokens,
    recompute,
    as_json,
    **credit_kw,
) -> None:
    """Compute pi_hind, rho, q_h, q_h_smoothed and the advantage for every completely scored episode.

    Same scorer + same hyperparameters is the same run (returned, not recomputed).
    Episodes with missing or failed steps are listed as incomplete and get no credits.
    """
    from hcapo_store.credits.compute import compute_credits

    mine = log_ratio.split(credit_kw["variant"], credit_kw)
    if credit_kw["variant"] == "log-ratio":
        result = log_ratio.compute(state, name, scorer, recompute, credit_kw["group_by"], mine)
        echo_json(result.as_dict()) if as_json else click.echo(result.message)
        return
    params = credit_params(max_logprob_tokens=max_logprob_tokens, **credit_kw)
    result = compute_credits(state.store(create=False), params, name=name, scorer=scorer, replace=recompute)
    echo_json(result.as_dict()) if as_json else click.echo(result.message)


@credits.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def credits_list(state: Ctx, as_json: bool) -> None:
    """List credit runs: name, scorer, hyperparameters, episodes, steps, incomplete."""
    from hcapo_store.credits.lookup import list_runs

    runs = list_runs(state.store(create=False))
    if as_json:
        echo_json([r.as_dict() for r in runs])
        return
    if not runs:
        click.echo("no credit runs yet: run `hcapo-store credits compute`")
        return
    click.echo(
        formatting.table(
            ["name", "scorer", "params", "episodes", "steps", "incomplete", "stale", "created"],
            [
                (
                    r.name,
                    r.scorer_label,
                    formatting.params_text(r.params),
                    r.episodes,
                    r.steps,
                    r.incomplete_episodes,
                    "STALE" if r.stale else "",
                    r.created_at,
                )
                for r in runs
            ],
            max_width=None,
        )
    )
    warn([r.stale for r in runs if r.stale])


@credits.command("show")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def credits_show(state: Ctx, name: str | None, as_json: bool) -> None:
    """Show one run: hyperparameters, counts, and a per-subtask summary."""
    from hcapo_store.credits.compare import show_run

    shown = show_run(state.store(create=False), name)
    data = shown.as_dict()  # the text lists every field the JSON has, in its order
    if as_json:
        echo_json(data)
        return
    for key, value in data.items():
        if key == "stale":
            click.echo(f"{key:<20} {value or 'no'}")
        elif key == "signal":  # is HCAPO's hindsight term in the advantages (credits/signal.py)
            signal = shown.run.credit_signal
            click.echo(f"{key:<20} {signal.text() if signal else 'not measured (no stored advantages)'}")
        elif key != "subtasks":
            click.echo(f"{key:<20} {formatting.params_text(value) if isinstance(value, dict) else value}")
    if shown.subtasks:
        click.echo("")
        click.echo(formatting.records_table(data["subtasks"]))


@credits.command("diff")
@click.argument("a")
@click.argument("b")
@click.option(
    "--top", type=int_range(0, 1_000_000), default=10, show_default=True, help="How many most-moved steps to list."
)
@click.option("--all", "all_steps", is_flag=True, help="With --json: every common step's deltas.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@pass_ctx
def credits_diff(state: Ctx, a: str, b: str, top: int, all_steps: bool, as_json: bool) -> None:
    """Compare two runs step by step: deltas of rho and q_h_smoothed (B - A)."""
    from hcapo_store.credits.compare import diff_runs, iter_step_deltas

    store = state.store(create=False)
    if as_json and all_steps:
        echo_json(list(iter_step_deltas(store, a, b)))
        return
    diff = diff_runs(store, a, b, top=top)
    data = diff.as_dict()  # the text lists every scalar and flat field the JSON has, in its order
    if as_json:
        echo_json(data)
        return
    for key, value in data.items():
        if isinstance(value, dict) and all(isinstance(v, (int, float, type(None))) for v in value.values()):
            click.echo(f"{key:<20} " + "  ".join(f"{k}={formatting.cell(v)}" for k, v in value.items()))
        elif not isinstance(value, (list, dict)):
            click.echo(f"{key:<20} {value}")
    if diff.top_moved:
        click.echo("\nsteps that moved most:")
        click.echo(formatting.records_table(data["top_moved"]))
