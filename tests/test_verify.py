"""Issue 40: every fast rendering strategy held to its rule in one frame (rendering/verify.py).

A strategy patched to be wrong is caught by its check policy, counted in
``strategy_fallbacks`` (the report, ``score --json``, ``score --dry-run``), and the rule's
prompt is what is stored. ``HCAPO_RENDERING=reference`` runs the rules only and stores the
same numbers, bit for bit. Real tokenizers, the reference server over the tiny model, real
SQLite files.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from _tokenizers import episode, real_tokenizer
from click.testing import CliRunner

from hcapo_store.cli import cli
from hcapo_store.rendering import verify
from hcapo_store.rendering.ascii_bpe import AsciiBpe, AsciiEncoding
from hcapo_store.rendering.episode_layout import EpisodeLayout
from hcapo_store.rendering.placement import Placer
from hcapo_store.rendering.prompts import PromptBuilder
from hcapo_store.rendering.requests import StepPrompt
from hcapo_store.rendering.segments import SegmentEncoder
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.rendering.turn_windows import TurnWindows


@pytest.fixture
def fresh_policy(monkeypatch):
    """Each check policy starts over, as in a new process (its first uses are checked)."""
    monkeypatch.setattr(verify, "_uses", {})


def _always_the_shortest(self, index, count, m, budget, overhead, prefix_len):  # a wrong TurnWindows
    return count - 1


def test_a_wrong_ascii_strategy_is_caught_and_switched_off(fresh_policy, monkeypatch):
    tok = real_tokenizer("qwen3")
    encoder = SegmentEncoder(tok)
    text = "<|im_start|>user\nplain ascii text, checked<|im_end|>\n"
    right = tok.encode(text, add_special_tokens=False)
    original = AsciiBpe.encode

    def wrong(self, piece):
        enc = original(self, piece)
        return None if enc is None else AsciiEncoding(enc.ids[::-1], piece, self)

    monkeypatch.setattr(AsciiBpe, "encode", wrong)
    before = verify.fallbacks().get("ascii_bpe", 0)
    assert encoder.encode_once(text) == right
    assert verify.fallbacks()["ascii_bpe"] == before + 1
    assert encoder._ascii is not None and encoder._ascii.off  # off for the process
    assert encoder.encode_once(text) == right


def test_a_wrong_placement_is_caught_and_the_rule_placed(fresh_policy, monkeypatch):
    tok = real_tokenizer("qwen3")
    messages, outcome, steps = episode(4, steps=8, tool_chars=60)
    builder = PromptBuilder(tok, max_context=100_000, layout="episode", action_span="policy")
    right = EpisodeLayout(builder).requests(messages, outcome, steps)
    original = Placer.place

    def wrong(self, msgs, wanted):
        placement = original(self, msgs, wanted)
        for index, span in placement.spans.items():
            placement.spans[index] = type(span)(
                span.start + 1, span.end, span.char_start, span.char_end, span.end_of_turn
            )
        return placement

    monkeypatch.setattr(Placer, "place", wrong)
    # the next one is sampled
    monkeypatch.setattr(verify, "_uses", {"placement": itertools.count(verify.PLACEMENT.every - 1)})
    before = verify.fallbacks().get("placement", 0)
    assert EpisodeLayout(builder).requests(messages, outcome, steps) == right
    assert verify.fallbacks()["placement"] == before + 1


def test_a_wrong_turn_window_is_caught_and_the_rule_stored(fresh_policy, monkeypatch):
    tok = real_tokenizer("qwen2.5")
    messages, outcome, steps = episode(5, steps=14, tool_chars=200)
    builder = PromptBuilder(tok, max_context=900, truncation="turns")
    rule = [builder.build_step_reference(messages, outcome, step) for step in steps]
    assert builder.build_episode(messages, outcome, steps) == rule
    monkeypatch.setattr(TurnWindows, "_earliest_fit", _always_the_shortest)
    before = verify.fallbacks().get("turn_windows", 0)
    assert builder.build_episode(messages, outcome, steps) == rule
    assert verify.fallbacks()["turn_windows"] == before + 1


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_reference_mode_builds_the_same_prompts(name, monkeypatch):
    """The rules only (HCAPO_RENDERING=reference) and the fast strategies: the same prompts
    for every truncation, layout and action span, on sessions that need truncating."""
    tok = real_tokenizer(name)
    messages, outcome, steps = episode(6, steps=12, tool_chars=300)
    for truncation in ("sliding", "window", "turns"):
        for span in ("rendered", "policy"):
            settings = dict(max_context=700, truncation=truncation, action_span=span)
            fast = PromptBuilder(tok, **settings)
            monkeypatch.setenv(verify.RENDERING_ENV, "reference")
            reference = PromptBuilder(tok, **settings)
            monkeypatch.delenv(verify.RENDERING_ENV)
            assert reference.reference and not fast.reference
            expected = reference.build_episode(messages, outcome, steps)
            assert any(isinstance(p, StepPrompt) and p.truncated_prefix_tokens for p in expected)
            assert fast.build_episode(messages, outcome, steps) == expected, (truncation, span)
    fast = EpisodeLayout(PromptBuilder(tok, max_context=700, layout="episode"))
    reference = EpisodeLayout(PromptBuilder(tok, max_context=700, layout="episode", rendering="reference"))
    assert fast.requests(messages, outcome, steps) == reference.requests(messages, outcome, steps)


def test_an_unknown_rendering_mode_is_refused(monkeypatch):
    monkeypatch.setenv(verify.RENDERING_ENV, "fastest")
    with pytest.raises(ValueError, match="HCAPO_RENDERING must be one of"):
        verify.reference_mode()


def _score(db: str, url: str, tokenizer: Path, *extra: str) -> dict:
    argv = ["--db", db, "score", "--server", url, "--tokenizer", str(tokenizer), "--max-context", "1024"]
    r = CliRunner().invoke(cli, [*argv, *extra, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{") :])


def _stored(db: str) -> dict:
    from hcapo_store.storage.store import Store

    with Store.open(db) as store:
        rows = store.query(
            "SELECT c.scorer_id, e.name, s.step_index, c.input_tokens, c.token_logprobs FROM scores c "
            "JOIN steps s ON s.id = c.step_id JOIN episodes e ON e.id = s.episode_id"
        )[1]
    return {(r[0], r[1], r[2]): (r[3], bytes(r[4])) for r in rows}


def test_a_planted_disagreement_is_counted_and_the_rules_numbers_stored(tmp_path, tiny_model_dir, monkeypatch):
    """Done-when of issue 40, end to end: `score --truncation turns` with TurnWindows patched to
    take the wrong window stores what the rule does (the same bytes as an unpatched run and
    as reference mode), and says so: ``"strategy_fallbacks": {"turn_windows": n}`` in
    ``--json`` and in ``--dry-run``; an unpatched run reports an empty object."""
    from hcapo_store.devkit.refserver import make_server
    from hcapo_store.devkit.synth import write_standard_episodes

    write_standard_episodes(tmp_path / "eps", 2, seed=9, steps_per_subtask=4, output_words=30)
    dbs = {name: str(tmp_path / f"{name}.db") for name in ("fast", "planted", "reference")}
    for db in dbs.values():
        assert CliRunner().invoke(cli, ["--db", db, "ingest", str(tmp_path / "eps")]).exit_code == 0
    with make_server(tiny_model_dir) as server:
        fast = _score(dbs["fast"], server.url, tiny_model_dir, "--truncation", "turns")
        assert fast["strategy_fallbacks"] == {} and fast["scored"] > 0
        monkeypatch.setenv(verify.RENDERING_ENV, "reference")
        reference = _score(dbs["reference"], server.url, tiny_model_dir, "--truncation", "turns")
        monkeypatch.delenv(verify.RENDERING_ENV)
        monkeypatch.setattr(TurnWindows, "_earliest_fit", _always_the_shortest)
        monkeypatch.setattr(verify, "_uses", {})
        argv = ["--db", dbs["planted"], "score", "--server", server.url, "--tokenizer", str(tiny_model_dir)]
        dry = CliRunner().invoke(cli, [*argv, "--max-context", "1024", "--truncation", "turns", "--dry-run"])
        assert dry.exit_code == 0, dry.output
        assert "strategy fallbacks (the rule's prompts stored): turn_windows" in dry.output
        planted = _score(dbs["planted"], server.url, tiny_model_dir, "--truncation", "turns")
    assert planted["strategy_fallbacks"]["turn_windows"] >= 1
    assert reference["strategy_fallbacks"] == {}
    stored = _stored(dbs["fast"])
    assert stored and _stored(dbs["planted"]) == stored == _stored(dbs["reference"])
    builder = PromptBuilder(load_tokenizer(tiny_model_dir), max_context=1024, truncation="turns")
    assert builder.reference is False


@pytest.mark.slow
def test_reference_mode_stores_the_demo_and_samples_bit_for_bit(tmp_path, tiny_model_dir, samples, monkeypatch):
    """HCAPO_RENDERING=reference scores the demo's episodes and the shared samples to the same
    scorer and the same stored logprobs as the default, byte for byte, in both layouts."""
    from hcapo_store.devkit.demo import find_episodes
    from hcapo_store.devkit.refserver import make_server

    demo = find_episodes(tmp_path / "demo")
    dbs = {mode: str(tmp_path / f"{mode}.db") for mode in ("fast", "reference")}
    for db in dbs.values():
        for source in (demo, samples):
            assert CliRunner().invoke(cli, ["--db", db, "ingest", str(source)]).exit_code == 0
    with make_server(tiny_model_dir) as server:
        for mode, db in dbs.items():
            if mode == "reference":
                monkeypatch.setenv(verify.RENDERING_ENV, "reference")
            for layout in ("per-step", "episode"):
                report = _score(db, server.url, tiny_model_dir, "--prompt-layout", layout)
                assert report["scored"] > 0 and report["strategy_fallbacks"] == {}
    fast = _stored(dbs["fast"])
    assert len({key[0] for key in fast}) == 2  # two scorers, one per layout: the same ids in both modes
    assert _stored(dbs["reference"]) == fast


# The rendering tests that hold prompts to rules written out independently in the tests (not
# to this package's own rules), and so mean something in both modes; CI runs them here again
# under HCAPO_RENDERING=reference (the default mode runs them where they live).
REFERENCE_MODE_TESTS = [
    "tests/test_turns_truncation.py::test_each_prompt_is_the_rendering_of_the_most_recent_turns_that_fit[qwen3]",
    "tests/test_turns_truncation.py::test_each_prompt_is_the_rendering_of_the_most_recent_turns_that_fit[chatml-bos]",
    "tests/test_prompts.py::test_truncation_keeps_anchor_marker_tail_and_whole_action",
    "tests/test_prompts.py::test_template_rejection_flattens_and_records_it",
    "tests/test_prompts.py::test_qwen3_history_rewrite_is_an_alignment_failure",
    "tests/test_prompts.py::test_max_logprob_tokens_scores_the_suffix",
    "tests/test_prompts.py::test_fingerprint_of_real_tokenizer",
    "tests/test_episode_layout.py::test_windows_stay_within_budget_and_score_every_step_once",
]


@pytest.mark.slow
def test_the_rendering_tests_pass_in_reference_mode():
    import os
    import subprocess
    import sys

    from _shared import REPO

    env = {**os.environ, verify.RENDERING_ENV: "reference"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *REFERENCE_MODE_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
