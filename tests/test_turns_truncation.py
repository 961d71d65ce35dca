"""``--truncation turns``: per-step prompts over a bounded window of whole turns.

The reference is the rule as docs/SCORING.md states it, written out independently: for each
step, the candidate windows (head with the marker + the turns from a start that is not a
tool result through the action) are rendered with ``apply_chat_template`` and tokenized with
``tokenizer.encode`` from the earliest start on; the first whose rendering fits
``max_context`` is the prompt. Real tokenizers (Qwen3, Qwen2.5 from ../shared when present),
a BOS-emitting ChatML and the demo tokenizer; conversations with later user turns (which
Qwen3's template treats differently) and tool calls.
"""

from __future__ import annotations

import pytest
from _tokenizers import bos_tokenizer, episode, named_tokenizer, real_tokenizer

from hcapo_store.rendering.prompts import (
    TRUNCATION_MARKER,
    PromptBuilder,
    hindsight_text,
    inject_hindsight,
    normalize_messages,
)
from hcapo_store.rendering.requests import PromptFailure, StepPrompt
from hcapo_store.rendering.tokenizers import load_tokenizer


def _by_the_rule(tok, messages, outcome, step, max_context):
    """(ids, the window's first message index after the head, whether the prefix rendered
    with a generation prompt is a prefix of those ids) as the documented rule says."""
    norm = normalize_messages(messages)
    m = step["message_index"]
    roles = [x["role"] for x in norm]
    head_end = roles.index("user") + 1
    injected = inject_hindsight(norm[: m + 1], hindsight_text(outcome, step))
    starts = [i for i in range(head_end, m + 1) if roles[i] != "tool"]
    for start in starts:
        head = injected[:head_end]
        if start != head_end:
            last = dict(head[-1], content=head[-1]["content"] + TRUNCATION_MARKER.rstrip())
            head = [*head[:-1], last]
        window = [*head, *injected[start : m + 1]]
        ids = tok.encode(tok.apply_chat_template(window, tokenize=False), add_special_tokens=False)
        prefix = tok.apply_chat_template(window[:-1], tokenize=False, add_generation_prompt=True)
        prefix_ids = tok.encode(prefix, add_special_tokens=False)
        if len(ids) <= max_context:
            return ids, start, ids[: len(prefix_ids)] == prefix_ids
    return None, None, True


# qwen2.5 in the slow tier (~6 s): the same rule as the qwen3 case, on another real template
@pytest.mark.parametrize("name", ["qwen3", pytest.param("qwen2.5", marks=pytest.mark.slow), "chatml-bos", "demo"])
def test_each_prompt_is_the_rendering_of_the_most_recent_turns_that_fit(name, tmp_path, demo_tokenizer_dir):
    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    max_context = 900
    builder = PromptBuilder(tok, max_context=max_context, truncation="turns", max_logprob_tokens=4096)
    checked = cut = 0
    for seed in range(2):
        messages, outcome, steps = episode(seed, steps=16, tool_chars=500)
        prompts = builder.build_episode(messages, outcome, steps)
        for step, prompt in zip(steps, prompts, strict=True):
            expected, start, aligned = _by_the_rule(tok, messages, outcome, step, max_context)
            if not aligned:  # Qwen3 renders a turn differently once it is not the last one
                assert isinstance(prompt, PromptFailure) and prompt.reason == "alignment", prompt
                continue
            assert isinstance(prompt, StepPrompt), prompt
            if expected is None:  # even the head and the action do not fit: the sliding cut
                assert len(prompt.input_ids) <= max_context and prompt.truncated_prefix_tokens > 0
                continue
            assert list(prompt.input_ids) == expected, (seed, step["step_index"])
            dropped = start != min(i for i, x in enumerate(messages) if x["role"] == "user") + 1
            assert (prompt.truncated_prefix_tokens > 0) == dropped
            assert prompt.scored_tokens + prompt.skipped_action_tokens == prompt.total_action_tokens
            # A step alone gets the same prompt: its window depends on nothing but the step.
            assert builder.build_step(messages, outcome, step) == prompt
            checked += 1
            cut += dropped
    assert checked > 20 and cut > 10  # the rule was exercised on both sides of the budget


