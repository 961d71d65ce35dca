"""The policy's own tokens in the tokenized export, with the real tokenizers on the real-size samples.

Goal of issue 22: with Qwen3 (thinking kept and --no-thinking), Qwen2.5 and a Llama-3-style
template, at least 99 % of the steps of the real-size Pi sessions are placed, and every placed
span is exactly the step's own text (checked here by decoding, against the stored message).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _shared import SHARED, TOKENIZERS
from sqlalchemy import text
from test_credits import add_scorer, add_scores

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.ingestion.sources import ConvertOptions
from hcapo_store.rendering.alignment import EpisodeRenderer
from hcapo_store.rendering.own_tokens import own_pieces
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store

LONG = SHARED / "samples" / "long"

# Llama 3.1's layout: header tokens around the role, <|eot_id|> ends a turn, tool calls as a
# JSON object in the assistant content, tool results in an "ipython" turn.
LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- if m.content %}{{- m.content }}{%- endif %}"
    '{%- for c in m.tool_calls or [] %}{{- \'{"name": "\' + c.function.name + \'", "parameters": \' }}'
    "{{- c.function.arguments | tojson }}{{- '}' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _tokenizer_dir(name: str, tmp_path: Path) -> Path:
    if name != "llama3":
        path = TOKENIZERS / name
        if not path.is_dir():
            pytest.skip(f"real tokenizer directory {path} is absent")
        return path
    base = TOKENIZERS / "qwen2.5"
    if not base.is_dir():
        pytest.skip(f"real tokenizer directory {base} is absent")
    out = tmp_path / "llama3-style"
    shutil.copytree(base, out)
    tok = load_tokenizer(out)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = LLAMA3
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "thinking", "end_of_turn"),
    [
        ("qwen3", True, "<|im_end|>"),
        ("qwen3", False, "<|im_end|>"),
        ("qwen2.5", True, "<|im_end|>"),
        ("llama3", True, "<|eot_id|>"),
    ],
)
def test_real_size_sessions_are_placed_whole(
    name: str, thinking: bool, end_of_turn: str, tmp_path: Path, runner
) -> None:
    if not LONG.is_dir():
        pytest.skip(f"real-size samples {LONG} are absent")
    tok_dir = _tokenizer_dir(name, tmp_path)
    tok = load_tokenizer(tok_dir)
    db_path = tmp_path / "s.db"
    store = Store.open(str(db_path))
    ingest(store, [LONG], options=ConvertOptions(include_thinking=thinking))
    add_scorer(store, "sc", spec={"tokenizer": tokenizer_fingerprint(tok, tok_dir), "max_logprob_tokens": 2048})
    add_scores(store, "sc", seed=3)
    compute_credits(store, name="r")
    out = tmp_path / "t.jsonl"
    args = ["--db", str(db_path), "export", "dataset", str(out), "--tokenized", "--tokenizer", str(tok_dir)]
    r = runner.invoke(cli, [*args, "--min-reward", "0", "--omega", "0", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output[r.output.index("{") :])
    ep_ids = dict(store.query("SELECT name, id FROM episodes")[1])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    in_rows = sum(len(r["step_indices"]) + len(r["unaligned_steps"]) for r in rows)
    assert rows and summary["aligned_steps"] >= 0.99 * in_rows, summary["unaligned_reasons"]
    with store.engine.connect() as conn:
        # every step of both episodes, whether or not Eq. 8 leaves its episode in the file
        renderer = EpisodeRenderer(tok)
        placed = total = 0
        for ep_id in ep_ids.values():
            steps = conn.execute(
                text("SELECT step_index, message_index FROM steps WHERE episode_id = :e"), {"e": ep_id}
            ).all()
            al = renderer.align(load_messages(conn, ep_id), [tuple(s) for s in steps], "turns")
            placed, total = placed + len(al.spans), total + len(steps)
        assert total == 198 and placed >= 0.99 * total
        for row in rows:
            messages = load_messages(conn, ep_ids[row["episode"]])
            for m, (start, end) in zip(row["step_message_indices"], row["step_spans"]):
                own = tok.decode(row["token_ids"][start:end])
                assert own.endswith(end_of_turn) and own.count(end_of_turn) == 1
                assert "<|im_start|>" not in own and "<|start_header_id|>" not in own
                for piece in own_pieces(messages[m]):
                    assert piece in own
                if thinking and "<think>" in (messages[m]["content"] or "") and name.startswith("qwen"):
                    assert own.startswith("<think>")
                elif name == "qwen3":
                    assert "</think>" not in own  # the inserted empty think block is the template's


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_policy_span_scores_no_template_tokens(thinking: bool) -> None:
    """score --action-span policy with Qwen3: the scored tokens are the policy's own (no inserted
    empty think block, no newline after <|im_end|>); the rendered span keeps both."""
    from _tokenizers import episode, real_tokenizer

    from hcapo_store.rendering.prompts import PromptBuilder
    from hcapo_store.rendering.requests import PromptFailure

    tok = real_tokenizer("qwen3")
    messages, outcome, steps = episode(5, steps=10, thinking=thinking, extra_user_turns=False)
    rendered = PromptBuilder(tok).build_episode(messages, outcome, steps)
    policy = PromptBuilder(tok, action_span="policy").build_episode(messages, outcome, steps)
    # Both spans refuse the same steps (a turn right after another assistant turn renders
    # differently once it is no longer the last: "alignment", as scoring always did).
    assert [isinstance(p, PromptFailure) for p in rendered] == [isinstance(p, PromptFailure) for p in policy]
    placed = [(s, r, p) for s, r, p in zip(steps, rendered, policy) if not isinstance(p, PromptFailure)]
    assert len(placed) >= 7
    for step, r, p in placed:
        r_text = tok.decode(r.input_ids[r.first_scored :])
        p_text = tok.decode(p.input_ids[p.first_scored :])
        assert r_text.endswith("<|im_end|>\n") and p_text.endswith("<|im_end|>")
        assert p.input_ids == r.input_ids[: len(p.input_ids)]  # the same request, cut after the policy's last token
        content = messages[step["message_index"]]["content"]
        if "<think>" in content:
            assert p_text.startswith("<think>") and r_text.startswith("<think>")
        else:  # Qwen3 wraps this last turn in an empty think block: the template's, not the policy's
            assert r_text.startswith("<think>\n\n</think>\n\n") and "</think>" not in p_text
        assert p.total_action_tokens == p.scored_tokens < r.scored_tokens
