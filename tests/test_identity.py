"""Episode identity and names: location-independent keys, unique names everywhere, JSONL id clashes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from builders import EpisodeBuilder, write_standard_episodes
from test_credits import add_scorer, add_scores

from hcapo_store.cli import cli
from hcapo_store.credits.compute import compute_credits
from hcapo_store.errors import EpisodeLookupError
from hcapo_store.ingestion.episode_keys import normalise_id
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.outputs.export import export_hindsight_json
from hcapo_store.storage.episodes import resolve_episode
from hcapo_store.storage.store import Store


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request, tmp_path):
    """The same test on a SQLite file and on a fresh PostgreSQL database (skips without one)."""
    if request.param == "sqlite":
        with Store.open(str(tmp_path / "any.db")) as s:
            yield s
        return
    import pg

    with pg.fresh_database("ident") as url, Store.open(url) as s:
        yield s


ROOT_NAMES = [f"pg-0{r}/episode_00{i}" for r in (1, 2) for i in (1, 2, 3)]


def rows(store, sql, params=None):
    return store.query(sql, params)[1]


def names(store) -> list[str]:
    return sorted(n for (n,) in rows(store, "SELECT name FROM episodes WHERE is_current"))


def two_roots(base: Path) -> list[Path]:
    """Two runs with the same directory names and different episodes (the everyday case)."""
    write_standard_episodes(base / "pg-01", 3, seed=0)
    write_standard_episodes(base / "pg-02", 3, seed=10)
    return [base / "pg-01", base / "pg-02"]


# ---- location independence -----------------------------------------------------------------------


def test_copied_or_moved_tree_is_unchanged_and_the_summary_says_where(any_store, tmp_path):
    write_standard_episodes(tmp_path / "pg-01", 3)
    assert ingest(any_store, [tmp_path / "pg-01"]).new == 3
    copy = tmp_path / "cluster" / "scratch" / "run-a"
    shutil.copytree(tmp_path / "pg-01", copy)
    r = ingest(any_store, [copy])
    assert (r.new, r.changed, r.unchanged, r.failed) == (0, 0, 3, 0)
    assert r.elsewhere_count == 3 and f"{copy / 'episode_001'} is pg-01/episode_001" in r.summary()
    moved = tmp_path / "mnt" / "pg-01"
    shutil.move(str(tmp_path / "pg-01"), moved)  # same name, other mount point
    r = ingest(any_store, [moved])
    assert (r.new, r.changed, r.unchanged, r.elsewhere_count) == (0, 0, 3, 3)
    assert (
        f"3 unchanged already stored from another place (e.g. {moved / 'episode_001'} is pg-01/episode_001)"
        in r.summary()
    )
    assert ingest(any_store, [tmp_path / "cluster" / "scratch" / "run-a"]).elsewhere_count == 3
    assert names(any_store) == ["pg-01/episode_001", "pg-01/episode_002", "pg-01/episode_003"]
    assert rows(any_store, "SELECT COUNT(*) FROM episodes") == [(3,)]


def test_corrected_reward_in_a_copy_is_a_new_version_of_the_same_episode(store, tmp_path):
    write_standard_episodes(tmp_path / "pg-01", 3)
    ingest(store, [tmp_path / "pg-01"])
    copy = tmp_path / "cluster" / "pg-01"
    shutil.copytree(tmp_path / "pg-01", copy)
    result = copy / "episode_002" / "result.json"
    result.write_text(json.dumps({**json.loads(result.read_text()), "episode_reward": 0.99}))
    r = ingest(store, [copy])
    assert (r.new, r.changed, r.unchanged) == (0, 1, 2)
    assert rows(
        store, "SELECT version, is_current, reward FROM episodes WHERE name = 'pg-01/episode_002' ORDER BY version"
    )[1] == (2, 1, 0.99)
    assert len({k for (k,) in rows(store, "SELECT source_key FROM episodes WHERE name = 'pg-01/episode_002'")}) == 1


def test_one_session_id_with_two_contents_in_one_ingest_is_refused(store, tmp_path):
    b = EpisodeBuilder(seed=1).standard()
    b.write(tmp_path / "r" / "episode_001")
    b.reward = 0.01
    b.write(tmp_path / "r" / "episode_002")  # same session (same header id), other result
    r = ingest(store, [tmp_path / "r"])
    assert (r.new, r.changed, r.failed) == (1, 0, 1)
    assert f"same episode as {tmp_path / 'r' / 'episode_001'}" in r.failures[0][1]
    assert rows(store, "SELECT name, version FROM episodes") == [("r/episode_001", 1)]
    again = ingest(store, [tmp_path / "r"])  # nothing flip-flops between the two
    assert (again.new, again.changed, again.unchanged, again.failed) == (0, 0, 1, 1)


def test_a_v1_session_without_id_is_keyed_by_its_session(store, tmp_path):
    b = EpisodeBuilder(version=1, seed=3).standard()
    b.write(tmp_path / "a" / "episode_001")
    ingest(store, [tmp_path / "a"])
    b.reward = 0.9
    b.write(tmp_path / "b" / "episode_001")  # moved, and the reward corrected
    r = ingest(store, [tmp_path / "b"])
    assert (r.new, r.changed) == (0, 1)
    assert rows(store, "SELECT name, version, reward FROM episodes WHERE is_current") == [("a/episode_001", 2, 0.9)]


# ---- names ------------------------------------------------------------------------------------------


def test_two_roots_give_six_names_in_views_and_six_exported_files(any_store, tmp_path):
    r = ingest(any_store, two_roots(tmp_path / "in"))
    assert r.new == 6 and names(any_store) == ROOT_NAMES
    add_scorer(any_store, "sc", spec={"max_logprob_tokens": 2048})
    add_scores(any_store, "sc", seed=1)
    compute_credits(any_store, name="r1")
    assert sorted(n for (n,) in rows(any_store, "SELECT DISTINCT episode FROM step_scores")) == ROOT_NAMES
    by_episode = rows(
        any_store, "SELECT episode, COUNT(DISTINCT episode_id) FROM step_credits GROUP BY episode ORDER BY episode"
    )
    assert by_episode == [(n, 1) for n in ROOT_NAMES]
    assert sorted({n for (n,) in rows(any_store, "SELECT episode FROM subtask_credits")}) == ROOT_NAMES
    out = export_hindsight_json(any_store, tmp_path / "hs", "r1")
    files = sorted(str(p.relative_to(tmp_path / "hs").parent) for p in (tmp_path / "hs").rglob("hindsight_scores.json"))
    assert out.episodes == 6 and files == ROOT_NAMES
    rewards = {json.loads((tmp_path / "hs" / n / "hindsight_scores.json").read_text())["reward"] for n in ROOT_NAMES}
    assert len(rewards) == 6  # six different episodes, none overwritten


def test_same_named_roots_and_single_directories_get_unique_names(store, tmp_path):
    write_standard_episodes(tmp_path / "a" / "trajectories", 1, seed=0)
    write_standard_episodes(tmp_path / "b" / "trajectories", 1, seed=5)
    EpisodeBuilder(seed=7).standard().write(tmp_path / "c" / "episode_001")
    EpisodeBuilder(seed=8).standard().write(tmp_path / "d" / "episode_001")
    for path in ("a/trajectories", "b/trajectories", "c/episode_001", "d/episode_001"):
        assert ingest(store, [tmp_path / path]).new == 1
    assert names(store) == ["b/trajectories/episode_001", "d/episode_001", "episode_001", "trajectories/episode_001"]


# ---- JSONL --------------------------------------------------------------------------------------------


def jsonl_episode(reward: float, text: str, **extra) -> dict:
    return {
        **extra,
        "reward": reward,
        "messages": [
            {"role": "user", "content": f"task {text}"},
            {"role": "assistant", "content": f"step one {text}"},
            {"role": "tool", "tool_call_id": "t", "name": "bash", "content": "ok"},
            {"role": "assistant", "content": f"step two {text}"},
        ],
    }


def write_jsonl(path: Path, episodes: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def test_jsonl_ids_are_normalised_and_a_clash_is_refused_on_every_line(any_store, tmp_path):
    path = write_jsonl(
        tmp_path / "eps.jsonl",
        [
            jsonl_episode(0.5, "a", episode_id=1),
            jsonl_episode(0.25, "b", episode_id="1"),
            jsonl_episode(0.75, "c", episode_id=2),
        ],
    )
    r = ingest(any_store, [path])
    assert (r.new, r.failed) == (1, 2)
    assert sorted(e for _, e in r.failures) == [
        f"{path}:{n}: lines 1, 2 are the same episode (jsonl:eps.jsonl#1) with different contents: none is "
        "stored; give each its own episode_id"
        for n in (1, 2)
    ]
    assert names(any_store) == ["eps.jsonl#2"]
    again = ingest(any_store, [path])
    assert (again.new, again.changed, again.unchanged, again.failed) == (0, 0, 1, 2)


def test_jsonl_explicit_line2_and_idless_line2_are_two_episodes_and_reingest_is_a_noop(any_store, tmp_path):
    write_jsonl(
        tmp_path / "run" / "eps.jsonl",
        [
            jsonl_episode(0.5, "explicit", episode_id="line2"),
            jsonl_episode(0.25, "no id"),
            jsonl_episode(0.75, "seven", episode_id=7),
            jsonl_episode(0.75, "seven", episode_id=7),
        ],
    )  # a repeat
    r = ingest(any_store, [tmp_path / "run"])
    assert (r.new, r.changed, r.unchanged, r.failed) == (3, 0, 1, 0)
    assert names(any_store) == ["run/eps.jsonl#7", "run/eps.jsonl#line2", "run/eps.jsonl:2"]
    add_scorer(any_store, "sc")
    scored = add_scores(any_store, "sc")
    for target in (tmp_path / "run", tmp_path / "moved" / "run"):
        if not target.exists():
            shutil.move(str(tmp_path / "run"), target)
        r = ingest(any_store, [target])
        assert (r.new, r.changed, r.unchanged, r.failed) == (0, 0, 4, 0), r.summary()
    assert rows(any_store, "SELECT COUNT(*) FROM episodes") == [(3,)]
    assert rows(any_store, "SELECT COUNT(*) FROM step_scores") == [(scored,)]  # no score orphaned


def test_jsonl_bad_id_fails_its_line_only(store, tmp_path):
    path = write_jsonl(
        tmp_path / "eps.jsonl",
        [jsonl_episode(0.5, "a", episode_id=[1]), jsonl_episode(0.5, "b", episode_id=True), jsonl_episode(0.5, "c")],
    )
    r = ingest(store, [path])
    assert (r.new, r.failed) == (1, 2)
    assert [e.split(": ", 1)[0] for _, e in r.failures] == [f"{path}:1", f"{path}:2"]


@pytest.mark.parametrize(
    "value, want",
    [(1, "1"), ("1", "1"), (1.0, "1"), (" 7 ", "7"), ("01", "01"), (1.5, "1.5"), (None, None), ("", None)],
)
def test_normalise_id(value, want):
    assert normalise_id(value) == want


# ---- --episode ----------------------------------------------------------------------------------------


def test_episode_lookup_by_name_end_or_id_and_ambiguity_lists_candidates(any_store, tmp_path):
    ingest(any_store, two_roots(tmp_path))
    EpisodeBuilder(seed=99, episode_id=4).standard().write(tmp_path / "pg-03" / "episode_004")
    ingest(any_store, [tmp_path / "pg-03"])
    ids = dict(rows(any_store, "SELECT name, id FROM episodes"))
    with any_store.engine.connect() as conn:
        key = resolve_episode(conn, "pg-01/episode_001")
        assert resolve_episode(conn, str(ids["pg-01/episode_001"])) == key
        assert resolve_episode(conn, "episode_004") == resolve_episode(conn, "pg-03/episode_004") != key
        with pytest.raises(EpisodeLookupError):
            resolve_episode(conn, "03/episode_004")  # a part of a name ends at a "/"
        with pytest.raises(EpisodeLookupError) as info:
            resolve_episode(conn, "episode_001")
        assert str(info.value) == (
            f"episode 'episode_001' is ambiguous: it matches 2 episodes: pg-01/episode_001 (id "
            f"{ids['pg-01/episode_001']}), pg-02/episode_001 (id {ids['pg-02/episode_001']}); "
            "give the full name or the id"
        )
        with pytest.raises(EpisodeLookupError, match="no episode 'episode_009'"):
            resolve_episode(conn, "episode_009")


def test_score_episode_refuses_an_ambiguous_name_in_one_line(runner, tmp_path):
    db = str(tmp_path / "s.db")
    for root in two_roots(tmp_path):
        assert runner.invoke(cli, ["--db", db, "ingest", str(root)]).exit_code == 0
    r = runner.invoke(cli, ["--db", db, "score", "--server", "http://127.0.0.1:9", "--episode", "episode_002"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip().splitlines() == [
        "Error: episode 'episode_002' is ambiguous: it matches 2 episodes: pg-01/episode_002 (id 2), "
        "pg-02/episode_002 (id 5); give the full name or the id"
    ]


def test_jsonl_same_file_name_and_id_in_two_runs_in_one_ingest_is_refused_naming_the_first(store, tmp_path):
    first = write_jsonl(tmp_path / "run1" / "eps.jsonl", [jsonl_episode(0.5, "run one", episode_id=1)])
    second = write_jsonl(tmp_path / "run2" / "eps.jsonl", [jsonl_episode(0.5, "run two", episode_id=1)])
    r = ingest(store, [first, second])
    assert (r.new, r.failed) == (1, 1)
    assert r.failures[0][1].startswith(f"{second}:1: same episode as {first}:1 (jsonl:eps.jsonl#1)")
    assert rows(store, "SELECT name, reward FROM episodes") == [("eps.jsonl#1", 0.5)]


def test_reingest_after_every_version_was_retired_by_hand_adds_the_next_version(store, tmp_path):
    write_standard_episodes(tmp_path / "pg-01", 1)
    ingest(store, [tmp_path / "pg-01"])
    store.query("UPDATE episodes SET is_current = FALSE", read_only=False)
    r = ingest(store, [tmp_path / "pg-01"])
    assert (r.new, r.changed, r.failed) == (0, 1, 0)
    assert rows(store, "SELECT name, version, is_current FROM episodes ORDER BY version") == [
        ("pg-01/episode_001", 1, 0),
        ("pg-01/episode_001", 2, 1),
    ]


def test_a_change_from_another_place_is_a_version_and_is_said(store, tmp_path):
    """JSONL ids are scoped by file name: another run's eps.jsonl with id 1 is a new version, said loudly."""
    ingest(store, [write_jsonl(tmp_path / "run1" / "eps.jsonl", [jsonl_episode(0.5, "one", episode_id=1)])])
    r = ingest(store, [write_jsonl(tmp_path / "run2" / "eps.jsonl", [jsonl_episode(0.5, "two", episode_id=1)])])
    assert (r.new, r.changed, r.changed_elsewhere_count) == (0, 1, 1)
    assert (
        f"1 changed an episode read from another place (e.g. {tmp_path / 'run2' / 'eps.jsonl'}:1 is a new "
        "version of eps.jsonl#1; if it is another episode, give it its own id)"
    ) in r.summary()
    same_place = ingest(
        store, [write_jsonl(tmp_path / "run2" / "eps.jsonl", [jsonl_episode(0.9, "two", episode_id=1)])]
    )
    assert (same_place.changed, same_place.changed_elsewhere_count) == (1, 0)  # run2's file is now the episode's
    write_standard_episodes(tmp_path / "pg-01", 1)
    ingest(store, [tmp_path / "pg-01"])
    result = tmp_path / "pg-01" / "episode_001" / "result.json"
    result.write_text(json.dumps({**json.loads(result.read_text()), "episode_reward": 0.99}))
    r = ingest(store, [tmp_path / "pg-01"])
    assert (r.changed, r.changed_elsewhere_count) == (1, 0)  # corrected in place: nothing to say


