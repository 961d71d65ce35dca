"""Per-episode view: the page's structure and escaping, token heat maps from real scoring, `show`."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_credits import add_scorer, add_scores
from test_tokenized import _rendered_action

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs import colors
from hcapo_store.outputs.episode_view import (
    episode_page,
    episode_view,
    write_episode_page,
)
from hcapo_store.outputs.report import write_report
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
from hcapo_store.scoring.scheduler import RunOptions
from hcapo_store.storage.store import Store

VOID = {"meta", "input", "br", "hr", "img", "link"}


class _Tree(HTMLParser):
    """Checks that tags nest properly; collects elements with their attributes and text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, dict[str, Any]]] = []
        self.elements: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        el = {
            "tag": tag,
            "attrs": dict(attrs),
            "text": "",
            "parents": [e["attrs"].get("class", "") for _, e in self.stack],
        }
        self.elements.append(el)
        if tag not in VOID:
            self.stack.append((tag, el))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1][0] == tag, f"</{tag}> closes {self.stack[-1][0] if self.stack else None}"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        for _, el in self.stack:
            el["text"] += data


def parse(page: str) -> list[dict[str, Any]]:
    tree = _Tree()
    tree.feed(page)
    tree.close()
    assert not tree.stack, "unclosed tags"
    return tree.elements


def _cls(el: dict[str, Any]) -> list[str]:
    return el["attrs"].get("class", "").split()


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Store]:
    """Two episodes really scored through the reference server, then credited."""
    root = tmp_path_factory.mktemp("ev")
    write_standard_episodes(root / "episodes", 2, steps_per_subtask=2, output_words=12)
    store = Store.open(str(root / "s.db"))
    ingest(store, [root / "episodes"])
    with make_server(tiny_model_dir) as server:
        cfg = ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=2048)
        report = run_scoring(store, prepare(store, cfg), RunOptions(concurrency=2))
    assert report.failed == 0
    compute_credits(store, name="r")
    yield store
    store.close()


def test_episode_page_structure_and_heat_maps(scored: Store, tiny_model_dir: Path, tmp_path: Path) -> None:
    view = episode_view(scored, "episode_001", "r", tokenizer=tiny_model_dir)
    page = episode_page(view)
    els = parse(page)
    steps = [e for e in els if "step" in _cls(e)]
    assert [int(e["attrs"]["id"].split("-")[1]) for e in steps] == [s.step_index for s in view.steps]
    for el, s in zip(steps, view.steps):
        assert f"rho {s.credit['rho']:.4g}" in el["attrs"]["title"]
        assert f"q_h_smoothed {s.credit['q_h_smoothed']:.4g}" in el["attrs"]["title"]
        a = s.credit["advantage"]  # NULL where the run gives the step no weight (reward < min_reward)
        assert ("advantage –" if a is None else f"advantage {a:.4g}") in el["attrs"]["title"]
        for m in ("rho", "q_h", "q_h_smoothed", "advantage"):
            assert f"--{m}:" in el["attrs"]["style"]
    # one boundary per change of subtask, labelled with the subtask id
    changes = [s.subtask for k, s in enumerate(view.steps) if k == 0 or s.subtask != view.steps[k - 1].subtask]
    assert [e["text"].split(" · ")[0] for e in els if "boundary" in _cls(e)] == changes
    # tool results and calls are collapsed
    tools = [i for i, e in enumerate(els) if "tool" in _cls(e)]
    assert all(els[i + 1]["tag"] == "details" for i in tools)
    assert len([m for m in view.episode.messages if m["role"] == "tool"]) == len(tools) > 0
    calls = [e for e in els if "call" in _cls(e)]
    assert calls and all(e["tag"] == "details" for e in calls)
    # heat maps: every scored step has one, its tokens spell the scored span, one span per logprob
    tok = load_tokenizer(tiny_model_dir)
    heats = [e for e in els if "heat" in _cls(e)]
    assert len(heats) == len(view.steps)
    for heat, s in zip(heats, view.steps):
        assert s.tokens is not None and len(s.tokens) == len(s.logprobs) == s.credit["token_count"]
        assert heat["text"] == "".join(s.tokens)
        # short actions are scored whole: the tokens spell the step's rendered action
        assert heat["text"] == _rendered_action(tok, view.episode.messages, s.message_index)
    titles = [float(e["attrs"]["title"]) for e in els if e["tag"] == "span" and any("heat" in p for p in e["parents"])]
    assert np.allclose(titles, np.concatenate([s.logprobs for s in view.steps]), atol=6e-4)
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert {e["attrs"]["id"] for e in els if e["tag"] == "input"} == {"m-rho", "m-q_h", "m-q_h_smoothed", "m-advantage"}


