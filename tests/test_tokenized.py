"""Token-level training export: spans checked by decoding, weights against the reference, refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _tokenizers import CHATML_WITH_BOS, bos_tokenizer, episode, loaded_tokenizer, real_tokenizer
from test_credits import add_scorer, add_scores
from test_export import _reference_inputs

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.devkit.original_math import build_hcapo_rows
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.export import export_dataset
from hcapo_store.outputs.tokenized import IGNORE_INDEX
from hcapo_store.rendering.alignment import EpisodeRenderer
from hcapo_store.rendering.prompts import normalize_messages
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store

# Like Qwen3: an assistant turn's content is dropped once a later user message follows it.
FORGETFUL = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    + CHATML_WITH_BOS.replace(
        "{{ m.content }}",
        "{{ '[earlier turn]' if m.role == 'assistant' and loop.index0 < ns.last_user else m.content }}",
    )
)


def _two_turn_episodes(path: Path) -> Path:
    """Two JSONL episodes with a second user message after two assistant steps."""
    lines = []
    for name, reward in (("good", 0.9), ("bad", 0.3)):

        def call(i: int, name: str = name) -> dict:
            return {
                "role": "assistant",
                "content": f"step {i} of {name}",
                "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
                ],
            }

        def result(i: int) -> dict:
            return {"role": "tool", "name": "bash", "tool_call_id": f"c{i}", "content": f"out {i}"}

        messages = [
            {"role": "user", "content": "task"},
            call(0),
            result(0),
            call(1),
            result(1),
            {"role": "user", "content": "now finish"},
            call(2),
            result(2),
            {"role": "assistant", "content": "done"},
        ]
        lines.append(json.dumps({"episode_id": name, "reward": reward, "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def scored_with(store: Store, samples: Path, tok_dir: Path) -> Store:
    """Samples ingested, a scorer whose spec names ``tok_dir``'s tokenizer, random scores, credits."""
    ingest(store, [samples])
    fingerprint = tokenizer_fingerprint(loaded_tokenizer(tok_dir), tok_dir)
    add_scorer(store, "sc", spec={"tokenizer": fingerprint, "max_logprob_tokens": 2048})
    add_scores(store, "sc", seed=7)
    compute_credits(store, name="r")
    return store


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rendered_action(tok, messages: list[dict], m: int) -> str:
    """The action text as scoring defines it: full render minus the generation-prompt prefix."""
    msgs = normalize_messages(messages)
    prefix = tok.apply_chat_template(msgs[:m], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(msgs[: m + 1], tokenize=False)
    assert full.startswith(prefix)
    return full[len(prefix) :]


EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3's template inserts on a last turn without reasoning


def _own_action(tok, messages: list[dict], m: int) -> str:
    """The policy's own text of the step, written out for ChatML templates: the rendered action
    up to and including <|im_end|>, without Qwen3's inserted empty think block."""
    full = tok.apply_chat_template(normalize_messages(messages)[: m + 1], tokenize=False)
    header = "<|im_start|>assistant\n"
    action = full[full.rindex(header) + len(header) : full.rindex("<|im_end|>") + len("<|im_end|>")]
    if action.startswith(EMPTY_THINK) and "<think>" not in (messages[m].get("content") or ""):
        action = action[len(EMPTY_THINK) :]
    return action


@pytest.mark.parametrize("rendering", ["turns", "whole"])
def test_weighted_tokens_decode_to_each_steps_own_tokens(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path, rendering: str
) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    tok = load_tokenizer(demo_tokenizer_dir)
    summary = export_dataset(
        store,
        tmp_path / "t.jsonl",
        "r",
        min_reward=0.0,
        layout="tokenized",
        tokenizer=demo_tokenizer_dir,
        rendering=rendering,
    )
    rows = _rows(tmp_path / "t.jsonl")
    assert rows and summary.episodes_in_dataset == len(rows) and summary.unaligned_steps == 0
    assert summary.config["rendering"] == rendering and summary.unaligned_reasons == {}
    ep_ids = dict(store.query("SELECT name, id FROM episodes")[1])
    with store.engine.connect() as conn:
        for row in rows:
            messages = load_messages(conn, ep_ids[row["episode"]])
            assert len(row["token_ids"]) == len(row["labels"]) == len(row["advantages"])
            if rendering == "whole":
                whole = tok.apply_chat_template(normalize_messages(messages), tokenize=False)
                assert row["token_ids"] == tok.encode(whole, add_special_tokens=False)
            else:  # the row starts with the first step's prompt, exactly as scoring renders it
                m0 = row["step_message_indices"][0]
                prompt = tok.apply_chat_template(
                    normalize_messages(messages)[:m0], tokenize=False, add_generation_prompt=True
                )
                assert tok.decode(row["token_ids"][: row["step_spans"][0][0]]) == prompt
            weighted = set()
            for m, w, (start, end) in zip(row["step_message_indices"], row["step_advantages"], row["step_spans"]):
                assert tok.decode(row["token_ids"][start:end]) == _own_action(tok, messages, m)
                if w > 0:
                    assert row["labels"][start:end] == row["token_ids"][start:end]
                    assert row["advantages"][start:end] == [w] * (end - start)
                    weighted.update(range(start, end))
            for i, (label, adv) in enumerate(zip(row["labels"], row["advantages"])):
                if i not in weighted:
                    assert label == IGNORE_INDEX and adv == 0.0
            assert row["provenance"]["credits"] == "r" and row["provenance"]["scorer_id"] == "sc"
            assert row["provenance"]["rendering"] == rendering


def test_step_weights_equal_eq8_reference(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path
) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    export_dataset(
        store, tmp_path / "t.jsonl", "r", omega=0.6, min_reward=0.0, layout="tokenized", tokenizer=demo_tokenizer_dir
    )
    ref_rows, _ = build_hcapo_rows(_reference_inputs(store, "r"), omega=0.6, min_reward=0.0)
    ref = {r["_episode_id"]: r for r in ref_rows}
    rows = _rows(tmp_path / "t.jsonl")
    assert {r["_episode_id"] for r in rows} == set(ref)
    for row in rows:
        want = dict(zip(ref[row["_episode_id"]]["step_message_indices"], ref[row["_episode_id"]]["step_advantages"]))
        assert row["step_message_indices"] == list(want)  # every step aligned with this template
        assert row["step_advantages"] == pytest.approx(list(want.values()), abs=1.01e-6)
        assert row["_grpo_advantage"] == pytest.approx(ref[row["_episode_id"]]["_grpo_advantage"], abs=1.01e-6)


def test_steps_that_cannot_be_aligned_are_never_weighted(store: Store, tmp_path: Path) -> None:
    tok_dir = tmp_path / "forgetful"
    bos_tokenizer(tok_dir, template=FORGETFUL)
    scored_with(store, _two_turn_episodes(tmp_path / "eps.jsonl"), tok_dir)
    # omega 0: every step of the better episode has the same positive weight
    summary = export_dataset(
        store,
        tmp_path / "t.jsonl",
        "r",
        omega=0.0,
        min_reward=0.0,
        layout="tokenized",
        tokenizer=tok_dir,
        rendering="whole",
    )
    (row,) = _rows(tmp_path / "t.jsonl")
    assert row["episode"].endswith("good") and summary.unaligned_steps == 2
    assert summary.unaligned_reasons == {"rendering": 2}
    # the two steps before the second user message render as "[earlier turn]" in the episode
    assert [u["step_index"] for u in row["unaligned_steps"]] == [0, 1]
    assert all(u["reason"].startswith("rendering") for u in row["unaligned_steps"])
    assert row["step_indices"] == [2, 3] and all(w > 0 for w in row["step_advantages"])
    spans = [range(a, b) for a, b in row["step_spans"]]
    weighted = [i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
    assert weighted == [i for span in spans for i in span]
    assert [i for i, a in enumerate(row["advantages"]) if a] == weighted
    tok = loaded_tokenizer(tok_dir)
    assert "step 0" not in tok.decode([row["token_ids"][i] for i in weighted])
    assert tok.decode(row["token_ids"][spans[0].start : spans[0].stop]).startswith("step 2 of good")

    # Turn by turn, every step is in the row as the policy produced it.
    summary = export_dataset(
        store, tmp_path / "turns.jsonl", "r", omega=0.0, min_reward=0.0, layout="tokenized", tokenizer=tok_dir
    )
    (row,) = _rows(tmp_path / "turns.jsonl")
    assert summary.unaligned_steps == 0 and row["step_indices"] == [0, 1, 2, 3]
    texts = [tok.decode(row["token_ids"][a:b]) for a, b in row["step_spans"]]
    assert [t.split("<")[0] for t in texts] == ["step 0 of good", "step 1 of good", "step 2 of good", "done"]
    assert all(t.endswith("<|im_end|>") for t in texts)


@pytest.mark.parametrize("rendering", ["turns", "whole"])
def test_qwen3_weights_the_policys_own_tokens(rendering: str) -> None:
    tok = real_tokenizer("qwen3")
    messages, _, steps = episode(3, steps=12, thinking=True, extra_user_turns=True)
    al = EpisodeRenderer(tok).align(messages, [(s["step_index"], s["message_index"]) for s in steps], rendering)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for s in steps:
        m = s["message_index"]
        if rendering == "turns" or m > last_user or "<think>" not in messages[m]["content"]:
            assert s["step_index"] in al.spans, al.refused.get(s["step_index"])
        else:  # rendered without its reasoning in the whole episode: not the policy's tokens
            assert al.refused[s["step_index"]].startswith("rendering")
    for index, (start, end) in al.spans.items():
        m = steps[index]["message_index"]
        own = tok.decode(al.input_ids[start:end])
        assert own == _own_action(tok, messages, m)
        assert not own.startswith(EMPTY_THINK) and "<|im_start|>" not in own
    if rendering == "whole":
        assert al.refused


def test_wrong_tokenizer_is_refused(store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    other = tmp_path / "other"
    bos_tokenizer(other)
    from hcapo_store.errors import ExportError

    with pytest.raises(ExportError, match="not the one scorer"):
        export_dataset(store, tmp_path / "t.jsonl", "r", layout="tokenized", tokenizer=other)
    assert not (tmp_path / "t.jsonl").exists()


def test_parquet_and_datasets(store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    scored_with(store, samples, demo_tokenizer_dir)
    for fmt in ("jsonl", "parquet"):
        export_dataset(
            store, tmp_path / f"t.{fmt}", "r", min_reward=0.0, layout="tokenized", tokenizer=demo_tokenizer_dir, fmt=fmt
        )
    js = datasets.load_dataset("json", data_files=str(tmp_path / "t.jsonl"), split="train")
    pq = datasets.load_dataset("parquet", data_files=str(tmp_path / "t.parquet"), split="train")
    assert len(js) == len(pq) > 0
    assert js["token_ids"] == pq["token_ids"] and js["labels"] == pq["labels"]
    for a, b in zip(js["advantages"], pq["advantages"]):
        assert a == pytest.approx(b, rel=1e-6)


def test_weights_in_messages(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path, runner, db_path: Path
) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    r = runner.invoke(
        cli,
        [
            "--db",
            str(db_path),
            "export",
            "dataset",
            str(tmp_path / "w.jsonl"),
            "--min-reward",
            "0",
            "--weights-in-messages",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    export_dataset(store, tmp_path / "plain.jsonl", "r", min_reward=0.0)
    for row, plain in zip(_rows(tmp_path / "w.jsonl"), _rows(tmp_path / "plain.jsonl"), strict=True):
        weights = {i: m["weight"] for i, m in enumerate(row["messages"]) if "weight" in m}
        assert weights == dict(zip(plain["step_message_indices"], plain["step_advantages"]))
        assert [{k: v for k, v in m.items() if k != "weight"} for m in row["messages"]] == plain["messages"]
    export_dataset(store, tmp_path / "w.parquet", "r", min_reward=0.0, layout="weights-in-messages", fmt="parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "w.parquet").to_pylist()
    got = [[m["weight"] for m in row["messages"]] for row in table]
    want = [[m.get("weight") for m in row["messages"]] for row in _rows(tmp_path / "w.jsonl")]
    assert got == want


def test_cli_tokenized_needs_tokenizer(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path, runner, db_path: Path
) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    r = runner.invoke(cli, ["--db", str(db_path), "export", "dataset", str(tmp_path / "t.jsonl"), "--tokenized"])
    assert r.exit_code == 1 and "--tokenizer" in r.output and "Traceback" not in r.output
    r = runner.invoke(
        cli,
        [
            "--db",
            str(db_path),
            "export",
            "dataset",
            str(tmp_path / "t.jsonl"),
            "--tokenized",
            "--tokenizer",
            str(demo_tokenizer_dir),
            "--min-reward",
            "0",
        ],
    )
    assert r.exit_code == 0, r.output
    assert (
        re.search(r"\d+ step\(s\) \(\d+ positive, \d+ negative, \d+ zero\)", r.output)
        and (tmp_path / "t.jsonl").exists()
    )
    n = store.query("SELECT count(DISTINCT episode) FROM step_credits WHERE run = 'r'", read_only=True)[1][0][0]
    assert f"export: {n}/{n} episodes" in r.stderr  # progress with its total (a pipe: one log line at the end)


def test_the_scorers_tokenizer_is_found_where_scoring_loaded_it(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path, runner, db_path: Path
) -> None:
    import shutil

    from hcapo_store.scoring.scorer import known_tokenizer_dirs, remember_tokenizer

    copy = tmp_path / "tok-copy"
    shutil.copytree(demo_tokenizer_dir, copy)
    scored_with(store, samples, copy)
    files_sha256 = tokenizer_fingerprint(load_tokenizer(copy), copy)["files_sha256"]
    other = tmp_path / "tok-other"
    shutil.copytree(demo_tokenizer_dir, other)
    export = ["--db", str(db_path), "export", "dataset", "--tokenized", "--min-reward", "0"]
    given = runner.invoke(cli, [*export, str(tmp_path / "given.jsonl"), "--tokenizer", str(other)])
    assert given.exit_code == 0, given.output
    assert known_tokenizer_dirs(store, files_sha256) == []  # an export records nothing: it only reads
    remember_tokenizer(store, files_sha256, copy)  # what `score --tokenizer` records
    first = runner.invoke(cli, [*export, str(tmp_path / "a.jsonl"), "--tokenizer", str(copy)])
    assert first.exit_code == 0, first.output
    again = runner.invoke(cli, [*export, str(tmp_path / "b.jsonl")])  # no --tokenizer: where scoring loaded it
    assert again.exit_code == 0, again.output
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    summary = json.loads((tmp_path / "b.jsonl.summary.json").read_text())
    assert summary["config"]["tokenizer"] == str(copy)
    # the directory changed since: never used unasked, the message names where it looked
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"added_by_someone": 1, ', 1))
    changed = runner.invoke(cli, [*export, str(tmp_path / "c.jsonl")])
    assert changed.exit_code == 1 and str(copy.resolve()) in changed.output and "--tokenizer" in changed.output
    assert not (tmp_path / "c.jsonl").exists()


def test_a_tokenizer_directory_the_store_names_is_said_and_must_hash_as_the_scorers(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path, runner, db_path: Path
) -> None:
    """``tokenizer_locations`` may name a directory someone else chose (issue 41): without
    --tokenizer the export says which directory it took and why, and refuses one whose files'
    hashes differ from the scorer's, even when its content is equal (a re-saved copy is taken
    only when passed with --tokenizer)."""
    import shutil

    from sqlalchemy import text

    from hcapo_store.storage import db

    scored_with(store, samples, demo_tokenizer_dir)
    files_sha256 = tokenizer_fingerprint(load_tokenizer(demo_tokenizer_dir), demo_tokenizer_dir)["files_sha256"]
    chosen = tmp_path / "someone-else-chose"
    shutil.copytree(demo_tokenizer_dir, chosen)
    with db.write(store.engine) as conn:
        conn.execute(
            text(
                "INSERT INTO tokenizer_locations (files_sha256, path, seen_at) VALUES (:h, :p, '2026-01-01T00:00:00')"
            ),
            {"h": files_sha256, "p": str(chosen.resolve())},
        )
    export = ["--db", str(db_path), "export", "dataset", "--tokenized", "--min-reward", "0"]
    taken = runner.invoke(cli, [*export, str(tmp_path / "a.jsonl")])
    assert taken.exit_code == 0, taken.output
    assert f"tokenizer: {chosen.resolve()} (no --tokenizer: the store records it" in taken.output, taken.output
    # the same content, other bytes (re-serialised): not taken unasked
    tj = chosen / "tokenizer.json"
    tj.write_text(json.dumps(json.loads(tj.read_text()), indent=1))
    refused = runner.invoke(cli, [*export, str(tmp_path / "b.jsonl")])
    assert refused.exit_code == 1, refused.output
    assert f"{chosen.resolve()} (its files' hashes differ from the scorer's)" in refused.output, refused.output
    assert not (tmp_path / "b.jsonl").exists()


def test_score_remembers_where_its_tokenizer_was(tmp_path: Path, tiny_model_dir: Path) -> None:
    from hcapo_store.devkit.refserver import make_server
    from hcapo_store.devkit.synth import write_standard_episodes
    from hcapo_store.scoring.job import ScoreConfig, prepare, run_scoring
    from hcapo_store.scoring.scheduler import RunOptions
    from hcapo_store.scoring.scorer import known_tokenizer_dirs

    # One small episode: a scoring run records where its tokenizer was whatever it scores
    # (the shared samples took seconds of tiny-model forwards to show the same).
    write_standard_episodes(tmp_path / "eps", 1, seed=3, steps_per_subtask=1, output_words=10)
    with Store.open(str(tmp_path / "s.db")) as store, make_server(tiny_model_dir) as server:
        ingest(store, [tmp_path / "eps"])
        prep = prepare(store, ScoreConfig(server=server.url, tokenizer=str(tiny_model_dir), max_context=2048))
        assert run_scoring(store, prep, RunOptions(concurrency=2)).failed == 0
        assert known_tokenizer_dirs(store, prep.spec["tokenizer"]["files_sha256"]) == [tiny_model_dir.resolve()]
