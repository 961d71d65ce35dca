"""Log-ratio credit runs over two scorers (docs/FAMILY.md): the stored values against a plain
computation of their own from the stored per-token logprobs, the refusals, and the per-token
values in the tokenized export and the trainers' hand-off."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text
from test_credits import add_scorer

from hcapo_store.cli import cli
from hcapo_store.credits.log_ratio import LogRatioParams, compute_log_ratio
from hcapo_store.errors import CreditError, InvalidCreditParams
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.export import export_dataset
from hcapo_store.rendering.alignment import EpisodeRenderer
from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
from hcapo_store.storage import db
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store

TOK = {"name": "t", "files_sha256": "f" * 64}


def _episodes(path: Path, n: int = 4) -> Path:
    lines = []
    for k in range(n):
        messages = [{"role": "user", "content": f"task {k}"}]
        for t in range(3):
            messages.append({"role": "assistant", "content": f"step {t} of episode {k}: " + "word " * (t + k)})
            messages.append({"role": "user", "content": "go on"})
        lines.append(
            json.dumps({"episode_id": f"e{k}", "reward": [1.0, 0.0, 0.5, 1.0][k % 4], "messages": messages[:-1]})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _score(conn, scorer: str, step_id: int, values: list[float], total: int | None = None) -> None:
    n = len(values)
    conn.execute(
        text(
            "INSERT INTO scores (step_id, scorer_id, token_logprobs, token_count, mean_logprob, "
            "total_action_tokens, skipped_action_tokens, truncated_prefix_tokens, input_tokens, "
            "logprob_start_len, flattened, created_at) VALUES (:s, :sc, :b, :n, :m, :t, 0, 0, :i, 1, "
            "FALSE, '2026-11-27')"
        ),
        {
            "s": step_id,
            "sc": scorer,
            "b": struct.pack(f"<{n}f", *values),
            "n": n,
            "m": float(np.mean(np.asarray(values, dtype=np.float32))) if n else 0.0,
            "t": n if total is None else total,
            "i": n + 5,
        },
    )


def _store(tmp_path: Path, *, student_spec: dict | None = None, lengths=None, seed: int = 3) -> Store:
    store = Store.open(str(tmp_path / "s.db"))
    assert ingest(store, [_episodes(tmp_path / "eps.jsonl")]).failed == 0
    add_scorer(store, "teacher", "hind", spec={"tokenizer": TOK, "backend": {"kind": "sglang", "model": "m"}})
    add_scorer(
        store, "student", "base", spec=student_spec or {"tokenizer": TOK, "backend": {"kind": "sglang", "model": "m"}}
    )
    rng = random.Random(seed)
    with db.write(store.engine) as conn:
        steps = conn.execute(
            text("SELECT s.id, e.name, s.step_index FROM steps s JOIN episodes e ON e.id = s.episode_id")
        ).all()
        for sid, name, idx in steps:
            n = lengths(name, idx) if lengths else rng.randint(1, 9)
            _score(conn, "teacher", sid, [rng.uniform(-6, 0) for _ in range(n)])
            _score(conn, "student", sid, [rng.uniform(-6, 0) for _ in range(n)])
    return store


def _blobs(store: Store, scorer: str) -> dict[int, list[float]]:
    rows = store.query("SELECT step_id, token_logprobs FROM scores WHERE scorer_id = :s", {"s": scorer})[1]
    return {r[0]: list(struct.unpack(f"<{len(r[1]) // 4}f", r[1])) for r in rows}


def _plain(store: Store, p: LogRatioParams) -> dict[int, dict]:
    """Own implementation: per token t − s (float32 values widened), clipped, gated, plus GRPO's A_i."""
    teacher, student = _blobs(store, "teacher"), _blobs(store, "student")
    steps = store.query("SELECT s.id, e.id, e.reward FROM steps s JOIN episodes e ON e.id = s.episode_id")[1]
    rewards = {e: r for _, e, r in steps}
    mean = sum(rewards.values()) / len(rewards)
    sd = math.sqrt(sum((r - mean) ** 2 for r in rewards.values()) / len(rewards)) or 1.0
    out = {}
    for sid, _ep, reward in steps:
        a = (reward - mean) / sd if p.grpo else 0.0
        ds, advs = [], []
        for t, s in zip(teacher[sid], student[sid]):
            d = t - s
            if p.clip is not None:
                d = max(-p.clip, min(p.clip, d))
            g = 1 / (1 + math.exp(-d / p.gate_temperature)) if p.gate == "sigmoid" else 1.0
            ds.append(d)
            advs.append(a + p.kl_coef * g * d)
        out[sid] = {"d": ds, "adv": advs, "q_h": sum(ds) / len(ds), "advantage": sum(advs) / len(advs), "a": a}
    return out


