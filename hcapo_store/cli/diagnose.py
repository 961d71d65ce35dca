"""``diagnose``: does a credit run's hindsight signal carry information?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from hcapo_store import formatting
from hcapo_store.cli.main import Ctx, cli, echo_json, pass_ctx


@cli.command("diagnose", epilog='Reference: docs/CREDITS.md ("diagnose") in the hcapo-store repository.')
@click.argument("run", required=False)
@click.argument("run2", required=False)
@click.option(
    "--group-by",
    metavar="TAG|tag:KEY|field:NAME",
    help="Also per value of this tag or of a field of result.json / the JSONL line (e.g. field:task_id).",
)
@click.option(
    "--baseline",
    metavar="SCORER",
    help="A scorer of the same steps without the outcome (score --no-hindsight): adds the per-step lift "
    "log π_hind − log π and its correlation with ρ_raw.",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="DIR",
    help="The scorer's tokenizer: adds how much chat-template tokens weigh in the run's per-step means.",
)
@click.option("--json", "as_json", is_flag=True, help="Print every number as JSON.")
@pass_ctx
def diagnose_cmd(
    state: Ctx,
    run: str | None,
    run2: str | None,
    group_by: str | None,
    baseline: str | None,
    tokenizer: Path | None,
    as_json: bool,
) -> None:
    """Spread of ρ, clipping, length correlation, position and micro/macro numbers of RUN, with warnings.

    With RUN2: the rank agreement (Spearman) of the two runs' step advantages, e.g. two hindsight
    templates, two variants or two policy versions.
    """
    from hcapo_store.credits.diagnose import diagnose_run

    store = state.store(create=False)
    data = diagnose_run(store, run, other_run=run2, group_by=group_by, baseline_scorer=baseline)
    if tokenizer is not None:
        from hcapo_store.scoring.template_weight import template_token_weight

        data["template_tokens"] = template_token_weight(store, data["scorer_id"], tokenizer)
    if as_json:
        echo_json(data)
        return
    click.echo(_text(data))


def _num(value: Any, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def _text(d: dict[str, Any]) -> str:
    lines = [
        d["verdict"],  # the answer first, the numbers behind it after
        f"credit run {d['run']!r} ({d['variant']}), {d.get('steps', 0)} step(s), scorer {d['scorer_label']}",
    ]
    if d.get("steps"):
        q = d["rho_raw_quantiles"]
        lines += [
            f"  ρ_raw            std {_num(d['rho_raw_std'], '.4f')}, p05 {_num(q['p05'])}, median {_num(q['p50'])}, "
            f"p95 {_num(q['p95'])}",
            f"  clipped          {_num(d['clipped_low'], '.1%')} at c_min, {_num(d['clipped_high'], '.1%')} at c_max",
            f"  vs action length r(ρ_raw) {_num(d['corr_rho_action_tokens'], '+.2f')}, "
            f"r(micro) {_num(d['corr_micro_action_tokens'], '+.2f')}",
            "  ρ_raw by position decile  " + " ".join(_num(v, ".3f") for v in d["rho_raw_by_position_decile"]),
            f"  micro vs macro   |ω·micro| / |A| {_num(d['micro_macro_ratio'], '.2f')}, "
            f"sign flipped on {_num(d['micro_sign_flips'], '.1%')} of the steps",
        ]
    from hcapo_store.credits.signal import CreditSignal

    signal = CreditSignal.from_dict(d.get("signal"))
    if signal is not None:
        lines.append(f"  hindsight term   {signal.text()}")
    if d.get("note"):
        lines.append(f"  note: {d['note']}")
    if "groups" in d:
        rows = [
            (
                name,
                g["steps"],
                _num(g.get("rho_raw_std"), ".4f"),
                _num(g.get("clipped_low"), ".1%"),
                _num(g.get("clipped_high"), ".1%"),
                _num(g.get("corr_rho_action_tokens"), "+.2f"),
                ",".join(w["code"] for w in g["warnings"]),
            )
            for name, g in d["groups"].items()
        ]
        lines += ["", formatting.table(["group", "steps", "ρ_raw std", "low", "high", "r(len)", "warnings"], rows)]
    if "comparison" in d:
        c = d["comparison"]
        lines.append(
            f"  vs run {c['run']!r}: Spearman {_num(c['spearman'], '.3f')} of {c['compared']} over "
            f"{c['common_steps']} common step(s)"
        )
    if "baseline" in d:
        b = d["baseline"]
        lines.append(
            f"  baseline {b['scorer_label']}: lift log π_hind − log π mean {_num(b['lift_mean'], '+.4f')}, "
            f"std {_num(b['lift_std'], '.4f')}, r(lift, ρ_raw) {_num(b['corr_lift_rho'], '+.2f')}"
        )
    if "template_tokens" in d:
        t = d["template_tokens"]
        if t.get("action_span") == "policy":
            lines.append(f"  template tokens: {t['note']}")
        else:
            lines.append(
                f"  template tokens: {_num(t['template_token_share'], '.1%')} of the scored tokens; they move a "
                f"step's mean by {_num(t['mean_shift'], '+.4f')} on average (max {_num(t['max_abs_shift'], '.4f')})"
            )
    for w in d["warnings"]:
        lines.append(f"warning [{w['code']}]: {w['message']}")
    if not d["warnings"] and d.get("steps"):
        lines.append("no warning: ρ has spread, is not tied to action length and is not mostly clipped")
    return "\n".join(lines)
