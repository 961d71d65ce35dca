"""The trainer hand-off: a run's advantages on a trainer's own token ids, with the real
tokenizers when ../shared is here (the demo tokenizer otherwise), and the verl / slime /
prime-rl shapes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _shared import tokenizer_dir
from sqlalchemy import text
from test_tokenized import scored_with

from hcapo_store.credits.compute import compute_credits
from hcapo_store.credits.equations import CreditParams
from hcapo_store.errors import EpisodeLookupError, HandoffError
from hcapo_store.outputs.export import export_dataset
from hcapo_store.storage.episodes import load_messages
from hcapo_store.storage.store import Store
from hcapo_store.training.adapters import prime_rl_advantages, slime_advantages, verl_advantages
from hcapo_store.training.handoff import Handoff


# qwen2.5 in the slow tier: the same hand-off as qwen3 on another real template (~40-70 s each loaded)
@pytest.fixture(params=["qwen3", pytest.param("qwen2.5", marks=pytest.mark.slow), "demo"])
def tok_dir(request, demo_tokenizer_dir: Path) -> Path:
    return tokenizer_dir(request.param, demo_tokenizer_dir)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def _scored_exports(tmp_path_factory: pytest.TempPathFactory, migrated_db_template: Path):
    """Per (samples, tokenizer): a store scored once by ``scored_with`` and its tokenized
    export per rendering, made once per module (the export renders every episode with the real
    tokenizer, seconds each). Export reads the store only, so each test gets a copy of the
    scored file and the rows exported from those very bytes."""
    made: dict[tuple[str, str], tuple[Path, dict[str, Path]]] = {}

    def get(samples: Path, tok_dir: Path, rendering: str) -> tuple[Path, Path]:
        key = (str(samples), str(tok_dir))
        if key not in made:
            where = tmp_path_factory.mktemp("scored")
            shutil.copyfile(migrated_db_template, where / "store.db")
            s = Store.open(str(where / "store.db"))
            scored_with(s, samples, tok_dir)
            s.close()
            made[key] = (where / "store.db", {})
        db, outs = made[key]
        if rendering not in outs:
            out = db.parent / f"{rendering}.jsonl"
            s = Store.open(str(db))
            export_dataset(s, out, "r", min_reward=0.0, layout="tokenized", tokenizer=tok_dir, rendering=rendering)
            s.close()
            outs[rendering] = out
        return db, outs[rendering]

    return get


@pytest.fixture
def exported(_scored_exports, db_path: Path, samples: Path, tok_dir: Path) -> Iterator:
    """``exported(rendering="turns")``: (a store scored as ``scored_with`` does, opened on this
    test's own copy; the path of its tokenized export with that rendering, as
    ``export_dataset(store, out, "r", min_reward=0.0, layout="tokenized", tokenizer=tok_dir,
    rendering=rendering)`` writes it)."""
    opened: list[Store] = []

    def get(rendering: str = "turns") -> tuple[Store, Path]:
        db, out = _scored_exports(samples, tok_dir, rendering)
        shutil.copyfile(db, db_path)
        opened.append(Store.open(str(db_path)))
        return opened[-1], out

    yield get
    for s in opened:
        s.close()


@pytest.mark.parametrize("rendering", ["turns", "whole"])
def test_the_export_renderings_get_the_exports_advantages(exported, tok_dir: Path, rendering: str) -> None:
    store, out = exported(rendering)
    handoff = Handoff(store, "r", tokenizer=tok_dir)
    rows = _rows(out)
    assert rows
    for row in rows:
        refused = {u["step_index"]: u["reason"] for u in row["unaligned_steps"]}
        if refused:  # e.g. Qwen3's whole rendering drops earlier turns' reasoning: named, never guessed
            with pytest.raises(HandoffError, match=f"step {min(refused)} cannot be placed"):
                handoff.advantages(row["episode"], row["token_ids"])
        credit = handoff.advantages(row["episode"], row["token_ids"], strict=False)
        assert credit.how == rendering and credit.refused == refused
        assert {i: tuple(s) for i, s in zip(row["step_indices"], row["step_spans"])} == credit.spans
        assert np.allclose(credit.advantages, row["advantages"], atol=1e-6)


def test_ids_with_more_around_them_are_searched(exported, tok_dir: Path) -> None:
    store, out = exported()
    handoff = Handoff(store, "r", tokenizer=tok_dir)
    row = _rows(out)[0]
    ids = [7, 8, 9, 10, 11] + row["token_ids"] + [0] * 7  # a prefix the trainer added, right padding
    credit = handoff.advantages(row["episode"], ids)
    assert credit.how == "search"
    assert credit.spans == {i: (a + 5, b + 5) for i, (a, b) in zip(row["step_indices"], row["step_spans"])}
    assert np.allclose(credit.advantages[5:-7], row["advantages"], atol=1e-6) and not credit.advantages[:5].any()
    assert credit.mask.sum() == sum(b - a for a, b in row["step_spans"])


def test_an_action_that_is_not_in_the_ids_is_refused_by_name(exported, tok_dir: Path) -> None:
    store, out = exported()
    handoff = Handoff(store, "r", tokenizer=tok_dir)
    row = _rows(out)[0]
    a, b = row["step_spans"][1]
    ids = list(row["token_ids"])
    ids[(a + b) // 2] = ids[(a + b) // 2] + 1  # the trainer holds other tokens for step 1's action
    with pytest.raises(HandoffError, match=f"step {row['step_indices'][1]}'s own tokens"):
        handoff.advantages(row["episode"], ids)
    # strict=False: that step stays at 0 and is named; the others are placed as before
    credit = handoff.advantages(row["episode"], ids, strict=False)
    assert (
        set(credit.refused) == {row["step_indices"][1]}
        and "not in the given ids" in credit.refused[row["step_indices"][1]]
    )
    others = {i: tuple(s) for i, s in zip(row["step_indices"], row["step_spans"]) if i != row["step_indices"][1]}
    assert credit.spans == others and not credit.advantages[a:b].any()
    with pytest.raises(EpisodeLookupError, match="no episode"):
        handoff.advantages("no_such_episode", ids)


def test_the_stored_advantages_and_the_selection(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path
) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    compute_credits(store, CreditParams(min_reward=0.5), name="half")
    handoff = Handoff(store, "half", tokenizer=demo_tokenizer_dir)
    stored = store.query(
        "SELECT episode, step_index, advantage, reward FROM step_credits WHERE run = 'half' ORDER BY episode, step_index",
        read_only=True,
    )[1]
    episodes = sorted({r[0] for r in stored})
    seen_unselected = False
    for name in episodes:
        ids = handoff._alignment(handoff.episode_id(name), "turns").input_ids
        credit = handoff.advantages(name, ids)
        mine = [(i, a, rw) for e, i, a, rw in stored if e == name]
        if mine[0][2] >= 0.5:
            assert credit.selected and credit.step_advantages == pytest.approx({i: a for i, a, _ in mine})
        else:  # under min_reward: the original leaves it out of training
            seen_unselected = True
            assert not credit.selected and not credit.advantages.any() and credit.mask.any()
    assert seen_unselected


def test_paper_advantages_are_signed(store: Store, samples: Path, demo_tokenizer_dir: Path) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    compute_credits(store, CreditParams(variant="paper"), name="p")
    handoff = Handoff(store, "p", tokenizer=demo_tokenizer_dir)
    values = []
    for ep_id in handoff._names:
        ids = handoff._alignment(ep_id, "whole").input_ids
        credit = handoff.advantages(ep_id, ids)
        assert credit.selected and credit.how == "whole"
        values += list(credit.step_advantages.values())
    assert min(values) < 0 < max(values)


def _pieces(store: Store, samples: Path, tok: Path, tmp_path: Path):
    scored_with(store, samples, tok)
    out = tmp_path / "t.jsonl"
    export_dataset(store, out, "r", min_reward=0.0, layout="tokenized", tokenizer=tok)
    return Handoff(store, "r", tokenizer=tok), _rows(out)


def test_verl_batch(store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    handoff, rows = _pieces(store, samples, demo_tokenizer_dir, tmp_path)
    rows = rows[:2]
    prompts, responses, masks = [], [], []
    for row in rows:
        cut = row["step_spans"][0][0]  # verl's prompt: everything before the first action
        prompts.append(row["token_ids"][:cut])
        responses.append(row["token_ids"][cut:])
        masks.append([1] * (len(row["token_ids"]) - cut))  # verl: 1 on every response token of the policy
    width = max(len(r) for r in responses) + 3
    ids = np.array([r + [0] * (width - len(r)) for r in responses])
    mask = np.array([m + [0] * (width - len(m)) for m in masks])
    adv = verl_advantages(handoff, [r["episode"] for r in rows], prompts, ids, mask)
    assert adv.shape == ids.shape and adv.dtype == np.float32
    for k, row in enumerate(rows):
        cut = len(prompts[k])
        want = np.array(row["advantages"][cut:], dtype=np.float32)
        assert np.allclose(adv[k, : len(want)], want, atol=1e-6) and not adv[k, len(want) :].any()
    # a mask that leaves out an action token is a disagreement, refused
    a, _ = rows[0]["step_spans"][0]
    mask[0, a - len(prompts[0])] = 0
    with pytest.raises(HandoffError, match="mask leaves it out"):
        verl_advantages(handoff, [r["episode"] for r in rows], prompts, ids, mask)


def test_slime_and_prime_rl_samples(store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    handoff, rows = _pieces(store, samples, demo_tokenizer_dir, tmp_path)
    row = rows[0]
    cut = row["step_spans"][0][0]
    tokens = row["token_ids"]
    loss_mask = [1] * (len(tokens) - cut)
    got = slime_advantages(handoff, row["episode"], tokens, len(tokens) - cut, loss_mask)
    assert len(got) == len(tokens) - cut and np.allclose(got, row["advantages"][cut:], atol=1e-6)
    with pytest.raises(HandoffError, match="loss_mask has"):
        slime_advantages(handoff, row["episode"], tokens, len(tokens) - cut, loss_mask[:-1])
    full = prime_rl_advantages(handoff, row["episode"], tokens, [0] * cut + [1] * (len(tokens) - cut))
    assert len(full) == len(tokens) and np.allclose(full, row["advantages"], atol=1e-6)


def test_an_episode_is_found_by_the_id_its_collector_wrote(
    store: Store, samples: Path, demo_tokenizer_dir: Path
) -> None:
    """The Pi session id (and the JSONL ``episode_id``) reach the same episode as its store name."""
    scored_with(store, samples, demo_tokenizer_dir)
    handoff = Handoff(store, "r", tokenizer=demo_tokenizer_dir)
    rows = store.query("SELECT id, name, external_id FROM episodes WHERE is_current", read_only=True)[1]
    assert rows and all(ext for _, _, ext in rows)
    for ep_id, name, ext in rows:
        assert "/" not in ext or ext != name
        assert handoff.episode_id(ext) == handoff.episode_id(name) == ep_id
        ids = handoff._alignment(ep_id, "turns").input_ids
        by_ext, by_name = handoff.advantages(ext, ids), handoff.advantages(name, ids)
        assert by_ext.episode == name and np.array_equal(by_ext.advantages, by_name.advantages)


def test_a_stale_run_is_refused_unless_allowed(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from hcapo_store.ingestion.pipeline import ingest

    scored_with(store, samples, demo_tokenizer_dir)
    copy = tmp_path / "again"
    shutil.copytree(samples, copy)
    first = sorted(p for p in copy.iterdir() if (p / "result.json").is_file())[0]
    result = json.loads((first / "result.json").read_text())
    result["episode_reward"] = 0.123 if result.get("episode_reward") != 0.123 else 0.321  # a new version
    (first / "result.json").write_text(json.dumps(result))
    assert ingest(store, [copy]).changed >= 1
    with pytest.raises(
        HandoffError, match=r"credit run 'r' is stale: 1 credited episode\(s\) have a newer version.*allow_stale=True"
    ):
        Handoff(store, "r", tokenizer=demo_tokenizer_dir)
    handoff = Handoff(store, "r", tokenizer=demo_tokenizer_dir, allow_stale=True)
    assert handoff.warnings and "is stale" in handoff.warnings[0]


def test_a_superseded_batch_is_refused_naming_the_batch_that_replaced_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    from click.testing import CliRunner

    from hcapo_store.cli import cli
    from hcapo_store.devkit.refserver import make_server
    from hcapo_store.devkit.synth import write_standard_episodes

    root = tmp_path / "rollouts"
    group = write_standard_episodes(root / "step_0000", 2, seed=30, steps_per_subtask=1, output_words=5)
    db = tmp_path / "s.db"

    def follow() -> list[dict]:
        args = ["--db", str(db), "follow", str(root), "--group-size", "2", "--once", "--server", server.url]
        r = CliRunner().invoke(cli, [*args, "--tokenizer", str(tiny_model_dir), "--max-context", "2048"])
        assert r.exit_code == 0, r.output
        return json.loads(CliRunner().invoke(cli, ["--db", str(db), "batches", "--json"]).output)

    with make_server(tiny_model_dir) as server:
        (first,) = follow()
        result = json.loads((group[0] / "result.json").read_text())
        result["episode_reward"] = 0.99  # a corrected reward: a new version, the batch published again
        (group[0] / "result.json").write_text(json.dumps(result))
        old, new = follow()
    assert old["id"] == first["id"] and old["status"] == "superseded"
    with Store.open(str(db)) as store:
        Handoff(store, new["credit_run"], tokenizer=tiny_model_dir)  # the current batch: fine
        with pytest.raises(HandoffError) as refused:
            Handoff(store, old["credit_run"], tokenizer=tiny_model_dir)
        msg = str(refused.value)
        assert msg.startswith(
            f"credit run of batch {old['id']} (rollouts/step_0000) was superseded by batch {new['id']}"
        )
        assert f"credit run {new['credit_run']!r}" in msg and msg.endswith(
            "or pass allow_stale=True to train on it anyway"
        )
        allowed = Handoff(store, old["credit_run"], tokenizer=tiny_model_dir, allow_stale=True)
        assert allowed.warnings[0].startswith(f"credit run of batch {old['id']}")
        # a batch, by its id or as follow publishes it, names its own credit run
        from hcapo_store.online.batches import find_batch

        assert Handoff(store, new["id"], tokenizer=tiny_model_dir).run.name == new["credit_run"]
        info = find_batch(store, "rollouts/step_0000")
        assert info is not None and Handoff(store, info, tokenizer=tiny_model_dir).run.name == new["credit_run"]
        with pytest.raises(HandoffError, match=r"^no batch 999 in this store"):
            Handoff(store, 999, tokenizer=tiny_model_dir)


@pytest.mark.parametrize(
    ("stored", "said"),
    [
        ("NULL", "is nan"),  # a damaged row: the database's NULL is numpy's NaN
        ("1e39", r"is 1e\+39, beyond float32's range"),  # finite in float64, inf in float32: refused after the cast
    ],
)
def test_a_stored_advantage_that_is_not_finite_in_float32_never_reaches_a_trainer(
    store: Store, samples: Path, demo_tokenizer_dir: Path, stored: str, said: str
) -> None:
    scored_with(store, samples, demo_tokenizer_dir)
    compute_credits(store, CreditParams(variant="paper"), name="p")
    name, step = store.query(
        "SELECT episode, step_index FROM step_credits WHERE run = 'p' ORDER BY episode, step_index LIMIT 1",
        read_only=True,
    )[1][0]
    with store.engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE credits SET advantage = {stored} WHERE run_id = (SELECT id FROM credit_runs WHERE name = 'p') "
                "AND step_id = (SELECT s.id FROM steps s JOIN episodes e ON e.id = s.episode_id "
                "WHERE e.name = :n AND s.step_index = :i AND e.is_current)"
            ),
            {"n": name, "i": step},
        )
    handoff = Handoff(store, "p", tokenizer=demo_tokenizer_dir)
    ids = handoff.rendered_ids(name, "whole")
    with pytest.raises(HandoffError, match=rf"^episode {name}: step {step}'s stored advantage {said}"):
        handoff.advantages(name, ids, strict=False)


def test_a_run_without_hindsight_term_is_refused_unless_plain_grpo_is_asked_for(
    store: Store, samples: Path, demo_tokenizer_dir: Path
) -> None:
    """omega 0: the advantage is GRPO's group term alone on every step; the hand-off refuses it by
    default and takes it with allow_zero_hindsight=True (the warning says so); a run with the
    term reports how much of it carries one."""
    scored_with(store, samples, demo_tokenizer_dir)
    compute_credits(store, CreditParams(variant="paper", omega=0.0), name="flat")
    with pytest.raises(
        HandoffError, match=r"^credit run 'flat': hindsight term zero on all \d+ steps.*allow_zero_hindsight=True"
    ):
        Handoff(store, "flat", tokenizer=demo_tokenizer_dir)
    taken = Handoff(store, "flat", tokenizer=demo_tokenizer_dir, allow_zero_hindsight=True)
    assert taken.signal is not None and taken.signal.plain_grpo
    assert any("hindsight term zero" in w for w in taken.warnings)
    compute_credits(store, CreditParams(variant="paper"), name="p")
    signal = Handoff(store, "p", tokenizer=demo_tokenizer_dir).signal
    assert signal is not None and signal.hindsight_nonzero_steps > signal.steps / 2 and signal.varying_episodes > 0


def test_a_read_only_credential_exports_tokenized_rows_and_hands_off(
    store: Store, samples: Path, demo_tokenizer_dir: Path, tmp_path: Path, db_path: Path, runner, monkeypatch
) -> None:
    """Export and ``Handoff`` only read the store (issue 41): every connection opened from here on
    refuses writes (SQLite's ``PRAGMA query_only``, which holds for root too, unlike a 0444 file),
    and ``export dataset --tokenized`` (with and without ``--tokenizer``) and ``Handoff`` still work.
    Where the tokenizer is was recorded when scoring."""
    from sqlalchemy import event

    from hcapo_store.cli import cli
    from hcapo_store.errors import StoreError
    from hcapo_store.rendering.tokenizers import load_tokenizer, tokenizer_fingerprint
    from hcapo_store.scoring.scorer import remember_tokenizer
    from hcapo_store.storage import db

    scored_with(store, samples, demo_tokenizer_dir)
    files_sha256 = tokenizer_fingerprint(load_tokenizer(demo_tokenizer_dir), demo_tokenizer_dir)["files_sha256"]
    remember_tokenizer(store, files_sha256, demo_tokenizer_dir)  # what `score --tokenizer` records
    store.close()
    make_engine = db.make_engine

    def read_only_engine(url: str):
        engine = make_engine(url)

        @event.listens_for(engine, "connect")
        def _query_only(dbapi_conn, _record) -> None:
            dbapi_conn.execute("PRAGMA query_only = ON")

        return engine

    monkeypatch.setattr(db, "make_engine", read_only_engine)
    with Store.open(str(db_path), create=False) as ro:
        with pytest.raises(StoreError, match="readonly"):  # the credential is read-only indeed
            remember_tokenizer(ro, files_sha256, tmp_path)
        export = ["--db", str(db_path), "export", "dataset", "--tokenized", "--min-reward", "0"]
        found = runner.invoke(cli, [*export, str(tmp_path / "found.jsonl")])
        assert found.exit_code == 0, found.output
        given = runner.invoke(cli, [*export, str(tmp_path / "given.jsonl"), "--tokenizer", str(demo_tokenizer_dir)])
        assert given.exit_code == 0, given.output
        assert (tmp_path / "found.jsonl").read_bytes() == (tmp_path / "given.jsonl").read_bytes()
        handoff = Handoff(ro, "r", tokenizer=demo_tokenizer_dir)
        rows = _rows(tmp_path / "given.jsonl")
        assert rows
        for row in rows:
            credit = handoff.advantages(row["episode"], row["token_ids"])
            assert np.allclose(credit.advantages, row["advantages"], atol=1e-6)


def test_a_group_read_at_once_is_the_episodes_read_one_by_one(exported, tok_dir: Path) -> None:
    """``prefetch`` (a trainer's hand-off reads a group's episodes in one query each) gives each
    episode the messages and credited steps its own read gives, and so the same advantages."""
    store, out = exported()
    rows = _rows(out)
    one_by_one = Handoff(store, "r", tokenizer=tok_dir)
    grouped = Handoff(store, "r", tokenizer=tok_dir)
    ids = [grouped.episode_id(row["episode"]) for row in rows]
    grouped.prefetch([*ids, 10**9])  # and an id the run does not credit: skipped
    assert sorted(grouped._episodes) == sorted(set(ids))
    for row, ep in zip(rows, ids, strict=True):
        messages, steps, _ = one_by_one._episode(ep)
        assert grouped._episode(ep)[:2] == (messages, steps) and steps
        with store.engine.connect() as conn:  # the plain read of one episode's messages
            assert messages == load_messages(conn, ep)
            stored = conn.execute(
                text("SELECT role, content FROM messages WHERE episode_id = :e ORDER BY message_index"), {"e": ep}
            ).all()
        assert [(m["role"], m["content"]) for m in messages] == [
            tuple(r) for r in stored
        ]  # the rows, as SQL reads them
        a = grouped.advantages(row["episode"], row["token_ids"], strict=False)
        b = one_by_one.advantages(row["episode"], row["token_ids"], strict=False)
        assert a.spans == b.spans and np.array_equal(a.advantages, b.advantages) and a.spans