@pytest.mark.parametrize(
    "params",
    [
        LogRatioParams(),
        LogRatioParams(kl_coef=0.5, gate="sigmoid", gate_temperature=2.0, grpo=True, clip=1.5),
    ],
    ids=["plain", "gated-grpo-clipped"],
)
def test_equals_a_plain_computation_from_the_stored_logprobs(tmp_path, params):
    store = _store(tmp_path)
    result = compute_log_ratio(store, params, scorer="teacher", against="student", name="lr")
    assert result.created and result.run.variant == "log-ratio" and result.run.steps == 12
    want = _plain(store, params)
    rows = store.query("SELECT step_id, q_h, a_macro, advantage, token_count FROM step_credits WHERE run = 'lr'")[1]
    assert len(rows) == len(want)
    for sid, q_h, a_macro, advantage, n in rows:
        assert q_h == pytest.approx(want[sid]["q_h"], abs=1e-9)
        assert a_macro == pytest.approx(want[sid]["a"], abs=1e-12)
        assert advantage == pytest.approx(want[sid]["advantage"], abs=1e-9)
        assert n == len(want[sid]["d"])
    tokens = store.query("SELECT tc.step_id, tc.log_ratios, tc.advantages FROM token_credits tc")[1]
    assert len(tokens) == len(want)
    for sid, lr, adv in tokens:
        assert np.frombuffer(lr, "<f4") == pytest.approx(np.float32(want[sid]["d"]), abs=1e-6)
        assert np.frombuffer(adv, "<f4") == pytest.approx(np.float32(want[sid]["adv"]), abs=1e-6)
    # the per-episode aggregate: the sum of the episode's per-token log-ratios
    episodes = store.query("SELECT episode_id, log_ratio_sum, tokens FROM episode_log_ratios WHERE run = 'lr'")[1]
    step_ep = dict(store.query("SELECT id, episode_id FROM steps")[1])
    assert len(episodes) == 4
    for ep, total, n in episodes:
        mine = [d for sid, w in want.items() if step_ep[sid] == ep for d in w["d"]]
        assert total == pytest.approx(sum(mine), abs=1e-9) and n == len(mine)
    again = compute_log_ratio(store, params, scorer="teacher", against="student")
    assert not again.created and again.run.name == "lr"


def test_refuses_other_tokens_naming_the_first_step(tmp_path):
    store = _store(tmp_path)
    with db.write(store.engine) as conn:
        sid = conn.execute(
            text(
                "SELECT s.id FROM steps s JOIN episodes e ON e.id = s.episode_id WHERE e.external_id = 'e2' AND s.step_index = 1"
            )
        ).scalar_one()
        conn.execute(text("DELETE FROM scores WHERE step_id = :s AND scorer_id = 'student'"), {"s": sid})
        _score(conn, "student", sid, [-1.0] * 12, total=12)
    with pytest.raises(CreditError, match=r"episode \S*e2 step 1: the two scorers scored other tokens"):
        compute_log_ratio(store, scorer="teacher", against="student")
    assert store.query("SELECT COUNT(*) FROM credit_runs")[1][0][0] == 0  # nothing stored


def test_a_logprob_that_is_not_finite_is_one_line_naming_its_step(tmp_path):
    """``score`` refuses such values; a store written another way gets one CreditError naming
    the step, nothing stored (before: a NaN ran into every later step's mean through one running
    sum, and the database refused the NULL credit)."""
    store = _store(tmp_path)
    with db.write(store.engine) as conn:
        sid, n = conn.execute(
            text(
                "SELECT s.id, sc.token_count FROM steps s JOIN episodes e ON e.id = s.episode_id "
                "JOIN scores sc ON sc.step_id = s.id AND sc.scorer_id = 'teacher' "
                "WHERE e.external_id = 'e1' AND s.step_index = 0"
            )
        ).one()
        blob = struct.pack(f"<{n}f", *([-1.0] * (n - 1) + [float("nan")]))  # its mean column left finite
        conn.execute(
            text("UPDATE scores SET token_logprobs = :b WHERE step_id = :s AND scorer_id = 'teacher'"),
            {"b": blob, "s": sid},
        )
    with pytest.raises(CreditError, match=rf"step id {sid}'s stored score holds a logprob that is not finite"):
        compute_log_ratio(store, scorer="teacher", against="student")
    assert store.query("SELECT COUNT(*) FROM credit_runs")[1][0][0] == 0


