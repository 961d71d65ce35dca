"""The server's tokenizer (issue 33, item 1) and what scoring requests ask the servers for
(issue 33, item 6).

``score --tokenizer`` with a tokenizer the server does not use is refused before anything is
scored, in one line naming both: a probe text goes through the server's own tokenization
(``/tokenize``, or SGLang's ``/generate`` with text) and must come back as our ids. The
servers are the real reference server over the tiny model (devkit/refserver.py), directly
or behind tests/faultserver.py; the "other" tokenizer is the demo tokenizer with its learned
ids permuted (same size, same added tokens and chat template: every id it makes is one the
model has, so the old highest-id check passed it), and, where ../shared is present, the real
Qwen3 tokenizer on a tiny model of its vocabulary (the issue's report: the demo tokenizer
scored 65 of 65 steps against a Qwen3-vocabulary server).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from _shared import SHARED
from faultserver import FaultServer
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import ReferenceServer, make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.devkit.tiny_model import build_tiny_model
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

MAX_CONTEXT = "2048"


@pytest.fixture(scope="module")
def episodes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("episodes")
    write_standard_episodes(root, 2, seed=5, steps_per_subtask=1, output_words=10)
    return root


@pytest.fixture(scope="module")
def permuted_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """The demo tokenizer with the ids of its learned vocabulary reversed: a tokenizer of the
    same size, added tokens and chat template that encodes the same text to other ids."""
    out = tmp_path_factory.mktemp("permuted-tokenizer")
    shutil.copy(demo_tokenizer_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    spec = json.loads((demo_tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    learned = sorted(vocab, key=vocab.__getitem__)[256:]  # the byte alphabet keeps its ids
    ids = sorted(vocab[t] for t in learned)
    for token, new_id in zip(learned, reversed(ids)):
        vocab[token] = new_id
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.fixture(scope="module")
def permuted_server(tiny_model_dir: Path, permuted_tokenizer_dir: Path) -> Iterator[ReferenceServer]:
    """The tiny model served with the permuted tokenizer: its /tokenize is the other tokenizer's."""
    with make_server(tiny_model_dir, tokenizer_dir=permuted_tokenizer_dir) as server:
        yield server


def _db(tmp_path: Path, episodes_dir: Path) -> str:
    db = str(tmp_path / "x.db")
    with Store.open(db) as store:
        ingest(store, [episodes_dir])
    return db


def _scores(db: str) -> int:
    with Store.open(db) as store, store.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM scores")).scalar_one()


def _refused_line(output: str) -> str:
    (line,) = output.strip().splitlines()
    return line


def test_the_permuted_tokenizer_differs_but_passes_the_highest_id_check(
    demo_tokenizer_dir: Path, permuted_tokenizer_dir: Path
) -> None:
    """The case the old check let through: same size, every id valid, other ids for the same text."""
    from transformers import AutoTokenizer

    demo = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))
    other = AutoTokenizer.from_pretrained(str(permuted_tokenizer_dir))
    assert len(demo) == len(other) and max(demo.get_vocab().values()) == max(other.get_vocab().values())
    sample = "def parse(text):\n    return None"
    assert demo(sample)["input_ids"] != other(sample)["input_ids"]
    assert demo.decode(demo(sample)["input_ids"]) == other.decode(other(sample)["input_ids"]) == sample


