"""``score-rollout``: the rollout's own logprobs as scores of a scorer of kind ``rollout``."""

from __future__ import annotations

import sys

import click

from hcapo_store.cli.main import Ctx, cli, echo_json, pass_ctx


@cli.command(
    "score-rollout",
    short_help="Store the rollouts' own logprobs as a scorer (no model call).",
    epilog="Reference: docs/FAMILY.md in the hcapo-store repository.",
)
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    required=True,
    metavar="DIR",
    help="The policy's tokenizer: every logprob entry is checked against its ids of the step.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def score_rollout(state: Ctx, tokenizer_dir: str, as_json: bool) -> None:
    """Store the behaviour policy's per-token logprobs that ingested episodes carry (OpenAI
    ``logprobs``, verl ``rollout_log_probs``, Pi ``logprobs``) as scores of a ``rollout`` scorer:
    the student side of ``credits compute --variant log-ratio --against``. A step whose entries
    are not the tokenizer's ids of that step fails with the reason (exit status 1)."""
    from hcapo_store.outputs.rollout_scores import store_rollout_scores

    report = store_rollout_scores(state.store(create=False), tokenizer_dir)
    echo_json(report.as_dict()) if as_json else click.echo(report.message)
    if report.failed:  # failed steps are never silent: they are listed, and the exit status says so
        sys.exit(1)