def test_step_means_keep_each_steps_values_to_itself() -> None:
    from hcapo_store.credits.log_ratio import step_means

    values = np.array([1.0, 2.0, 3.0, np.nan, 5.0, 6.0])
    assert step_means(values, np.array([2, 0, 1, 2, 1])).tolist()[:3] == [1.5, 0.0, 3.0]
    assert step_means(values, np.array([2, 0, 1, 2, 1]))[4] == 6.0  # after the NaN's step: its own
    rng = random.Random(3)
    for _ in range(100):
        counts = np.array([rng.randrange(4) for _ in range(rng.randrange(8))], dtype=np.int64)
        v = np.array([rng.gauss(0, 1) for _ in range(int(counts.sum()))])
        starts = np.cumsum(counts) - counts
        want = [math.fsum(v[s : s + c]) / c if c else 0.0 for s, c in zip(starts, counts)]
        assert step_means(v, counts) == pytest.approx(want, abs=1e-12)


def test_refuses_mixed_engines_unless_allowed_and_other_tokenizers_always(tmp_path):
    mixed = {"tokenizer": TOK, "backend": {"kind": "vllm", "model": "m", "dtype": "float16"}}
    store = _store(tmp_path, student_spec=mixed)
    with pytest.raises(CreditError, match="engines sglang vs vllm; dtypes None vs float16.*--allow-mixed"):
        compute_log_ratio(store, scorer="teacher", against="student")
    result = compute_log_ratio(store, scorer="teacher", against="student", allow_mixed=True)
    assert result.created and "warning: the two scorers differ in engines" in result.message
    other = tmp_path / "o"
    other.mkdir()
    store2 = _store(
        other,
        student_spec={
            "tokenizer": {"name": "u", "files_sha256": "0" * 64},
            "backend": {"kind": "sglang", "model": "m"},
        },
    )
    with pytest.raises(CreditError, match="other tokenizers"):
        compute_log_ratio(store2, scorer="teacher", against="student", allow_mixed=True)
    with pytest.raises(CreditError, match="same scorer"):
        compute_log_ratio(store2, scorer="teacher", against="teacher")
    with pytest.raises(InvalidCreditParams, match="--gate-temperature"):
        LogRatioParams(gate_temperature=0.0)


