"""Per-episode views of a credit run: which steps got credit, and why.

``episode_view`` loads one episode with its steps, credits and scores; ``episode_table``
is the per-step table ``hcapo-store show`` prints; ``episode_page`` is a self-contained
HTML page (no script): the transcript with each assistant step tinted by its credit
(rho, q_h, q_h_smoothed or the advantage the trainer receives, switched with CSS radio
buttons), subtask boundaries, tool calls
and results collapsed in ``<details>``, the step's numbers on hover, and for scored steps
a heat map of the per-token hindsight logprobs over the decoded tokens.

Tokens for the heat map are rebuilt exactly as scoring built them (``PromptBuilder`` with
the scorer's limits and the scorer's tokenizer, checked by fingerprint); a step whose
rebuilt scored span does not have the stored number of tokens gets no heat map.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
from sqlalchemy import Connection, text

from hcapo_store.credits.lookup import RunInfo, resolve_run
from hcapo_store.outputs.colors import diverging, legend_gradient, tint
from hcapo_store.outputs.files import atomic_write, check_output
from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.storage import db
from hcapo_store.storage.episodes import StoredEpisode, load_episode, resolve_episode
from hcapo_store.storage.store import Store

METRICS = ("rho", "q_h", "q_h_smoothed", "advantage")  # advantage: what the trainer receives
PREVIEW_CHARS = 60

FIND_SQL = """
SELECT e.id FROM episodes e
WHERE e.source_key = :key
ORDER BY CASE WHEN EXISTS (SELECT 1 FROM credits c JOIN steps s ON s.id = c.step_id
                           WHERE s.episode_id = e.id AND c.run_id = :run) THEN 0 ELSE 1 END,
         e.is_current DESC, e.version DESC
LIMIT 1
"""

STEPS_SQL = """
SELECT s.step_index, c.mean_logprob, c.token_count, c.pi_hind, c.rho, c.q_h, c.q_h_smoothed,
       sc.token_logprobs, sc.token_count, c.advantage