@pytest.mark.parametrize("span", ["rendered", "policy"])
def test_without_truncation_turns_equals_sliding(span):
    tok = real_tokenizer("qwen3")
    for seed in range(2):
        messages, outcome, steps = episode(seed, steps=10)
        sliding = PromptBuilder(tok, action_span=span).build_episode(messages, outcome, steps)
        turns = PromptBuilder(tok, action_span=span, truncation="turns").build_episode(messages, outcome, steps)
        assert turns == sliding


def _counting_renders(builder: PromptBuilder) -> list[int]:
    """The number of messages of each render ``builder`` makes from now on."""
    sizes: list[int] = []
    render = builder._render

    def counting(msgs, *, generation):
        sizes.append(len(msgs))
        return render(msgs, generation=generation)

    builder._render = counting  # type: ignore[method-assign]
    return sizes


def test_a_long_session_renders_bounded_windows():
    """The point of the mode: a step renders a few windows of at most max_context, never its
    whole history (counted in rendered messages, not in seconds)."""
    from hcapo_store.rendering.prompts import TURN_CHECK_MESSAGES

    tok = real_tokenizer("qwen2.5")
    messages, outcome, steps = episode(11, steps=300, tool_chars=300, extra_user_turns=False)
    builder = PromptBuilder(tok, max_context=1200, truncation="turns")
    sizes = _counting_renders(builder)
    prompts = builder.build_episode(messages, outcome, steps)
    assert all(isinstance(p, StepPrompt) and len(p.input_ids) <= 1200 for p in prompts)
    assert len(messages) > 600
    # the run-time check (verify.TURN_WINDOWS) builds a few early steps by the rule, whose
    # windows reach at most TURN_CHECK_MESSAGES messages in
    assert max(sizes) <= TURN_CHECK_MESSAGES + 1
    # the strategy itself: a window, not a history of 600+ messages
    sizes.clear()
    builder._check_turns = lambda *args: None  # type: ignore[method-assign]
    assert builder.build_episode(messages, outcome, steps) == prompts
    assert max(sizes) < 60
    assert len(sizes) <= 8 * len(steps)  # a few renders per step, however long the session
    # The sliding rule renders each step's whole history.
    sliding = PromptBuilder(tok, max_context=1200)
    sliding_sizes = _counting_renders(sliding)
    sliding.build_episode(messages, outcome, steps[-3:])
    assert max(sliding_sizes) > 600


def test_a_template_that_rejects_tools_is_flattened_in_windows_too(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'tool' or m.tool_calls %}"
        "{{ raise_exception('no tools') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    # (room for the first message with its hindsight block: 300 ids of this tiny vocabulary)
    builder = PromptBuilder(bos_tokenizer(tmp_path, template=template), max_context=700, truncation="turns")
    messages, outcome, steps = episode(7, steps=20, thinking=False)
    prompts = builder.build_episode(messages, outcome, steps)
    flat = [p for p in prompts if isinstance(p, StepPrompt) and p.flattened]
    assert flat and any(p.truncated_prefix_tokens for p in flat)
    assert all(len(p.input_ids) <= 700 for p in flat)