def _credited_jsonl_episode(store: Store, tmp_path: Path, episode: dict) -> str:
    """One JSONL episode ingested, scored by a stored scorer and credited; its name."""
    (tmp_path / "eps.jsonl").write_text(json.dumps(episode) + "\n")
    ingest(store, [tmp_path / "eps.jsonl"])
    add_scorer(store, "sc")
    add_scores(store, "sc", seed=1)
    compute_credits(store)
    return store.query("SELECT name FROM episodes")[1][0][0]


def test_episode_page_escapes_everything(store: Store, tmp_path: Path) -> None:
    nasty = '<script>alert("x")</script> & <b>bold</b>'
    episode = {
        "episode_id": "e1",
        "reward": 0.7,
        "messages": [
            {"role": "user", "content": f"task {nasty}"},
            {
                "role": "assistant",
                "content": f"I will {nasty}",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": 'run"<x>', "arguments": json.dumps({"cmd": nasty})},
                    }
                ],
            },
            {"role": "tool", "name": "<tool>", "tool_call_id": "c1", "content": f"out {nasty}"},
            {"role": "assistant", "content": "done </div></details>"},
        ],
    }
    name = _credited_jsonl_episode(store, tmp_path, episode)
    out = write_episode_page(store, name, tmp_path / "e.html")
    page = out.path.read_text()
    els = parse(page)  # would fail if "</div></details>" in content closed our tags
    assert "<script" not in page and "<b>" not in page and "<tool>" not in page
    assert html.escape(nasty) in page
    text = "".join(e["text"] for e in els if e["tag"] == "body")
    assert nasty in text and "done </div></details>" in text
    assert len([e for e in els if "step" in _cls(e)]) == 2


def test_show_and_sql_never_send_terminal_escapes(store: Store, runner, tmp_path: Path) -> None:
    """Trajectory text is shown, never acted on: escape sequences, bells, bidi overrides."""
    nasty = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\u202eevil\x9b"
    episode = {
        "episode_id": "e\x1b[1m1",
        "reward": 0.7,
        "messages": [
            {"role": "user", "content": f"task {nasty}"},
            {"role": "assistant", "content": f"I will {nasty}"},
            {"role": "tool", "name": "bash", "tool_call_id": "c1", "content": f"out {nasty}"},
            {"role": "assistant", "content": f"done {nasty}"},
        ],
    }
    name = _credited_jsonl_episode(store, tmp_path, episode)
    db = store.display
    unsafe = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e]")
    outputs = [
        runner.invoke(cli, ["--db", db, "show", name]),
        runner.invoke(
            cli, ["--db", db, "sql", "SELECT e.name, m.content FROM messages m JOIN episodes e ON e.id = m.episode_id"]
        ),
    ]
    for r in outputs:
        assert r.exit_code == 0, r.output
        assert not unsafe.search(r.output), repr(r.output)
        assert "\\x1b" in r.output  # shown as its escape
    assert "\\x1b]0;pwned\\x07" in outputs[1].output and "\\u202eevil" in outputs[1].output
    # --json keeps the text exactly (JSON escapes it), for scripts
    data = json.loads(runner.invoke(cli, ["--db", db, "sql", "SELECT content FROM messages", "--json"]).output)
    assert any(nasty in row["content"] for row in data)