FROM steps s
LEFT JOIN credits c ON c.step_id = s.id AND c.run_id = :run
LEFT JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = :scorer
WHERE s.episode_id = :ep
ORDER BY s.step_index
"""


@dataclass
class StepView:
    step_index: int
    message_index: int
    phase: str
    subtask_id: str | None
    subtask_reward: float | None
    credit: dict[str, float | None]  # mean_logprob, token_count, pi_hind, rho, q_h, q_h_smoothed
    logprobs: np.ndarray | None = None  # stored per-token hindsight logprobs
    tokens: list[str] | None = None  # decoded scored tokens, aligned with logprobs

    @property
    def subtask(self) -> str:
        return self.subtask_id or self.phase


@dataclass
class EpisodeView:
    episode: StoredEpisode
    run: RunInfo | None
    scorer_id: str | None
    steps: list[StepView]
    notes: list[str] = field(default_factory=list)


def _find_episode(conn: Connection, name: str, run: RunInfo | None) -> int:
    """The version of the episode the user means (a name, its unambiguous end, or an id; see
    ``resolve_episode``) that the run credits, else the current one."""
    key = resolve_episode(conn, name)
    return int(conn.execute(text(FIND_SQL), {"key": key, "run": run.id if run else -1}).scalar_one())


def _runs_or_none(store: Store, run_name: RunInfo | str | None) -> RunInfo | None:
    if run_name is None and not store.query("SELECT 1 FROM credit_runs LIMIT 1")[1]:
        return None
    return resolve_run(store, run_name)


def episode_view(
    store: Store,
    name: str,
    run_name: RunInfo | str | None = None,
    *,
    tokenizer: str | Path | None = None,
    tokens: TokenRebuilder | None = None,
    episode_id: int | None = None,
) -> EpisodeView:
    """One episode with its steps, the run's credits (default: the only run, or none when
    there is no run; a resolved ``RunInfo`` is used as it is) and the scorer's per-token
    logprobs; ``tokenizer`` (the scorer's tokenizer directory) adds the decoded tokens for the
    heat map (``tokens``: a ``TokenRebuilder`` reused across episodes instead).
    ``episode_id``: the version already found (a page of a run's episode list)."""
    run = _runs_or_none(store, run_name)
    scorer_id = run.scorer_id if run else None
    with db.read(store.engine) as conn:
        episode = load_episode(conn, episode_id if episode_id is not None else _find_episode(conn, name, run))
        rows = {
            r[0]: r
            for r in conn.execute(
                text(STEPS_SQL), {"run": run.id if run else -1, "scorer": scorer_id or "", "ep": episode.id}
            )
        }
    steps = []
    for info in episode.steps:
        r = rows[info.step_index]
        credit = dict(zip(("mean_logprob", "token_count", "pi_hind", "rho", "q_h", "q_h_smoothed"), r[1:7]))
        credit["advantage"] = r[9]  # NULL for runs computed before advantages were stored
        lps = np.frombuffer(bytes(r[7]), dtype="<f4") if r[7] is not None else None
        steps.append(
            StepView(info.step_index, info.message_index, info.phase, info.subtask_id, info.subtask_reward, credit, lps)
        )
    view = EpisodeView(episode, run, scorer_id, steps)
    if tokens is None and tokenizer is not None and scorer_id is not None:
        tokens = TokenRebuilder(store, scorer_id, tokenizer)
    if tokens is not None:
        tokens.add_tokens(view)
    return view


class TokenRebuilder:
    """Rebuilds the scored tokens of steps as scoring built them, for the heat maps."""

    def __init__(self, store: Store, scorer_id: str, tokenizer_dir: str | Path) -> None:
        from hcapo_store.rendering.prompts import (
            HINDSIGHT_TEMPLATE,
            PromptBuilder,
            PromptLayout,
            layout_template,
            template_hash,
        )
        from hcapo_store.scoring.tokenizer_lookup import scorer_tokenizer

        self.scorer_id = scorer_id
        self.note: str | None = None
        self.builder = None
        spec = scorer_spec(store, scorer_id)
        baseline = spec.get("hindsight") is False
        layout: PromptLayout = "episode" if spec.get("prompt_layout") == "episode" else "per-step"
        default = template_hash(layout_template(HINDSIGHT_TEMPLATE, layout))
        if not baseline and spec.get("hindsight_template_sha256") != default:
            self.note = "no token heat maps: the scorer used a custom hindsight template"
            return
        self.tokenizer, _ = scorer_tokenizer(store, scorer_id, tokenizer_dir)
        # The scorer's own prompt options, so each heat map shows exactly the tokens it scored.
        self.builder = PromptBuilder(
            self.tokenizer,
            max_context=spec["max_context"],
            max_logprob_tokens=spec["max_logprob_tokens"],
            truncation=spec.get("truncation") or "sliding",
            action_span=spec.get("action_span") or "rendered",
            hindsight=not baseline,
            layout=layout,
        )

    def add_tokens(self, view: EpisodeView) -> None:
        from hcapo_store.rendering.requests import PromptFailure, StepPrompt
        from hcapo_store.scoring.grouping import plan_requests

        if view.scorer_id != self.scorer_id:
            view.notes.append("no token heat maps: the tokenizer was checked for another scorer")
            return
        if self.builder is None:
            view.notes.append(self.note or "no token heat maps")
            return
        ep = view.episode
        prompts: dict[int, Any] = {}
        for request in plan_requests(self.builder, ep.messages, ep.outcome, ep.steps):
            for built in [request] if isinstance(request, PromptFailure) else request.members:
                prompts[built.step_index] = built
        misaligned = 0
        for step in view.steps:
            p = prompts.get(step.step_index)
            if step.logprobs is None or not isinstance(p, StepPrompt):
                continue
            ids = list(p.input_ids[p.first_scored :])
            if len(ids) != len(step.logprobs):
                misaligned += 1
                continue
            step.tokens = whole_characters(self.tokenizer, ids)
        if misaligned:
            view.notes.append(f"{misaligned} scored step(s) without a heat map: the rebuilt span has another length")


REPLACEMENT = "\ufffd"


def whole_characters(tokenizer: Any, ids: list[int], longest: int = 8) -> list[str]:
    """Each token's text, aligned with ``ids``, without cutting a character in two: where a
    character's bytes are split over tokens (an emoji, CJK under a byte-level BPE), the first
    token gets the whole character and the others "" (decoding them one by one gives U+FFFD)."""
    out: list[str] = []
    i = 0
    while i < len(ids):
        j, piece = i + 1, tokenizer.decode([ids[i]])
        while piece.endswith(REPLACEMENT) and j < len(ids) and j - i < longest:
            longer = tokenizer.decode(ids[i : j + 1])
            j += 1
            piece = longer
            if not longer.endswith(REPLACEMENT):
                break
        if piece.endswith(REPLACEMENT) and j > i + 1:  # no whole character within reach: one by one
            j, piece = i + 1, tokenizer.decode([ids[i]])
        out.append(piece)
        out.extend([""] * (j - i - 1))
        i = j
    return out


# ---- terminal ------------------------------------------------------------------------------------


def episode_table(view: EpisodeView, *, preview: bool = True) -> list[dict[str, Any]]:
    """The per-step rows ``hcapo-store show`` prints; ``preview=False`` (``--json``): the
    action's whole text and its tool calls' names, never cut."""
    messages = view.episode.messages
    rows = []
    for s in view.steps:
        c = s.credit
        rows.append(
            {
                "step": s.step_index,
                "msg": s.message_index,
                "subtask": s.subtask,
                "r_t": s.subtask_reward,
                "tokens": c["token_count"]
                if c["token_count"] is not None
                else (len(s.logprobs) if s.logprobs is not None else None),
                "mean_logprob": c["mean_logprob"],
                "pi_hind": c["pi_hind"],
                "rho": c["rho"],
                "q_h": c["q_h"],
                "q_h_smoothed": c["q_h_smoothed"],
                "advantage": c["advantage"],
                **(
                    {"action": _preview(messages[s.message_index])}
                    if preview
                    else {
                        "action": messages[s.message_index].get("content") or "",
                        "tool_calls": [
                            (c.get("function") or {}).get("name", "?")
                            for c in messages[s.message_index].get("tool_calls") or []
                        ],
                    }
                ),
            }
        )
    return rows


def _preview(message: dict[str, Any]) -> str:
    content = re.sub(r"\s+", " ", message.get("content") or "").strip()
    calls = [(c.get("function") or {}).get("name", "?") for c in message.get("tool_calls") or []]
    text_ = content[:PREVIEW_CHARS] + ("…" if len(content) > PREVIEW_CHARS else "")
    return (text_ + (" " if text_ and calls else "") + " ".join(f"[{n}]" for n in calls)).strip()


# ---- HTML ----------------------------------------------------------------------------------------

CSS = (
    """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1000px;color:#222}
h1{font-size:20px;margin-bottom:4px} .meta{color:#666;font-size:13px} .note{color:#a15c00;font-size:13px}
.controls{position:sticky;top:0;background:#fff;padding:8px 0;border-bottom:1px solid #ddd;font-size:13px;z-index:2}
.controls label{margin-right:8px;padding:2px 8px;border:1px solid #bbb;border-radius:4px;cursor:pointer}
input[name=metric]{display:none}
#m-rho:checked~.controls label[for=m-rho],#m-q_h:checked~.controls label[for=m-q_h],
#m-q_h_smoothed:checked~.controls label[for=m-q_h_smoothed],
#m-advantage:checked~.controls label[for=m-advantage]{background:#4c78a8;color:#fff;border-color:#4c78a8} .legend{display:inline-block;width:160px;height:10px;vertical-align:middle;
background:"""
    + legend_gradient()
    + """;border:1px solid #ccc}
.msg{border-radius:6px;padding:6px 10px;margin:6px 0;border:1px solid #e5e5e5;white-space:pre-wrap;word-wrap:break-word;font-size:13px}
.role{font-size:11px;color:#666;text-transform:uppercase;letter-spacing:.04em;display:block;margin-bottom:2px}
.system,.user{background:#f6f7f9} .tool{background:#fbfbf7}
.boundary{margin:18px 0 6px;padding:2px 8px;border-left:4px solid #4c78a8;font-weight:600;font-size:13px;background:#eef3f9}
.step{border-width:2px} .nums{float:right;font-size:11px;color:#444;font-family:ui-monospace,monospace}
details{margin:4px 0} summary{cursor:pointer;font-size:12px;color:#555} pre{margin:4px 0;white-space:pre-wrap;font-size:12px}
.heat{font-family:ui-monospace,monospace;font-size:12px;line-height:1.9;white-space:pre-wrap}
.heat span{border-radius:2px}
#m-rho:checked~.transcript .step{background:var(--rho)}
#m-q_h:checked~.transcript .step{background:var(--q_h)}
#m-q_h_smoothed:checked~.transcript .step{background:var(--q_h_smoothed)}
#m-advantage:checked~.transcript .step{background:var(--advantage)}
"""
)


def _num(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _tints(view: EpisodeView) -> dict[str, list[str]]:
    """Per metric, one CSS colour per step (``colors.tint``). rho: white at 1, full purple at
    c_max, full orange at c_min (the run's clip bounds); q_h, q_h_smoothed and the signed
    advantage the trainer receives: white at 0, full colour at the episode's largest |value|
    (purple above 0, orange below)."""
    params = view.run.params if view.run else {}
    out: dict[str, list[str]] = {}
    for m in METRICS:
        values = [s.credit[m] for s in view.steps]
        peak = max((abs(v) for v in values if v is not None), default=0.0) or 1.0
        colors = []
        for v in values:
            if v is None:
                colors.append("#f3f3f3")
                continue
            if m == "rho":
                bound = params.get("c_max", 1.2) - 1.0 if v >= 1 else 1.0 - params.get("c_min", 0.8)
                x = (v - 1.0) / bound if bound > 0 else 0.0
            else:
                x = v / peak
            colors.append(tint(x))
        out[m] = colors
    return out


def _heat(step: StepView) -> str:
    """Tokens coloured by their logprob relative to the step: purple = the step's most likely
    token under the hindsight prompt, orange = its least likely (the 5th percentile and
    below). A character split over several tokens is one span (``tokens`` has "" for the
    tokens after its first), coloured by their mean."""
    assert step.logprobs is not None and step.tokens is not None
    lps = step.logprobs.astype(np.float64)
    hi = float(lps.max()) if len(lps) else 0.0
    lo = float(np.percentile(lps, 5)) if len(lps) else 0.0
    spans = []
    groups: list[tuple[str, list[float]]] = []
    for tok, lp in zip(step.tokens, lps.tolist()):
        if tok == "" and groups:
            groups[-1][1].append(lp)
        else:
            groups.append((tok, [lp]))
    for tok, group in groups:
        lp = sum(group) / len(group)
        x = (lp - lo) / (hi - lo) if hi > lo else 1.0
        bg, fg = diverging(2 * max(0.0, min(1.0, x)) - 1)
        title = ", ".join(f"{v:.3f}" for v in group) + (f" ({len(group)} tokens)" if len(group) > 1 else "")
        spans.append(f'<span style="background:{bg};color:{fg}" title="{title}">{html.escape(tok)}</span>')
    mean = float(lps.mean()) if len(lps) else float("nan")
    return (
        f'<details class="heatmap"><summary>hindsight logprob per token ({len(step.tokens)} tokens, mean '
        f"{mean:.3f}, range {lo:.2f} … {hi:.2f}; purple = most likely given the outcome, orange = least)</summary>"
        f'<div class="heat">{"".join(spans)}</div></details>'
    )


def _tool_calls(message: dict[str, Any]) -> str:
    parts = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.dumps(json.loads(args), indent=2, ensure_ascii=False) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        parts.append(
            f'<details class="call"><summary>tool call: {html.escape(str(fn.get("name", "?")))}</summary>'
            f"<pre>{html.escape(str(args))}</pre></details>"
        )
    return "".join(parts)


def _step_title(s: StepView) -> str:
    c = s.credit
    return (
        f"step {s.step_index} · {s.subtask} (r_t {_num(s.subtask_reward)}) · mean_logprob "
        f"{_num(c['mean_logprob'])} · tokens {_num(c['token_count'])} · pi_hind {_num(c['pi_hind'])} · "
        f"rho {_num(c['rho'])} · q_h {_num(c['q_h'])} · q_h_smoothed {_num(c['q_h_smoothed'])} · "
        f"advantage {_num(c['advantage'])}"
    )


def _message_html(i: int, message: dict[str, Any], step: StepView | None, tint: dict[str, str] | None) -> str:
    role = message.get("role", "?")
    content = html.escape(message.get("content") or "")
    if role == "tool":
        name = html.escape(str(message.get("name") or "tool"))
        return (
            f'<div class="msg tool" id="m{i}"><details><summary>tool result: {name} '
            f"({len(message.get('content') or '')} chars)</summary><pre>{content}</pre></details></div>"
        )
    if step is None or tint is None:
        return (
            f'<div class="msg {html.escape(role)}" id="m{i}"><span class="role">{html.escape(role)}</span>'
            f"{content}{_tool_calls(message)}</div>"
        )
    style = ";".join(f"--{m}:{tint[m]}" for m in METRICS)
    c = step.credit
    nums = f"rho {_num(c['rho'])} · q_h {_num(c['q_h'])} · q̃ {_num(c['q_h_smoothed'])} · A {_num(c['advantage'])}"
    heat = _heat(step) if step.tokens is not None else ""
    return (
        f'<div class="msg assistant step" id="step-{step.step_index}" style="{style}" '
        f'title="{html.escape(_step_title(step))}"><span class="nums">{html.escape(nums)}</span>'
        f'<span class="role">assistant · step {step.step_index}</span>{content}{_tool_calls(message)}{heat}</div>'
    )


def episode_page(view: EpisodeView, *, back_link: str | None = None) -> str:
    """The episode's self-contained HTML page."""
    ep = view.episode
    tints = _tints(view)
    by_message = {s.message_index: (k, s) for k, s in enumerate(view.steps)}
    body, current = [], None
    for i, message in enumerate(ep.messages):
        hit = by_message.get(i)
        if hit is not None and hit[1].subtask != current:
            step = hit[1]
            current = step.subtask
            body.append(
                f'<div class="boundary">{html.escape(str(current))} · subtask reward '
                f"{html.escape(_num(step.subtask_reward))}</div>"
            )
        tint = {m: tints[m][hit[0]] for m in METRICS} if hit else None
        body.append(_message_html(i, message, hit[1] if hit else None, tint))
    run = view.run
    title = f"episode {ep.name}"
    meta = f"reward {_num(ep.outcome.reward)} · phase {ep.outcome.phase or '?'} · {len(view.steps)} steps · " + (
        f"credit run {run.name} · scorer {run.scorer_label or run.scorer_id[:12]}" if run else "no credit run"
    )
    controls = "".join(
        f'<input type="radio" name="metric" id="m-{m}"{" checked" if m == "q_h_smoothed" else ""}>' for m in METRICS
    )
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in view.notes)
    back = f'<p><a href="{html.escape(quote(back_link))}">← report</a></p>' if back_link else ""
    return _assemble(back, title, meta, notes, controls, body)


def _assemble(back: str, title: str, meta: str, notes: str, controls: str, body: list[str]) -> str:
    # The radio inputs must be siblings before .transcript for the CSS switch to work.
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head><body>\n{back}<h1>{html.escape(title)}</h1>"
        f'<p class="meta">{html.escape(meta)}</p>{notes}\n'
        f'{controls}<div class="controls">tint steps by: '
        + "".join(f'<label for="m-{m}">{m}</label>' for m in METRICS)
        + '<span class="legend"></span> orange = below (rho &lt; 1, q &lt; 0, advantage &lt; 0), purple = above · '
        "hover a step for its numbers</div>\n"
        '<div class="transcript">\n' + "\n".join(body) + "\n</div>\n</body></html>\n"
    )


# ---- files ---------------------------------------------------------------------------------------


def page_filename(name: str) -> str:
    """A file name for an episode page: readable, and distinct for distinct names."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:80] or "episode"
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.html"


def _write_html(path: Path, page: str, inputs: list[Path]) -> None:
    atomic_write(path, lambda f: f.write(page.encode()), inputs=inputs)


@dataclass(frozen=True)
class EpisodePage:
    """What ``write_episode_page`` wrote; ``as_dict()`` is its former dict."""

    path: Path
    episode: str  # the episode's unique name
    run: str | None  # the credit run whose credits tint it; None: the store has none
    bytes: int  # the page's size

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "episode": self.episode, "run": self.run, "bytes": self.bytes}


def write_episode_page(
    store: Store, name: str, out_html: Path | str, run_name: str | None = None, *, tokenizer: str | Path | None = None
) -> EpisodePage:
    """Write one episode's page; returns its path, the episode and the run it shows."""
    view = episode_view(store, name, run_name, tokenizer=tokenizer)
    page = episode_page(view)
    out = Path(out_html)
    check_output(out, store.files)
    _write_html(out, page, store.files)
    return EpisodePage(out, view.episode.name, view.run.name if view.run else None, len(page.encode()))


EPISODES_SQL = """
SELECT e.id, e.name, e.reward, COUNT(*) AS steps, MIN(c.rho_raw) AS rho_min, MAX(c.rho_raw) AS rho_max,
       SUM(CASE WHEN c.rho <> c.rho_raw THEN 1 ELSE 0 END) AS clipped, AVG(c.q_h_smoothed) AS q_h_smoothed,
       MIN(c.advantage) AS advantage_min, MAX(c.advantage) AS advantage_max
FROM credits c JOIN steps s ON s.id = c.step_id JOIN episodes e ON e.id = s.episode_id
WHERE c.run_id = :run
GROUP BY e.id, e.name, e.reward
ORDER BY e.name, e.id
"""


def write_episode_pages(
    store: Store,
    out_dir: Path | str,
    run_name: RunInfo | str | None = None,
    *,
    tokenizer: str | Path | None = None,
    back_link: str | None = None,
) -> list[dict[str, Any]]:
    """One page per episode the run credits, in ``out_dir``; returns the index rows (with ``file``)."""
    run = resolve_run(store, run_name)
    with db.read(store.engine) as conn:
        rows = [dict(r) for r in conn.execute(text(EPISODES_SQL), {"run": run.id}).mappings()]
    out = Path(out_dir)
    tokens = TokenRebuilder(store, run.scorer_id, tokenizer) if tokenizer is not None else None
    for row in rows:
        view = episode_view(store, row["name"], run, tokens=tokens, episode_id=row["id"])
        page = episode_page(view, back_link=back_link)
        row["file"] = page_filename(row["name"])
        _write_html(out / row["file"], page, store.files)
    return rows


def episode_index_html(rows: list[dict[str, Any]], link_dir: str) -> str:
    """The report's table of episodes, each linking to its page under ``link_dir``."""
    # No mean rho: rho_raw is a ratio to the episode's own mean, so its mean is 1 by construction.
    columns = (
        "episode",
        "reward",
        "steps",
        "rho_raw min – max",
        "steps on a clip bound",
        "mean q_h_smoothed",
        "advantage min – max",
    )
    head = "".join(f"<th>{h}</th>" for h in columns)
    body = "".join(
        f'<tr><td><a href="{html.escape(quote(link_dir + "/" + r["file"]))}">{html.escape(r["name"])}</a></td>'
        f"<td>{_num(r['reward'])}</td><td>{r['steps']}</td><td>{_num(r['rho_min'])} – {_num(r['rho_max'])}</td>"
        f"<td>{r['clipped']}</td><td>{_num(r['q_h_smoothed'])}</td>"
        f"<td>{_num(r['advantage_min'])} – {_num(r['advantage_max'])}</td></tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"