# ---- identity by content, not by how a file was saved (issue 21) ---------------------------------


def _resave(path: Path, *, crlf: bool = False, bom: bool = False, newline: bytes | None = None) -> None:
    data = path.read_bytes()
    if crlf:
        data = data.replace(b"\n", b"\r\n")
    if newline is not None:
        data += newline
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)


@pytest.mark.parametrize(
    "resave",
    [{"crlf": True}, {"newline": b"\n"}, {"bom": True}, {"crlf": True, "bom": True, "newline": b"\r\n"}],
    ids=["crlf", "extra-final-newline", "bom", "all"],
)
def test_a_v1_session_resaved_by_an_editor_stays_the_same_unchanged_episode(any_store, tmp_path, resave):
    d = EpisodeBuilder(version=1, seed=5).standard().write(tmp_path / "a" / "episode_001")
    assert ingest(any_store, [tmp_path / "a"]).new == 1
    _resave(d / "pi_session.jsonl", **resave)
    _resave(d / "result.json", **{k: v for k, v in resave.items() if k != "newline"})
    r = ingest(any_store, [tmp_path / "a"])
    assert (r.new, r.changed, r.unchanged, r.failed) == (0, 0, 1, 0), r.summary()
    assert rows(any_store, "SELECT count(*) FROM episodes") == [(1,)]


@pytest.mark.parametrize(
    "resave",
    [{"crlf": True}, {"bom": True}, {"crlf": True, "bom": True}],
    ids=["crlf", "bom", "both"],
)
def test_a_jsonl_resaved_by_an_editor_is_unchanged(any_store, tmp_path, resave):
    path = write_jsonl(tmp_path / "eps.jsonl", [jsonl_episode(0.5, "a", episode_id=1), jsonl_episode(0.7, "b")])
    assert ingest(any_store, [path]).new == 2
    _resave(path, **resave)
    r = ingest(any_store, [path])
    assert (r.new, r.changed, r.unchanged, r.failed) == (0, 0, 2, 0), r.summary()


def test_a_jsonl_whose_last_line_only_gained_its_newline_is_unchanged(any_store, tmp_path):
    path = tmp_path / "eps.jsonl"
    path.write_text(json.dumps(jsonl_episode(0.5, "a", episode_id=1)) + "\n" + json.dumps(jsonl_episode(0.7, "b")))
    assert ingest(any_store, [path]).new == 2
    _resave(path, newline=b"\n")
    r = ingest(any_store, [path])
    assert (r.new, r.changed, r.unchanged, r.failed) == (0, 0, 2, 0), r.summary()