def test_score_with_turns_is_its_own_scorer_end_to_end(tmp_path, tiny_model_dir):
    """`score --truncation turns` as a user runs it, against the reference server: every step
    scored, the stored rows are the rule's prompts, and the scorer says what it is."""
    import json

    from click.testing import CliRunner

    from hcapo_store.cli import cli
    from hcapo_store.devkit.refserver import make_server
    from hcapo_store.devkit.synth import write_standard_episodes
    from hcapo_store.storage.episodes import load_episode
    from hcapo_store.storage.store import Store

    write_standard_episodes(tmp_path / "eps", 2, seed=9, steps_per_subtask=4, output_words=30)
    db = str(tmp_path / "t.db")
    assert CliRunner().invoke(cli, ["--db", db, "ingest", str(tmp_path / "eps")]).exit_code == 0
    with make_server(tiny_model_dir) as server:
        argv = ["--db", db, "score", "--server", server.url, "--tokenizer", str(tiny_model_dir)]
        r = CliRunner().invoke(cli, [*argv, "--max-context", "1024", "--truncation", "turns", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{") :])
    assert report["failed"] == 0 and report["scored"] > 0
    listed = json.loads(CliRunner().invoke(cli, ["--db", db, "scorers", "list", "--json"]).output)
    assert len(listed) == 1 and "trunc=turns" in listed[0]["label"]
    builder = PromptBuilder(load_tokenizer(tiny_model_dir), max_context=1024, truncation="turns")
    with Store.open(db) as store:
        rows = store.query(
            "SELECT e.id, s.step_index, c.input_tokens, c.truncated_prefix_tokens "
            "FROM scores c JOIN steps s ON s.id = c.step_id JOIN episodes e ON e.id = s.episode_id"
        )[1]
        assert len(rows) == report["scored"]
        expected = {}
        with store.engine.connect() as conn:
            for episode_id in {row[0] for row in rows}:
                ep = load_episode(conn, episode_id)
                for p in builder.build_episode(ep.messages, ep.outcome, ep.steps):
                    expected[(episode_id, p.step_index)] = (len(p.input_ids), p.truncated_prefix_tokens)
    assert {(r[0], r[1]): (r[2], r[3]) for r in rows} == expected
    assert any(t for _, t in expected.values())  # some steps left turns out


def test_a_dry_run_says_when_long_sessions_make_this_scorer_quadratic(tmp_path, tiny_model_dir):
    """`score --dry-run` on sessions longer than --max-context counts the steps with more
    history; the per-step `sliding` scorer prepares them on bounded renders, so there is
    nothing to warn about, as with `turns` and the episode layout. Over a chat template that
    numbers its tool results (a window renders them unlike the whole history) it renders
    each step's whole conversation again, and says so and names the linear modes."""
    import json
    import shutil

    from click.testing import CliRunner

    from hcapo_store.cli import cli
    from hcapo_store.devkit.synth import write_standard_episodes

    write_standard_episodes(tmp_path / "eps", 2, seed=9, steps_per_subtask=4, output_words=30)
    db = str(tmp_path / "t.db")
    assert CliRunner().invoke(cli, ["--db", db, "ingest", str(tmp_path / "eps")]).exit_code == 0
    numbered = shutil.copytree(tiny_model_dir, tmp_path / "numbered")
    wrapper = "'\\n<tool_response>\\n' + text(message.content)"
    jinja = numbered / "chat_template.jinja"  # where transformers saves a template (else tokenizer_config.json)
    config = json.loads((numbered / "tokenizer_config.json").read_text())
    template = jinja.read_text() if jinja.exists() else config["chat_template"]
    assert wrapper in template
    template = template.replace(wrapper, "('\\n<tool_response>#' ~ loop.index ~ '\\n') + text(message.content)")
    if jinja.exists():
        jinja.write_text(template)
    else:
        (numbered / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    seen = {}
    for model, mode in (
        (tiny_model_dir, ["--truncation", "sliding"]),
        (tiny_model_dir, ["--truncation", "turns"]),
        (tiny_model_dir, ["--prompt-layout", "episode"]),
        (numbered, ["--truncation", "sliding"]),
    ):
        name = "numbered" if model == numbered else mode[1]
        argv = ["--db", db, "score", "--backend", "transformers", "--model", str(model), "--dry-run"]
        r = CliRunner().invoke(cli, [*argv, "--max-context", "1024", *mode, "--json"])
        assert r.exit_code == 0, r.output
        seen[name] = json.loads(r.output)
        r = CliRunner().invoke(cli, [*argv, "--max-context", "1024", *mode])
        assert r.exit_code == 0, r.output
        assert ("grows with the square" in r.output) == (name == "numbered"), r.output
    for name in ("sliding", "turns", "numbered"):
        assert seen[name]["truncated_steps"] > 0, name
    assert seen["numbered"]["quadratic_in_session"]
    assert not any(seen[name]["quadratic_in_session"] for name in ("sliding", "turns", "episode"))
    argv = ["--db", db, "score", "--backend", "transformers", "--model", str(tiny_model_dir), "--dry-run"]
    r = CliRunner().invoke(cli, [*argv, "--json"])  # the model's whole context: nothing cut, nothing to say
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["truncated_steps"] == 0


def _reasoning_session(seed: int, steps: int = 10, user_at: int = 3):
    """Issue 40's session: long reasoning, a user turn at step ``user_at`` (Qwen3's template
    then drops the earlier steps' reasoning, so the whole history is short)."""
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta run test file path value data build step".split()

    def t(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    messages, rows = [{"role": "user", "content": "Task: " + t(20)}], []
    for s in range(steps):
        if s == user_at:
            messages.append({"role": "user", "content": "Continue. " + t(5)})
        messages.append({"role": "assistant", "content": f"<think>\n{t(150)}\n</think>\n\n{t(5)}"})
        rows.append(
            {
                "step_index": s,
                "message_index": len(messages) - 1,
                "phase": "executing",
                "subtask_id": None,
                "subtask_reward": 0.5,
            }
        )
    outcome = {"reward": 0.5, "phase": "executing", "plan_score": 0.5, "plan": [], "frozen_scores": {}}
    return messages, outcome, rows


def test_the_whole_history_is_taken_when_it_fits_though_a_shorter_window_is_longer():
    """Issue 40: at max_context 485 step 4's whole history fits exactly (485 ids); the window
    one turn shorter carries the marker and is longer (the turn it leaves out lost its
    reasoning to the later user turn). The fast walk took a later window (479 ids, 320
    truncated)."""
    tok = real_tokenizer("qwen3")
    messages, outcome, rows = _reasoning_session(0)
    builder = PromptBuilder(tok, max_context=485, truncation="turns", max_logprob_tokens=0)
    fast = builder.build_episode(messages, outcome, rows)
    rule = builder.build_step_reference(messages, outcome, rows[4])
    assert isinstance(rule, StepPrompt) and len(rule.input_ids) == 485 and rule.truncated_prefix_tokens == 0
    assert fast[4] == rule
    for row, prompt in zip(rows, fast, strict=True):
        assert prompt == builder.build_step_reference(messages, outcome, row)


def test_a_truncated_prompt_keeps_its_own_windows_anchor():
    """A step whose window leaves turns out cuts its ids after the head with the marker; an
    earlier step of the episode cut after the head without it (the anchor is the step's own,
    not the episode's first)."""
    import random

    tok = real_tokenizer("qwen2.5")
    rng = random.Random(3)
    words = "alpha beta gamma delta run test file path value data build step é 東 \x07".split()

    def t(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    messages = [{"role": "user", "content": "Task: " + t(8)}]
    for reasoning, words_after in ((150, 4), (40, 5), (40, 10)):
        messages.append({"role": "assistant", "content": f"<think>\n{t(reasoning)}\n</think>\n\n{t(words_after)}"})
    rows = [
        {"step_index": s, "message_index": s + 1, "phase": "executing", "subtask_id": None, "subtask_reward": 0.5}
        for s in range(3)
    ]
    outcome = {"reward": 0.5, "phase": "executing", "plan_score": 0.5, "plan": [], "frozen_scores": {}}
    builder = PromptBuilder(tok, max_context=200, truncation="turns", max_logprob_tokens=0)
    fast = builder.build_episode(messages, outcome, rows)
    assert any(isinstance(p, StepPrompt) and p.truncated_prefix_tokens for p in fast)
    for row, prompt in zip(rows, fast, strict=True):
        assert prompt == builder.build_step_reference(messages, outcome, row)
    # a window too long even at its shortest is cut as sliding cuts: after the anchor, one marker
    # (the head's own marker is not in the anchor), whatever the budget
    said = "earlier trajectory context truncated"
    cut_once = 0
    for context in (120, 160, 200, 260):
        builder = PromptBuilder(tok, max_context=context, truncation="turns", max_logprob_tokens=0)
        for row, prompt in zip(rows, builder.build_episode(messages, outcome, rows), strict=True):
            assert prompt == builder.build_step_reference(messages, outcome, row)
            if isinstance(prompt, StepPrompt):
                assert tok.decode(prompt.input_ids).count(said) <= 1, (context, row)
                cut_once += tok.decode(prompt.input_ids).count(said)
    assert cut_once