def test_show_prints_the_step_table(scored: Store, runner, tmp_path: Path, tiny_model_dir: Path) -> None:
    db = scored.display
    r = runner.invoke(cli, ["--db", db, "show", "episode_002", "--credits", "r"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("episode episodes/episode_002") and "credit run 'r'" in lines[0]
    assert lines[1].split()[:6] == ["step", "msg", "subtask", "r_t", "tokens", "mean_logprob"]
    steps = scored.query(
        "SELECT step_index, rho FROM step_credits WHERE run = 'r' AND episode = 'episodes/episode_002' "
        "ORDER BY step_index"
    )[1]
    # the header, the table (its head, a rule, one line per step) and the note on cut cells
    assert len(lines) == 4 + len(steps) and "--json" in lines[-1], lines[-1]
    r = runner.invoke(
        cli,
        [
            "--db",
            db,
            "show",
            "episode_002",
            "--json",
            "--html",
            str(tmp_path / "p.html"),
            "--tokenizer",
            str(tiny_model_dir),
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [s["rho"] for s in data["steps"]] == [rho for _, rho in steps]
    # --json is never cut: each step's whole action text and its tool calls
    view = episode_view(scored, "episode_002", "r")
    messages = view.episode.messages
    for step, s in zip(data["steps"], view.steps):
        message = messages[s.message_index]
        assert step["action"] == (message.get("content") or "") and "…" not in step["action"]
        assert step["tool_calls"] == [c["function"]["name"] for c in message.get("tool_calls") or []]
    assert any(len(step["action"]) > 60 for step in data["steps"])
    assert 'class="heatmap"' in (tmp_path / "p.html").read_text()
    r = runner.invoke(cli, ["--db", db, "show", "no_such_episode"])
    assert r.exit_code == 1 and "no episode 'no_such_episode'" in r.output and "Traceback" not in r.output


def test_report_links_episode_pages(scored: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hcapo_store.credits import lookup

    scans: list[str] = []
    real = lookup.run_staleness
    monkeypatch.setattr(lookup, "run_staleness", lambda conn, run: scans.append(run.name) or real(conn, run))
    out = write_report(scored, tmp_path / "rep.html", "r", episode_pages=True)
    assert scans == ["r"]  # the run is resolved (and its staleness scanned) once, not once per page
    page = out.path.read_text()
    links = re.findall(r'href="(rep_episodes/[^"]+)"', page)
    assert len(links) == 2 and 'id="episodes"' in page
    # no per-episode mean rho (1 by construction): the spread of rho_raw and the clipped steps instead
    assert "<th>mean rho</th>" not in page
    assert "<th>rho_raw min – max</th>" in page and "<th>steps on a clip bound</th>" in page
    for link in links:
        sub = (tmp_path / link).read_text()
        parse(sub)
        assert 'href="../rep.html"' in sub


def test_report_links_are_url_encoded(scored: Store, tmp_path: Path) -> None:
    """A report named r#1.html linked nowhere: '#' starts a fragment in a URL (issue 21)."""
    from urllib.parse import unquote

    out = write_report(scored, tmp_path / "r#1 x.html", "r", episode_pages=True)
    page = out.path.read_text()
    links = re.findall(r'href="(r%231%20x_episodes/[^"]+)"', page)
    assert len(links) == 2, page
    for link in links:
        target = tmp_path / unquote(link)
        assert target.is_file()
        back = re.findall(r'href="(\.\./[^"]+)"', target.read_text())
        assert back == ["../r%231%20x.html"] and (target.parent / unquote(back[0])).resolve() == out.path.resolve()


def test_heat_maps_show_multibyte_characters_whole(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The demo tokenizer is byte-level: an emoji or a CJK character spans several tokens, and
    decoding them one by one printed U+FFFD (issue 22). One span per character, coloured by the
    mean of its tokens, every logprob in its title."""
    from hcapo_store.devkit.synth import EpisodeBuilder
    from hcapo_store.outputs.episode_view import whole_characters

    text = "Done 🦩 数据库 ꙮ façade"
    b = EpisodeBuilder(seed=5, episode_id=5).standard(steps_per_subtask=1, output_words=5)
    b.entries[-1]["message"]["content"][0]["text"] = text
    b.write(tmp_path / "eps" / "episode_005")
    store = Store.open(str(tmp_path / "s.db"))
    ingest(store, [tmp_path / "eps"])
    with make_server(tiny_model_dir) as server:
        cfg = ScoreConfig(backend="sglang", server=server.url, tokenizer=str(tiny_model_dir), max_context=2048)
        assert run_scoring(store, prepare(store, cfg), RunOptions(concurrency=2)).failed == 0
    compute_credits(store, name="r")
    view = episode_view(store, "episode_005", "r", tokenizer=tiny_model_dir)
    last = view.steps[-1]
    assert last.tokens is not None and len(last.tokens) == len(last.logprobs)
    assert text in "".join(last.tokens) and not any("\ufffd" in t for t in last.tokens)
    page = episode_page(view)
    assert "\ufffd" not in page
    els = parse(page)
    heat = [e for e in els if "heat" in _cls(e)][-1]
    assert text in heat["text"]
    spans = [e for e in els if e["tag"] == "span" and any("heat" in p for p in e["parents"])]
    grouped = [e for e in spans if "tokens)" in e["attrs"]["title"]]
    assert [e["text"] for e in grouped][-6:] == ["🦩", "数", "据", "库", "ꙮ", "ç"]
    for e in grouped[-6:]:  # every token's logprob is in the title
        n = len(e["text"].encode())
        assert e["attrs"]["title"].endswith(f"({n} tokens)") and e["attrs"]["title"].count(",") == n - 1
    store.close()
    # the plain case with a real tokenizer: pieces rejoin to the decoded text
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("x 🦩𝔘龘 ꙮ end", add_special_tokens=False)
    pieces = whole_characters(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids) and "\ufffd" not in "".join(pieces)


def test_steps_can_be_tinted_by_the_signed_advantage_the_trainer_receives(scored: Store) -> None:
    """White at 0, purple above, orange below, full at the episode's largest |advantage|:
    each step's colour is the stored advantage's (step_credits.advantage), sign and all."""
    compute_credits(scored, CreditParams(variant="paper", dense=False), name="signed")  # signed advantages
    seen: list[float] = []
    for (name,) in scored.query("SELECT name FROM episodes WHERE is_current ORDER BY name")[1]:
        view = episode_view(scored, name, "signed")
        stored = dict(
            scored.query(
                "SELECT step_index, advantage FROM step_credits WHERE run = 'signed' AND episode = :e", {"e": name}
            )[1]
        )
        advantages = [s.credit["advantage"] for s in view.steps]
        assert advantages == [stored[s.step_index] for s in view.steps] and None not in advantages
        seen += advantages
        peak = max(abs(a) for a in advantages) or 1.0
        page = episode_page(view)
        styles = [e["attrs"]["style"] for e in parse(page) if "step" in _cls(e)]
        for style, a in zip(styles, advantages, strict=True):
            colour = dict(part.split(":") for part in style.split(";"))["--advantage"]
            assert colour == colors.tint(a / peak)
            r, b = int(colour[1:3], 16), int(colour[5:7], 16)
            assert (r > b) if a < 0 else (b > r or a == 0)  # orange below zero, purple above
        assert "#m-advantage:checked~.transcript .step{background:var(--advantage)}" in page
        assert "red" not in page.split('class="controls"')[1].split("</div>")[0]  # the legend names the real colours
    assert any(a < 0 for a in seen) and any(a > 0 for a in seen)