def test_sglang_a_tokenizer_the_server_does_not_use_is_refused_before_any_request(
    tmp_path, runner, episodes_dir, tiny_model_dir, permuted_server, permuted_tokenizer_dir
):
    db = _db(tmp_path, episodes_dir)
    with FaultServer(permuted_server) as fault:
        base = ["--db", db, "score", "--server", fault.url, "--max-context", MAX_CONTEXT]
        r = runner.invoke(cli, [*base, "--tokenizer", str(tiny_model_dir)])
        assert r.exit_code == 1, r.output
        line = _refused_line(r.output)
        assert "is not the one the sglang server at" in line and str(permuted_tokenizer_dir) in line, line
        assert "pass --tokenizer" in line
        assert fault.requests == 0 and _scores(db) == 0  # nothing was sent to score

        # The server's own tokenizer is accepted, and scores.
        r = runner.invoke(cli, [*base, "--tokenizer", str(permuted_tokenizer_dir)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert fault.requests > 0 and _scores(db) > 0


def test_in_process_a_tokenizer_beside_model_that_is_not_the_models_is_refused(
    tmp_path, runner, episodes_dir, tiny_model_dir, permuted_tokenizer_dir
):
    """``--model DIR --tokenizer OTHER`` (issue 39 §7): probed against the model directory's own
    tokenizer, as a server's is; before, the permuted tokenizer scored every step, silently wrong."""
    db = _db(tmp_path, episodes_dir)
    base = ["--db", db, "score", "--model", str(tiny_model_dir), "--max-context", MAX_CONTEXT]
    r = runner.invoke(cli, [*base, "--tokenizer", str(permuted_tokenizer_dir)])
    assert r.exit_code == 1, r.output
    line = _refused_line(r.output)
    assert f"tokenizer {permuted_tokenizer_dir.name!r} is not the one the transformers server at" in line, line
    assert str(tiny_model_dir) in line and "pass --tokenizer" in line
    assert _scores(db) == 0
    # the model's own tokenizer, named or not, scores
    r = runner.invoke(cli, [*base, "--tokenizer", str(tiny_model_dir)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert _scores(db) > 0


def test_vllm_a_tokenizer_the_server_does_not_use_is_refused_before_any_request(
    tmp_path, runner, episodes_dir, tiny_model_dir, permuted_server, permuted_tokenizer_dir
):
    db = _db(tmp_path, episodes_dir)
    base = ["--db", db, "score", "--backend", "vllm", "--server", permuted_server.url, "--max-context", MAX_CONTEXT]
    before = len(permuted_server.requests_seen)  # scoring requests (the highest-id probe asks no logprobs)
    r = runner.invoke(cli, [*base, "--tokenizer", str(tiny_model_dir)])
    assert r.exit_code == 1, r.output
    line = _refused_line(r.output)
    assert "is not the one the vllm server at" in line and "pass --tokenizer" in line, line
    # vLLM names the model (root), not the tokenizer: the line names what the server reports
    assert str(tiny_model_dir) in line
    assert len(permuted_server.requests_seen) == before and _scores(db) == 0


def test_sglang_without_tokenize_the_ids_are_read_from_a_text_generate(
    tmp_path, runner, episodes_dir, tiny_model_dir, permuted_server, permuted_tokenizer_dir
):
    """An SGLang without /tokenize: the probe goes as ``text`` to /generate, and the ids the
    server made are read from its input logprobs; still refused, still nothing scored."""
    db = _db(tmp_path, episodes_dir)
    with FaultServer(permuted_server) as fault:
        fault.tokenize_route = False
        base = ["--db", db, "score", "--server", fault.url, "--max-context", MAX_CONTEXT]
        r = runner.invoke(cli, [*base, "--tokenizer", str(tiny_model_dir)])
        assert r.exit_code == 1, r.output
        assert "is not the one the sglang server at" in _refused_line(r.output)
        assert [e.key for e in fault.log] == ["?"]  # the text probe alone: no ids were sent to score
        assert _scores(db) == 0

        fault.reset()
        r = runner.invoke(cli, [*base, "--tokenizer", str(permuted_tokenizer_dir)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert _scores(db) > 0


def test_a_server_without_a_tokenizer_is_left_to_the_highest_id_check(tmp_path, runner, episodes_dir, tiny_model_dir):
    """A server started without a tokenizer (SGLang's --skip-tokenizer-init) cannot tokenize
    the probe: scoring goes on, as before, on the highest-id check alone."""
    db = _db(tmp_path, episodes_dir)
    with make_server(tiny_model_dir) as ref:
        ref.tokenizer = None
        ref.tokenizer_path = None
        r = runner.invoke(
            cli,
            [
                "--db",
                db,
                "score",
                "--server",
                ref.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--max-context",
                MAX_CONTEXT,
            ],
            catch_exceptions=False,
        )
    assert r.exit_code == 0, r.output
    assert _scores(db) > 0


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceServer]:
    qwen3 = SHARED / "tokenizers" / "qwen3"
    if not qwen3.is_dir():
        pytest.skip("../shared/tokenizers/qwen3 is not here")
    model = build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3") / "model", qwen3, hidden=16, heads=2, kv_heads=1, intermediate=32
    )
    with make_server(model) as server:
        yield server


def test_the_demo_tokenizer_against_a_qwen3_vocabulary_server_is_refused(
    tmp_path, runner, episodes_dir, tiny_model_dir, qwen3_server
):
    """The issue's report: every demo id is below Qwen3's vocabulary size, so the old check
    passed and 65 of 65 steps were scored with exit 0."""
    db = _db(tmp_path, episodes_dir)
    with FaultServer(qwen3_server) as fault:
        base = ["--db", db, "score", "--server", fault.url, "--max-context", MAX_CONTEXT]
        r = runner.invoke(cli, [*base, "--tokenizer", str(tiny_model_dir)])
        assert r.exit_code == 1, r.output
        line = _refused_line(r.output)
        assert "is not the one the sglang server at" in line and qwen3_server.tokenizer_path in line, line
        assert fault.requests == 0 and _scores(db) == 0

        r = runner.invoke(cli, [*base, "--tokenizer", qwen3_server.tokenizer_path], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert _scores(db) > 0


def test_qwen25_against_qwen3_is_refused_and_qwen3_saved_again_is_not(
    tmp_path, runner, episodes_dir, tiny_model_dir, qwen3_server
):
    """Qwen2.5's ids all fit a Qwen3 model, but its added tokens stop short of Qwen3's
    (``<tool_response>``, ``<think>``): refused. The same Qwen3 tokenizer saved again elsewhere
    (as a trainer re-saves it into each checkpoint) encodes the same ids: accepted."""
    from transformers import AutoTokenizer

    qwen25 = SHARED / "tokenizers" / "qwen2.5"
    if not qwen25.is_dir():
        pytest.skip("../shared/tokenizers/qwen2.5 is not here")
    resaved = tmp_path / "qwen3-resaved"
    AutoTokenizer.from_pretrained(qwen3_server.tokenizer_path).save_pretrained(str(resaved))
    db = _db(tmp_path, episodes_dir)
    with FaultServer(qwen3_server) as fault:
        base = ["--db", db, "score", "--server", fault.url, "--max-context", MAX_CONTEXT]
        r = runner.invoke(cli, [*base, "--tokenizer", str(qwen25)])
        assert r.exit_code == 1, r.output
        assert "is not the one the sglang server at" in _refused_line(r.output)
        assert fault.requests == 0 and _scores(db) == 0

        r = runner.invoke(cli, [*base, "--tokenizer", str(resaved)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert _scores(db) > 0


# --------------------------------------------------------------------------- request bodies


def test_every_sglang_scoring_request_sends_logprob_start_len(tmp_path, runner, episodes_dir, tiny_model_dir):
    """SGLang since PR #17395 returns only the last position's logit for a prefill-only request
    without it (docs/SCORING.md "Connections"): every scoring request must carry it."""
    db = _db(tmp_path, episodes_dir)
    with make_server(tiny_model_dir) as ref:
        r = runner.invoke(
            cli,
            [
                "--db",
                db,
                "score",
                "--server",
                ref.url,
                "--tokenizer",
                str(tiny_model_dir),
                "--max-context",
                MAX_CONTEXT,
            ],
            catch_exceptions=False,
        )
        assert r.exit_code == 0, r.output
        seen = list(ref.requests_seen)
    assert seen and {path for path, _ in seen} == {"/generate"}
    for _, body in seen:
        assert body["return_logprob"] is True and body["sampling_params"]["max_new_tokens"] == 0
        start = body["logprob_start_len"]
        assert type(start) is int and start >= 0, body
    _all_scored(db)


def test_every_vllm_scoring_request_sends_detokenize_false(tmp_path, runner, episodes_dir, tiny_model_dir):
    """vLLM otherwise decodes every returned candidate to text on its event loop (docs/SCORING.md,
    "Connections"); the reference server then leaves decoded_token null, as vLLM does."""
    db = _db(tmp_path, episodes_dir)
    with make_server(tiny_model_dir) as ref:
        r = runner.invoke(
            cli,
            [
                *("--db", db, "score", "--backend", "vllm", "--server", ref.url),
                *("--tokenizer", str(tiny_model_dir), "--max-context", MAX_CONTEXT),
            ],
            catch_exceptions=False,
        )
        assert r.exit_code == 0, r.output
        seen = list(ref.requests_seen)
        ids = ref.sequences_seen[-1]
        plain = ref.completions({"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
        quiet = ref.completions({"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1, "detokenize": False})
    assert seen and {path for path, _ in seen} == {"/v1/completions"}
    for _, body in seen:
        assert body["detokenize"] is False and body["prompt_logprobs"] == 1 and body["max_tokens"] == 1, body
    _all_scored(db)
    decoded = [v["decoded_token"] for e in plain["choices"][0]["prompt_logprobs"][1:] for v in e.values()]
    assert all(isinstance(d, str) for d in decoded)
    assert all(v["decoded_token"] is None for e in quiet["choices"][0]["prompt_logprobs"][1:] for v in e.values())


def _all_scored(db: str) -> None:
    with Store.open(db) as store, store.engine.connect() as conn:
        steps = conn.execute(text("SELECT count(*) FROM steps")).scalar_one()
        done = conn.execute(text("SELECT count(*) FROM scores")).scalar_one()
    assert steps and done == steps
