"""The in-process and live paths (issue 43): the device and dtype chosen and part of the scorer,
each target's logprob as its logit minus the row's float32 logsumexp, picks copied back once
per forward, short requests packed into one forward, a queue ahead of the model's thread."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from hcapo_store.cli import cli
from hcapo_store.devkit.refserver import make_server
from hcapo_store.devkit.synth import write_standard_episodes
from hcapo_store.errors import ScoringError
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.scoring.backends.inprocess import InProcessBackend, LiveModelBackend
from hcapo_store.scoring.backends.sglang import SGLangBackend
from hcapo_store.scoring.forward import (
    VOCAB_BLOCK,
    ForwardQueue,
    LogprobModel,
    logsumexp_f32,
    pack_groups,
    resolve_device,
    resolve_dtype,
)
from hcapo_store.scoring.job import ScoreConfig, prepare, run_sync
from hcapo_store.scoring.live import score_live
from hcapo_store.scoring.scorer import scorer_spec
from hcapo_store.storage.store import Store

TOL = 1e-5


@pytest.fixture(scope="module")
def full(tiny_model_dir: Path, chat_ids: list[int]) -> torch.Tensor:
    """Today's values: the whole sequence's float32 log-softmax over the vocabulary."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.inference_mode():
        return model(torch.tensor([chat_ids])).logits[0].float().log_softmax(-1)


def _spans_expected(full: torch.Tensor, ids: list[int], spans: list[tuple[int, int]]) -> list[list[float]]:
    return [[full[i - 1, ids[i]].item() for i in range(s, e)] for s, e in spans]


