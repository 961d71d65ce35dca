"""The rollout's own logprobs as a scorer (docs/FAMILY.md): a real-shaped OpenAI chat-completions
JSONL with ``logprobs`` beside each assistant message, checked against the tokenizer's ids."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from hcapo_store.cli import cli
from hcapo_store.credits.log_ratio import compute_log_ratio
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.rollout_scores import store_rollout_scores
from hcapo_store.rendering.tokenizers import load_tokenizer
from hcapo_store.storage.store import Store

TEXTS = ["the cat sat on the mat", "then it ran away", "done with the task"]


def _entries(tok, content: str, rng: random.Random, *, end: bool) -> list[dict]:
    """OpenAI's shape: token text, logprob, UTF-8 bytes and top_logprobs, per sampled token
    (the ids from encoding the text alone, not from the store's alignment)."""
    ids = tok.encode(content, add_special_tokens=False)
    if end:
        ids = [*ids, tok.convert_tokens_to_ids("<|im_end|>")]
    out = []
    for i in ids:
        text = tok.decode([i])
        lp = round(-rng.random() * 3, 4)
        out.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(text.encode())}],
            }
        )
    return out


def _jsonl(path: Path, tok) -> tuple[Path, dict[str, list[list[float]]]]:
    rng = random.Random(11)
    lines, want = [], {}
    for k, name in enumerate(("with-eot", "without-eot", "tampered")):
        messages: list[dict] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"task {k}"}]
        want[name] = []
        for t, content in enumerate(TEXTS):
            entries = _entries(tok, content, rng, end=name != "without-eot")
            if name == "tampered" and t == 1:
                entries[2]["bytes"] = list(b" dog")
                entries[2]["token"] = " dog"
            want[name].append([e["logprob"] for e in entries])
            messages.append(
                {"role": "assistant", "content": content, "logprobs": {"content": entries, "refusal": None}}
            )
            messages.append({"role": "user", "content": "continue"})
        record = {
            "episode_id": name,
            "reward": 1.0,
            "model": "policy-7b",
            "engine": "vllm",
            "weight_version": "step-3",
            "messages": messages[:-1],
        }
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path, want


def test_openai_logprobs_are_stored_checked_against_the_ids(tmp_path, demo_tokenizer_dir, runner):
    tok = load_tokenizer(demo_tokenizer_dir)
    path, want = _jsonl(tmp_path / "rollouts.jsonl", tok)
    store = Store.open(str(tmp_path / "s.db"))
    assert ingest(store, [path]).failed == 0
    report = store_rollout_scores(store, demo_tokenizer_dir)
    assert (report.episodes, report.scored, report.failed, report.unscored) == (3, 8, 1, 0)
    assert len(report.scorers) == 1
    ((sid, label),) = report.scorers.items()
    assert label.startswith("rollout:policy-7b") and "wv=step-3" in label
    assert report.failures == [
        "rollouts.jsonl#tampered step 1: token 2: the rollout has bytes b' dog', the tokenizer's id there is "
        f"{tok.encode(TEXTS[1], add_special_tokens=False)[2]} ({tok.decode([tok.encode(TEXTS[1], add_special_tokens=False)[2]])!r})"
    ]
    rows = store.query(
        "SELECT e.external_id, s.step_index, sc.token_logprobs, sc.token_count, sc.total_action_tokens, "
        "sc.skipped_action_tokens FROM scores sc JOIN steps s ON s.id = sc.step_id "
        "JOIN episodes e ON e.id = s.episode_id WHERE sc.scorer_id = :s ORDER BY 1, 2",
        {"s": sid},
    )[1]
    assert len(rows) == 8
    for ep, index, blob, n, total, skipped in rows:
        assert list(struct.unpack(f"<{n}f", blob)) == pytest.approx(want[ep][index], abs=1e-6)
        assert total == len(want["with-eot"][index])  # the step's own tokens include the end of turn
        assert n == total - (ep == "without-eot") and skipped == total - n  # as every scorer's rows
    failed = store.query("SELECT last_error_kind, last_error FROM attempts WHERE status = 'failed'")[1]
    assert [f[0] for f in failed] == ["rollout_mismatch"] and "token 2" in failed[0][1]
    # the CLI: again, the same scores (replaced, not doubled), as JSON
    r = runner.invoke(
        cli, ["--db", str(tmp_path / "s.db"), "score-rollout", "--tokenizer", str(demo_tokenizer_dir), "--json"]
    )
    assert r.exit_code == 1, r.output  # the tampered step failed again
    assert json.loads(r.output)["scored"] == 8
    assert store.query("SELECT COUNT(*) FROM scores")[1][0][0] == 8