def test_cli_compute_and_one_line_refusals(tmp_path, runner):
    store = _store(tmp_path)
    db_ = str(tmp_path / "s.db")
    base = ["--db", db_, "credits", "compute", "--name", "lr", "--variant", "log-ratio", "--scorer", "hind"]
    r = runner.invoke(cli, [*base, "--against", "base", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["run"]["variant"] == "log-ratio"
    assert store.query("SELECT COUNT(*) FROM token_credits")[1][0][0] == 12
    for extra, message in (
        ([], "--variant log-ratio needs --against SCORER"),
        (["--against", "base", "--t-temp", "2"], "--t-temp does not apply to --variant log-ratio"),
        (["--against", "nope"], "--against 'nope' matches no scorer"),
    ):
        r = runner.invoke(cli, [*base, *extra])
        assert r.exit_code != 0 and message in r.output, r.output
    r = runner.invoke(cli, ["--db", db_, "credits", "compute", "--scorer", "hind", "--gate", "sigmoid"])
    assert r.exit_code != 0 and "--gate applies to --variant log-ratio only" in r.output
    # what reads HCAPO's columns on other runs: diagnose works, the report says why not in one line
    assert runner.invoke(cli, ["--db", db_, "diagnose", "lr"]).exit_code == 0
    r = runner.invoke(cli, ["--db", db_, "report", str(tmp_path / "r.html"), "--credits", "lr"])
    assert r.exit_code != 0 and "is a log-ratio run: the report draws HCAPO's quantities" in r.output
    assert not (tmp_path / "r.html").exists()


def test_cli_defaults_are_the_library_s():
    from hcapo_store.cli.log_ratio import DEFAULTS

    p = LogRatioParams()
    assert DEFAULTS == {"kl_coef": p.kl_coef, "gate": p.gate, "gate_temperature": p.gate_temperature}


def test_tokenized_export_and_handoff_carry_the_per_token_values(tmp_path, demo_tokenizer_dir):
    """Scores as long as each step's own tokens (what --action-span policy scores): the export
    and the hand-off put each token's own advantage there; a step scored over other tokens is
    refused with the reason, never shifted."""
    from hcapo_store.training.handoff import Handoff

    tok = load_tokenizer(demo_tokenizer_dir)
    fp = tokenizer_fingerprint(tok, demo_tokenizer_dir)
    spec = {"tokenizer": fp, "backend": {"kind": "sglang", "model": "m"}}
    store = Store.open(str(tmp_path / "s.db"))
    assert ingest(store, [_episodes(tmp_path / "eps.jsonl")]).failed == 0
    renderer = EpisodeRenderer(tok)
    own: dict[tuple[int, int], int] = {}
    with db.read(store.engine) as conn:
        for (ep,) in conn.execute(text("SELECT id FROM episodes")).all():
            steps = conn.execute(
                text("SELECT step_index, message_index FROM steps WHERE episode_id = :e ORDER BY step_index"), {"e": ep}
            ).all()
            al = renderer.align(load_messages(conn, ep), [(int(a), int(b)) for a, b in steps], "turns")
            for index, (a, b) in al.spans.items():
                own[(ep, index)] = b - a
    step_of = {(r[1], r[2]): r[0] for r in store.query("SELECT s.id, s.episode_id, s.step_index FROM steps s")[1]}
    name_of = {v: k for k, v in dict(store.query("SELECT name, id FROM episodes")[1]).items()}
    wrong = min(own)  # one step scored over one token more than its own
    add_scorer(store, "teacher", "hind", spec=spec)
    add_scorer(store, "student", "base", spec=spec)
    rng = random.Random(5)
    with db.write(store.engine) as conn:
        for key, n in own.items():
            n += key == wrong
            _score(conn, "teacher", step_of[key], [rng.uniform(-5, 0) for _ in range(n)])
            _score(conn, "student", step_of[key], [rng.uniform(-5, 0) for _ in range(n)])
    compute_log_ratio(store, LogRatioParams(grpo=True), scorer="teacher", against="student", name="lr")
    want = _plain(store, LogRatioParams(grpo=True))
    out = tmp_path / "tok.jsonl"
    res = export_dataset(store, out, "lr", layout="tokenized", tokenizer=demo_tokenizer_dir)
    assert res.unaligned_reasons == {"token_span": 1}
    rows = {r["episode"]: r for r in map(json.loads, out.read_text().splitlines())}
    placed = 0
    for row in rows.values():
        ep = next(e for e, n in name_of.items() if n == row["episode"])
        for index, (a, b) in zip(row["step_indices"], row["step_spans"]):
            assert (ep, index) != wrong
            assert row["advantages"][a:b] == pytest.approx(want[step_of[(ep, index)]]["adv"], abs=1e-5)
            placed += 1
        assert [u["step_index"] for u in row["unaligned_steps"]] == ([wrong[1]] if ep == wrong[0] else [])
    assert placed == len(own) - 1
    handoff = Handoff(store, "lr", tokenizer=demo_tokenizer_dir)
    ep = next(e for e, _ in own if e != wrong[0])
    ids = handoff.rendered_ids(name_of[ep])
    credit = handoff.advantages(name_of[ep], ids)
    for index, (a, b) in credit.spans.items():
        assert credit.advantages[a:b] == pytest.approx(want[step_of[(ep, index)]]["adv"], abs=1e-6)
    # verl's shape (training/adapters.py): the prompt up to the first step, the rest as the response
    from hcapo_store.training.adapters import verl_advantages

    first = min(a for a, _ in credit.spans.values())
    response = np.asarray([ids[first:]])
    batch = verl_advantages(handoff, [name_of[ep]], [ids[:first]], response, np.ones_like(response))
    for index, (a, b) in credit.spans.items():
        assert batch[0, a - first : b - first] == pytest.approx(want[step_of[(ep, index)]]["adv"], abs=1e-6)
    with pytest.raises(Exception, match="token_span"):
        handoff.advantages(name_of[wrong[0]], handoff.rendered_ids(name_of[wrong[0]]))
    loose = handoff.advantages(name_of[wrong[0]], handoff.rendered_ids(name_of[wrong[0]]), strict=False)
    assert wrong[1] in loose.refused and wrong[1] not in loose.spans