def test_logsumexp_f32_equals_a_float32_log_softmax() -> None:
    """Low-precision logits: the logsumexp in float32, a block of columns at a time, gives each
    target's log-softmax within float32 rounding (bf16 rows wider than a block). The exact value
    is the float64 log-softmax: the bound is 4 float32 ulps of the magnitudes added. torch's own
    float32 log-softmax is not the reference: on an AVX2 CPU it was 2.1e-5 off the exact value,
    this ~1e-6 (on an AVX-512 CPU both were within 2e-5 of each other)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = (torch.randn(6, 2 * VOCAB_BLOCK + 77, generator=gen) * 4).to(dtype)
        logits[0, 5] = 40.0  # one sharp row
        targets = torch.randint(0, logits.shape[1], (6,), generator=gen)
        exact = logits.double().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        picked = logits.gather(-1, targets[:, None])[:, 0].float()
        lse = logsumexp_f32(logits)
        got = picked - lse
        assert got.dtype == torch.float32
        bound = 4 * torch.finfo(torch.float32).eps * (picked.abs() + lse.abs()).double()
        assert ((got.double() - exact).abs() <= bound).all(), (got.double() - exact).abs().max().item()
        if dtype != torch.float32:  # bit for bit the block sums of a float copy of each block
            peak = logits.amax(-1).float()
            blocks = [logits[:, s : s + VOCAB_BLOCK].float() for s in range(0, logits.shape[1], VOCAB_BLOCK)]
            total = torch.zeros_like(peak)
            for block in blocks:
                total += (block - peak[:, None]).exp_().sum(-1)
            assert torch.equal(logsumexp_f32(logits), total.log_() + peak)


def test_score_spans_equals_todays_values(tiny_model_dir: Path, chat_ids: list[int], full: torch.Tensor) -> None:
    n = len(chat_ids)
    spans = [(1, 4), (30, 30), (40, 90), (n - 5, n)]
    for chunk in (1, 7, 512):
        got = LogprobModel(tiny_model_dir, chunk_size=chunk).score_spans(chat_ids, spans)
        for g, e in zip(got, _spans_expected(full, chat_ids, spans), strict=True):
            assert g == pytest.approx(e, abs=TOL)


def test_pack_groups() -> None:
    assert pack_groups([100, 90, 300, 80], 0) == [[2], [0], [1], [3]]  # off: one per forward, longest first
    # 300 alone (with 100 the padding would be a third); 100, 90, 80 share one of 3 x 100 cells
    assert pack_groups([100, 90, 300, 80], 1000) == [[2], [0, 1, 3]]
    assert pack_groups([100, 90, 80], 250) == [[0, 1], [2]]  # a third row would pass the budget
    assert pack_groups([], 1000) == []


def test_packed_forwards_equal_unpacked(tiny_model_dir: Path, chat_ids: list[int], full: torch.Tensor) -> None:
    """Short requests right-padded into one forward (a causal model's real positions never see
    the padding after them) score as they do alone."""
    requests = []
    for end in (len(chat_ids), len(chat_ids) - 9, len(chat_ids) - 30, 60, 52):
        ids = chat_ids[:end]
        requests.append((ids, [(2, 6), (end - 20, end)]))
    packed = LogprobModel(tiny_model_dir, pack_tokens=4 * len(chat_ids))
    packed.timings = []
    alone = LogprobModel(tiny_model_dir, pack_tokens=0)
    alone.timings = []
    got, want = packed.score_spans_many(requests), alone.score_spans_many(requests)
    assert len(alone.timings) == len(requests) and len(packed.timings) < len(requests)  # some were packed
    for (ids, spans), g, w in zip(requests, got, want, strict=True):
        for gs, ws, es in zip(g, w, _spans_expected(full, ids, spans), strict=True):
            assert gs == pytest.approx(ws, abs=TOL) and gs == pytest.approx(es, abs=TOL)


def test_the_queue_feeds_the_model_thread(tiny_model_dir: Path, chat_ids: list[int]) -> None:
    """Requests submitted from several threads while a forward runs wait in the queue and go
    into the next forward together; each caller gets its own values."""
    model = LogprobModel(tiny_model_dir, pack_tokens=8 * len(chat_ids))
    model.timings = []
    queue = ForwardQueue(model)
    lengths = [len(chat_ids) - k for k in range(0, 12, 2)]
    expected = [model.score_spans(chat_ids[:n], [(n - 10, n)]) for n in lengths]
    model.timings.clear()
    futures: list = [None] * len(lengths)
    with model._lock:  # the model is busy: every request submitted now waits in the queue
        threads = [
            threading.Thread(
                target=lambda i=i, n=n: futures.__setitem__(i, queue.submit(model.prepare(chat_ids[:n], [(n - 10, n)])))
            )
            for i, n in enumerate(lengths)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    results = [f.result(timeout=60) for f in futures]
    queue.close()
    for got, want in zip(results, expected, strict=True):
        assert got[0] == pytest.approx(want[0], abs=TOL)
    assert len(model.timings) <= 2  # the first taken alone at most, the rest in one forward
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit(model.prepare(chat_ids, [(1, 2)]))


def test_prepare_refuses_bad_requests(tiny_model_dir: Path) -> None:
    model = LogprobModel(tiny_model_dir)
    for ids, spans in (([], [(1, 1)]), ([1, 2], [(0, 1)]), ([1, 2], [(1, 3)]), ([1, model.vocab_size], [(1, 2)])):
        with pytest.raises(ValueError):
            model.prepare(ids, spans)


def test_device_and_dtype_are_chosen(tiny_model_dir: Path) -> None:
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu and resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16 and resolve_dtype(None, torch.device("cuda")) is None
    for bad in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(ScoringError):
            resolve_device(bad)
    with pytest.raises(ScoringError, match="float8"):
        resolve_dtype("float8", cpu)
    if not torch.cuda.is_available():
        assert resolve_device(None) == cpu
        with pytest.raises(ScoringError, match="no CUDA GPU"):
            resolve_device("cuda")
    bf16 = LogprobModel(tiny_model_dir, device="cpu", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.model_info()["dtype"] == "bfloat16"
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


def test_precision_is_part_of_the_scorer(tiny_model_dir: Path) -> None:
    """In process: float32 on the CPU keeps the identity it always had; another dtype is another
    scorer. Live: always named. Through the reference server: as its /model_info reports it."""

    def identity(backend) -> dict:
        async def read() -> dict:
            await backend.start()
            try:
                return backend.identity()
            finally:
                await backend.close()

        return run_sync(read)

    fp32 = identity(InProcessBackend(tiny_model_dir, device="cpu"))
    bf16 = identity(InProcessBackend(tiny_model_dir, device="cpu", dtype="bfloat16"))
    assert set(fp32) == {"kind", "model", "model_sha256"}
    assert bf16 == {**fp32, "dtype": "bfloat16", "device": "cpu"}
    live = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    assert identity(LiveModelBackend(live, weight_version="1"))["dtype"] == "bfloat16"
    for dtype, named in (("float32", False), ("bfloat16", True)):
        with make_server(tiny_model_dir, device="cpu", dtype=dtype) as server:
            info = server.model_info()
            assert (info["dtype"], info["device"]) == (dtype, "cpu")
            got = identity(SGLangBackend(server.url))
            assert got.get("dtype") == (dtype if named else None)


def test_score_cli_dtype_keeps_scorers_apart(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_standard_episodes(tmp_path / "eps", 2, steps_per_subtask=1, output_words=6)
    db = str(tmp_path / "s.db")
    with Store.open(db) as store:
        ingest(store, [tmp_path / "eps"])
    runner = CliRunner()
    base = ["--db", db, "score", "--backend", "transformers", "--model", str(tiny_model_dir), "--max-context", "2048"]
    ids = {}
    for dtype in ("float32", "bfloat16"):
        r = runner.invoke(cli, [*base, "--device", "cpu", "--dtype", dtype, "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        assert out["scored"] > 0 and out["failed"] == 0
        ids[dtype] = out["scorer_id"]
    assert ids["float32"] != ids["bfloat16"]
    with Store.open(db) as store:
        fp32, bf16 = scorer_spec(store, ids["float32"]), scorer_spec(store, ids["bfloat16"])
        # the float32 CPU scorer is the one `score --model` made before --dtype existed
        assert "dtype" not in fp32["backend"] and fp32["provenance"]["computes_in"] == {
            "dtype": "float32",
            "device": "cpu",
        }
        assert (bf16["backend"]["dtype"], bf16["backend"]["device"]) == ("bfloat16", "cpu")
        assert ids["float32"] == prepare(store, ScoreConfig(model=str(tiny_model_dir), max_context=2048)).scorer_id
    listing = runner.invoke(cli, ["--db", db, "scorers", "list"]).output
    assert "dtype" in listing.splitlines()[0] and "bfloat16@cpu" in listing and "float32@cpu" in listing
    # one credit run never takes both: the scorer must be named
    r = runner.invoke(cli, ["--db", db, "credits", "compute"])
    assert r.exit_code != 0 and "2 scorers" in r.output and "pick one with --scorer" in r.output
    # bad choices: one line each, before anything loads
    for argv, words in (
        (["--device", "tpu"], "is not cuda, cuda:N or cpu"),
        (["--dtype", "float8"], "float8"),
    ):
        r = runner.invoke(cli, [*base, *argv])
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output
    if not torch.cuda.is_available():
        r = runner.invoke(cli, [*base, "--device", "cuda"])
        assert r.exit_code == 1 and "no CUDA GPU" in r.output and "Traceback" not in r.output
    for option in ("--dtype=bfloat16", "--no-cuda-graphs"):  # a server decides its own
        r = runner.invoke(cli, ["--db", db, "score", "--server", "http://127.0.0.1:9", option])
        assert r.exit_code == 2 and "--backend transformers" in r.output


def test_live_scores_of_two_dtypes_are_two_scorers(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_standard_episodes(tmp_path / "eps", 1, steps_per_subtask=1, output_words=6)
    with Store.open(str(tmp_path / "l.db")) as store:
        ingest(store, [tmp_path / "eps"])
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        fp32 = score_live(store, model, tokenizer=str(tiny_model_dir), weight_version="7", max_context=2048)
        bf16 = score_live(
            store, model.to(torch.bfloat16), tokenizer=str(tiny_model_dir), weight_version="7", max_context=2048
        )
        assert fp32.report.scored == bf16.report.scored > 0 and fp32.scorer_id != bf16.scorer_id
        assert "bfloat16@cpu" in bf16.label and "float32@cpu" in fp32.label


def test_a_model_whose_float16_logits_overflow_fails_its_steps_never_stores_inf(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A checkpoint with a large final-norm scale: every weight and every float32 logit finite,
    float16's logits inf. In process the steps fail with the position named (as the HTTP backends
    refuse such numbers): no -inf mean, no NaN the database refuses with a traceback."""
    hot = tmp_path / "hot"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1e6)
    model.save_pretrained(str(hot))
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "chat_template", "special_tokens")):
            (hot / f.name).write_bytes(f.read_bytes())
    write_standard_episodes(tmp_path / "eps", 1, steps_per_subtask=1, output_words=6)
    db = str(tmp_path / "s.db")
    with Store.open(db) as store:
        ingest(store, [tmp_path / "eps"])
    base = ["--db", db, "score", "--backend", "transformers", "--model", str(hot), "--max-context", "2048"]
    r = CliRunner().invoke(cli, [*base, "--device", "cpu", "--dtype", "float16", "--json"])
    out = json.loads(r.output[r.output.index("{") :])
    assert out["scored"] == 0 and out["failed"] > 0 and "Traceback" not in r.output
    assert "is not a log-probability within [-10000, 0]" in json.dumps(out["first_errors"])
    with Store.open(db) as store:
        assert store.query("SELECT COUNT(*) FROM scores")[1][0][0] == 0
        kinds = store.query("SELECT DISTINCT last_error_kind FROM attempts WHERE status = 'failed'")[1]
        assert kinds == [("bad_response",)]