def test_a_rollout_scorer_is_the_student_of_a_log_ratio_run(tmp_path, demo_tokenizer_dir):
    """A teacher of the same engine, model and weights, scoring the same tokens: no --allow-mixed."""
    from test_credits import add_scorer

    from hcapo_store.rendering.tokenizers import tokenizer_fingerprint
    from hcapo_store.storage import db

    tok = load_tokenizer(demo_tokenizer_dir)
    path, _ = _jsonl(tmp_path / "rollouts.jsonl", tok)
    store = Store.open(str(tmp_path / "s.db"))
    ingest(store, [path])
    (student,) = store_rollout_scores(store, demo_tokenizer_dir).scorers
    spec = {
        "backend": {"kind": "vllm", "model": "policy-7b"},
        "tokenizer": tokenizer_fingerprint(tok, demo_tokenizer_dir),
        "action_span": "policy",
        "weight_version": "step-3",
    }
    add_scorer(store, "teacher", "hind", spec=spec)
    from sqlalchemy import text

    with db.write(store.engine) as conn:  # the teacher: the rollout's values + 0.5 on every token
        conn.execute(
            text(
                "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob, total_action_tokens, "
                "skipped_action_tokens, truncated_prefix_tokens, input_tokens, logprob_start_len, flattened, created_at) "
                "SELECT step_id, 'teacher', token_logprobs, token_count, mean_logprob, total_action_tokens, "
                "skipped_action_tokens, 0, "
                "input_tokens, logprob_start_len, flattened, created_at FROM scores WHERE scorer_id = :s"
            ),
            {"s": student},
        )
    result = compute_log_ratio(store, scorer="teacher", against=student, name="lr")
    assert result.created and result.run.episodes == 2  # the tampered episode has a failed step
    assert {r[0] for r in store.query("SELECT q_h FROM step_credits WHERE run = 'lr'")[1]} == {0.0}


def test_pi_and_verl_shapes_are_read_and_ids_checked(demo_tokenizer_dir):
    """A Pi session's logprobs beside the assistant entry, verl's rollout_log_probs with
    response_ids: read from the stored source's shape, and ids compared one by one."""
    import zlib

    from hcapo_store.ingestion.rollout_logprobs import RolloutFormatError, read_rollout
    from hcapo_store.outputs.rollout_scores import _token_bytes, check_tokens

    session = "\n".join(
        json.dumps(line)
        for line in (
            {"type": "session", "version": 3, "id": "s"},
            {"type": "message", "message": {"role": "user", "content": [{"type": "text", "text": "go"}]}},
            {
                "type": "message",
                "message": {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "model": "m"},
                "logprobs": [{"token": "token_id:7", "logprob": -0.5}, {"token": "token_id:9", "logprob": -0.25}],
            },
            {"type": "message", "message": {"role": "assistant", "content": [{"type": "text", "text": "no logprobs"}]}},
        )
    )
    raw = zlib.compress(json.dumps({"result.json": "{}", "pi_session.jsonl": session}).encode())
    record = read_rollout("pi_v3", raw)
    assert record is not None and record.policy == {"model": "m"}
    first, second = record.messages
    assert first is not None and first.ids == [7, 9] and first.logprobs == [-0.5, -0.25] and second is None
    verl = {
        "episode_id": "v",
        "reward": 1.0,
        "rollout": {"engine": "sglang", "weight_version": 12},
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok", "rollout_log_probs": [-0.1, -0.2], "response_ids": [3, 4]},
        ],
    }
    record = read_rollout("openai_jsonl", zlib.compress(json.dumps(verl).encode()))
    assert record is not None and record.policy == {"engine": "sglang", "weight_version": "12"}
    (entries,) = record.messages
    assert entries is not None and entries.ids == [3, 4]
    tok = load_tokenizer(demo_tokenizer_dir)
    bytes_of = _token_bytes(tok)
    assert check_tokens(entries, [3, 4], tok, bytes_of) is None
    assert check_tokens(entries, [3, 5], tok, bytes_of) == (
        f"token 1: the rollout has id 4, the tokenizer's id there is 5 ({tok.decode([5])!r})"
    )
    assert check_tokens(entries, [3, 4, 5, 6], tok, bytes_of) == "2 logprob entries for the step's 4 own tokens"
    bad = {**verl, "messages": [{"role": "assistant", "rollout_log_probs": "x"}]}
    with pytest.raises(RolloutFormatError, match="rollout_log_probs must be a list"):
        read_rollout("openai_jsonl", zlib.compress(json.dumps(bad).encode()))


def test_a_real_tokenizer_s_multibyte_tokens_match_by_their_bytes(tmp_path):
    """Qwen3's byte-level tokens that split a character: OpenAI's ``bytes`` are compared, not the
    (lossy) decoded text."""
    from _tokenizers import real_tokenizer

    from hcapo_store.rendering.tokenizers import resolve_tokenizer_dir

    tok = real_tokenizer("qwen3")
    tok_dir = resolve_tokenizer_dir(tok.name_or_path)
    content = "naïve café → 世界 ✓ done"
    ids = tok.encode(content, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    from hcapo_store.outputs.rollout_scores import _token_bytes

    bytes_of = _token_bytes(tok)
    entries = [{"token": tok.decode([i]), "logprob": -0.5, "bytes": list(bytes_of(i))} for i in ids]
    assert b"".join(bytes(e["bytes"]) for e in entries[:-1]).decode() == content
    record = {
        "episode_id": "mb",
        "reward": 1.0,
        "messages": [
            {"role": "user", "content": "say it"},
            {"role": "assistant", "content": content, "logprobs": {"content": entries}},
        ],
    }
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record) + "\n")
    store = Store.open(str(tmp_path / "s.db"))
    assert ingest(store, [path]).failed == 0
    report = store_rollout_scores(store, tok_dir)
    assert (report.scored, report.failed) == (1, 0), report.failures
