"""One bad episode never aborts or rolls back the batch (issue 8 §2), on SQLite and PostgreSQL.

The bad episode fails with one line naming its file (and line); every other episode of the
batch is stored; the exit status is 1. A property-based test replaces each field of a valid
episode, in both formats, with values of the wrong type and size.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pg
import pytest
from _hypothesis import session_settings
from builders import EpisodeBuilder
from click.testing import CliRunner
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from sqlalchemy import text

from hcapo_store.cli import cli
from hcapo_store.ingestion.pipeline import ingest
from hcapo_store.storage.store import Store

PLACEHOLDER = '"__BAD_VALUE__"'
DEEP = "[" * 200_000 + "]" * 200_000  # a value nested 200,000 deep
_unique = itertools.count(1)


# --------------------------------------------------------------------------- valid episodes


def jsonl_episode(marker: str) -> dict[str, Any]:
    """A valid OpenAI-format episode touching every field the converter reads."""
    return {
        "episode_id": marker,
        "reward": 0.5,
        "plan_score": 0.4,
        "phase": "DONE",
        "turns": 4,
        "tool_call_count": 1,
        "_reward_backfilled": False,
        "plan": [{"id": "S1", "description": "do it"}],
        "frozen_scores": {"S1": 0.25},
        "messages": [
            {"role": "user", "content": f"task {marker}"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "plan first",
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "submit_plan", "arguments": {"subtasks": []}}}
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "name": "submit_plan", "content": '{"plan_score": 0.4}'},
            {"role": "assistant", "content": [{"type": "text", "text": "working"}]},
        ],
    }


def pi_episode(marker: str) -> EpisodeBuilder:
    b = EpisodeBuilder(seed=next(_unique), episode_id=next(_unique)).standard(steps_per_subtask=1)
    user = next(e for e in b.entries if e.get("message", {}).get("role") == "user")
    user["message"]["content"][0]["text"] = f"task {marker}"
    return b


def _set(obj: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _dumps_with(obj: dict[str, Any], path: tuple, raw: str) -> str:
    """obj as one JSON line with the value at ``path`` replaced by the raw JSON text ``raw``."""
    _set(obj, path, json.loads(PLACEHOLDER))
    line = json.dumps(obj)
    assert line.count(PLACEHOLDER) == 1
    return line.replace(PLACEHOLDER, raw)


# --------------------------------------------------------------------------- wrong values


def _j(strategy: st.SearchStrategy) -> st.SearchStrategy[str]:
    return strategy.map(json.dumps)


texts = _j(st.text(max_size=12))
ints = _j(st.integers(min_value=-(10**6), max_value=10**6))
floats = _j(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6))
bools = _j(st.booleans())
lists = _j(st.lists(st.integers(min_value=0, max_value=9), max_size=3))
objects = _j(st.dictionaries(st.text(max_size=4), st.integers(min_value=0, max_value=9), max_size=2))
huge_ints = st.sampled_from([400, 5000]).map(lambda n: "9" * n) | st.integers(10, 600).map(lambda n: "1" + "0" * n)
out_of_range = _j(
    st.floats(min_value=1.01e9, max_value=1e300) | st.floats(min_value=-1e300, max_value=-1.01e9)
) | st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400"])
deep = st.just(DEEP)

WRONG: dict[str, st.SearchStrategy[str]] = {
    "score": st.one_of(texts, bools, lists, objects, huge_ints, out_of_range, deep),
    "count": st.one_of(
        texts,
        bools,
        lists,
        objects,
        floats,
        huge_ints,
        deep,
        _j(st.integers(max_value=-1)),
        _j(st.integers(min_value=2**31, max_value=10**30)),
    ),
    "string": st.one_of(ints, floats, bools, lists, objects, huge_ints, deep),
    "id": st.one_of(floats, bools, lists, objects, deep),
    "plan_id": st.one_of(floats, bools, lists, objects, deep, st.just("null")),
    "object": st.one_of(texts, ints, floats, bools, lists, deep),
    "list": st.one_of(texts, ints, floats, bools, objects, deep),
    "bool": st.one_of(texts, ints, floats, lists, objects, deep),
    "content": st.one_of(ints, floats, bools, objects, huge_ints, deep),
    "arguments": st.one_of(ints, floats, bools, lists, deep),
    "version": st.one_of(
        texts,
        floats,
        bools,
        lists,
        objects,
        huge_ints,
        deep,
        _j(st.integers(max_value=0)),
        _j(st.integers(min_value=1000, max_value=10**30)),
    ),
}

# (path in the JSONL episode, kind of wrong value)
JSONL_FIELDS = [
    (("reward",), "score"),
    (("plan_score",), "score"),
    (("frozen_scores",), "object"),
    (("frozen_scores", "S1"), "score"),
    (("turns",), "count"),
    (("tool_call_count",), "count"),
    (("phase",), "string"),
    (("_reward_backfilled",), "bool"),
    (("plan",), "list"),
    (("plan", 0), "object"),
    (("plan", 0, "id"), "plan_id"),
    (("messages",), "list"),
    (("messages", 0), "object"),
    (("messages", 0, "role"), "string"),
    (("messages", 0, "content"), "content"),
    (("messages", 1, "reasoning_content"), "string"),
    (("messages", 1, "tool_calls"), "list"),
    (("messages", 1, "tool_calls", 0), "object"),
    (("messages", 1, "tool_calls", 0, "id"), "string"),
    (("messages", 1, "tool_calls", 0, "function"), "object"),
    (("messages", 1, "tool_calls", 0, "function", "name"), "string"),
    (("messages", 1, "tool_calls", 0, "function", "arguments"), "arguments"),
    (("messages", 2, "name"), "string"),
    (("messages", 2, "tool_call_id"), "string"),
    (("messages", 2, "content"), "content"),
    (("messages", 3, "content", 0), "object"),
    (("messages", 3, "content", 0, "text"), "string"),
]


def _first(role: str, block: str | None = None) -> Callable[[dict[str, Any]], bool]:
    def match(entry: dict[str, Any]) -> bool:
        msg = entry.get("message") or {}
        return msg.get("role") == role and (block is None or any(b.get("type") == block for b in msg["content"]))

    return match


# (which file / entry, path in it, kind of wrong value); the assistant entry picked first has
# a thinking block then a tool call, the next picked one a text block then a tool call.
PI_FIELDS = [
    ("header", ("version",), "version"),
    ("result", ("episode_reward",), "score"),
    ("result", ("plan_score",), "score"),
    ("result", ("frozen_scores",), "object"),
    ("result", ("frozen_scores", "S1"), "score"),
    ("result", ("turns",), "count"),
    ("result", ("tool_call_count",), "count"),
    ("result", ("phase",), "string"),
    ("result", ("plan",), "list"),
    ("result", ("plan", 0), "object"),
    ("result", ("plan", 0, "id"), "plan_id"),
    ("result", ("episode_id",), "id"),
    ("user", ("message",), "object"),
    ("user", ("message", "role"), "string"),
    ("user", ("message", "content"), "content"),
    ("user", ("message", "content", 0), "object"),
    ("user", ("message", "content", 0, "text"), "string"),
    ("thinking", ("message", "content"), "content"),
    ("thinking", ("message", "content", 0, "thinking"), "string"),
    ("thinking", ("message", "content", 1, "id"), "string"),
    ("thinking", ("message", "content", 1, "name"), "string"),
    ("thinking", ("message", "content", 1, "arguments"), "arguments"),
    ("text", ("message", "content", 0, "text"), "string"),
    ("tool", ("message", "toolName"), "string"),
    ("tool", ("message", "toolCallId"), "string"),
    ("tool", ("message", "isError"), "bool"),
    ("tool", ("message", "content"), "content"),
    ("tool", ("message", "content", 0, "text"), "string"),
]
PI_ENTRY = {
    "header": lambda e: e.get("type") == "session",
    "user": _first("user"),
    "thinking": _first("assistant", "thinking"),
    "text": _first("assistant", "text"),
    "tool": _first("toolResult"),
}


# --------------------------------------------------------------------------- checks


def _stored(store: Store, marker: str) -> int:
    with store.engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT COUNT(*) FROM messages m JOIN episodes e ON e.id = m.episode_id "
                "WHERE e.is_current AND m.content = :c"
            ),
            {"c": f"task {marker}"},
        ).scalar_one()


def _failure_line(source: str, error: str) -> str:
    """What the CLI prints for a failure."""
    return f"failed: {error}" if source in error else f"failed: {source}: {error}"


def _assert_isolated(report, store: Store, names_file: str, good: list[str]) -> None:
    assert report.failed == 1, report.failures
    assert report.new == len(good), (report.summary(), report.failures)
    ((source, error),) = report.failures
    line = _failure_line(source, error)
    assert "\n" not in line and names_file in line, line
    for marker in good:
        assert _stored(store, marker) == 1, marker


SETTINGS = session_settings(4, HealthCheck.large_base_example)


@pytest.mark.parametrize("path,kind", JSONL_FIELDS, ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else v)
def test_jsonl_wrong_field_fails_alone(store, tmp_path, path, kind):
    @SETTINGS
    @given(raw=WRONG[kind])
    def check(raw: str) -> None:
        n = next(_unique)
        good = [f"good-a-{n}", f"good-b-{n}"]
        file = (tmp_path / f"eps{n}.jsonl").resolve()
        bad = _dumps_with(jsonl_episode(f"bad-{n}"), path, raw)
        file.write_text("\n".join([json.dumps(jsonl_episode(good[0])), bad, json.dumps(jsonl_episode(good[1]))]) + "\n")
        _assert_isolated(ingest(store, [file]), store, f"{file}:2", good)

    check()


@pytest.mark.parametrize(
    "target,path,kind", PI_FIELDS, ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else v
)
def test_pi_wrong_field_fails_alone(store, tmp_path, target, path, kind):
    @SETTINGS
    @given(raw=WRONG[kind])
    def check(raw: str) -> None:
        n = next(_unique)
        root = tmp_path / f"run{n}"
        good = [f"good-a-{n}", f"good-b-{n}"]
        pi_episode(good[0]).write(root / "episode_a")
        pi_episode(good[1]).write(root / "episode_c")
        b = pi_episode(f"bad-{n}")
        d = b.write(root / "episode_b").resolve()
        if target == "result":
            (d / "result.json").write_text(_dumps_with(b.result(), path, raw))
            names = str(d / "result.json")
        else:
            index = next(i for i, e in enumerate(b.entries) if PI_ENTRY[target](e))
            lines = [json.dumps(e) for e in b.entries]
            lines[index] = _dumps_with(b.entries[index], path, raw)
            (d / "pi_session.jsonl").write_text("\n".join(lines) + "\n")
            names = f"{d / 'pi_session.jsonl'}:{index + 1}"
        _assert_isolated(ingest(store, [root]), store, names, good)

    check()


# --------------------------------------------------------------------------- the issue's cases, both databases


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "store.db")
    else:
        with pg.fresh_database("isolation") as url:
            yield url


ISSUE_JSONL_CASES: dict[str, tuple[tuple, str]] = {
    "tool_calls list of strings": (("messages", 1, "tool_calls"), '["x"]'),
    "tool_calls number": (("messages", 1, "tool_calls"), "5"),
    "function a string": (("messages", 1, "tool_calls", 0, "function"), '"bash"'),
    "400-digit reward": (("reward",), "9" * 400),
    "5000-digit reward": (("reward",), "9" * 5000),
    "turns 10**30": (("turns",), str(10**30)),
    "phase object": (("phase",), '{"a": 1}'),
    "phase list": (("phase",), "[1]"),
    "tool name number": (("messages", 1, "tool_calls", 0, "function", "name"), "5"),
    "tool_call_id number": (("messages", 2, "tool_call_id"), "7"),
    "nested 200,000 deep": (("messages", 0, "content"), DEEP),
}
ISSUE_PI_CASES: dict[str, tuple[str, tuple, str]] = {
    "thinking number": ("thinking", ("message", "content", 0, "thinking"), "12345"),
    "text list": ("text", ("message", "content", 0, "text"), '["a"]'),
    "toolName number": ("tool", ("message", "toolName"), "3"),
}


def _issue_batch(root: Path) -> tuple[dict[str, str], list[str]]:
    """The issue's bad cases among good episodes; returns (case -> file[:line] to name, good markers)."""
    expected: dict[str, str] = {}
    good = ["first", "last", "pi-first", "pi-last", "nul-jsonl", "nul-pi"]
    lines = [json.dumps(jsonl_episode("first"))]
    for case, (path, raw) in ISSUE_JSONL_CASES.items():
        lines.append(_dumps_with(jsonl_episode(case), path, raw))
        expected[case] = f"{root / 'eps.jsonl'}:{len(lines)}"
    nul = jsonl_episode("nul-jsonl")
    nul["messages"][2]["content"] = '{"plan_score": 0.4, "out": "a\u0000b"}'
    nul["messages"][3]["content"] = [{"type": "text", "text": "bytes a\u0000b"}]
    lines.append(json.dumps(nul))
    lines.append(json.dumps(jsonl_episode("last")))
    (root / "eps.jsonl").write_text("\n".join(lines) + "\n")
    pi_episode("pi-first").write(root / "episode_a")
    for i, (case, (target, path, raw)) in enumerate(ISSUE_PI_CASES.items()):
        b = pi_episode(case)
        d = b.write(root / f"episode_b{i}")
        index = next(j for j, e in enumerate(b.entries) if PI_ENTRY[target](e))
        session = [json.dumps(e) for e in b.entries]
        session[index] = _dumps_with(b.entries[index], path, raw)
        (d / "pi_session.jsonl").write_text("\n".join(session) + "\n")
        expected[case] = f"{d / 'pi_session.jsonl'}:{index + 1}"
    b = pi_episode("nul-pi")
    tool = next(e for e in b.entries if PI_ENTRY["tool"](e))
    tool["message"]["content"][0]["text"] = "binary \x00 output"
    b.write(root / "episode_c")
    pi_episode("pi-last").write(root / "episode_d")
    return expected, good


def test_issue_cases_fail_alone_with_exit_1(db_url, tmp_path):
    root = (tmp_path / "batch").resolve()
    root.mkdir()
    expected, good = _issue_batch(root)
    result = CliRunner().invoke(cli, ["--db", db_url, "ingest", str(root)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    failed = [line for line in result.stderr.splitlines() if line.startswith("failed: ")]
    assert len(failed) == len(expected), failed
    for case, where in expected.items():
        assert sum(f"{where}: " in line for line in failed) == 1, (case, where, failed)
    assert f"{len(good)} new" in result.stdout and f"{len(expected)} failed" in result.stdout
    with Store.open(db_url) as store:
        for marker in good:
            assert _stored(store, marker) == 1, marker
        with store.engine.connect() as conn:
            contents = {
                c
                for (c,) in conn.execute(text("SELECT content FROM messages WHERE content LIKE :p"), {"p": "%\ufffd%"})
            }
            warnings = [w for (w,) in conn.execute(text("SELECT warnings FROM episodes WHERE warnings LIKE '%NUL%'"))]
    # A NUL becomes U+FFFD on both databases, with a warning stored with the episode.
    assert contents == {"bytes a\ufffdb", '{"plan_score": 0.4, "out": "a\ufffdb"}', "binary \ufffd output"}
    assert len(warnings) == 2 and all("NUL character(s)" in w for w in warnings)
    assert "warning: " in result.stderr and "NUL character(s)" in result.stderr


def test_database_error_fails_only_that_episode(db_url, tmp_path):
    """A database refusing one episode's rows (a real trigger) fails that episode alone."""
    with Store.open(db_url) as store, store.engine.begin() as conn:
        if store.engine.dialect.name == "sqlite":
            conn.execute(
                text(
                    "CREATE TRIGGER poison BEFORE INSERT ON messages WHEN NEW.content LIKE '%POISON%' "
                    "BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "IF NEW.content LIKE '%POISON%' THEN RAISE EXCEPTION 'poisoned row' USING ERRCODE = '22000'; "
                    "END IF; RETURN NEW; END $$"
                )
            )
            conn.execute(text("CREATE TRIGGER poison BEFORE INSERT ON messages FOR EACH ROW EXECUTE FUNCTION poison()"))
    root = (tmp_path / "t").resolve()
    for name, marker in (("episode_a", "one"), ("episode_b", "POISON"), ("episode_c", "two")):
        pi_episode(marker).write(root / name)
    result = CliRunner().invoke(cli, ["--db", db_url, "ingest", str(root)])
    assert result.exit_code == 1, result.output
    failed = [line for line in result.stderr.splitlines() if line.startswith("failed: ")]
    assert failed == [f"failed: {root / 'episode_b'}: the database refused this episode: poisoned row"], failed
    with Store.open(db_url) as store:
        assert _stored(store, "one") == 1 and _stored(store, "two") == 1
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM episodes")).scalar_one() == 2


def test_too_long_tag_key_and_worker_id_are_refused_up_front(db_url, tmp_path):
    root = tmp_path / "t"
    pi_episode("tagged").write(root / "episode_a")
    runner = CliRunner()
    result = runner.invoke(cli, ["--db", db_url, "ingest", str(root), "--tag", "k" * 300 + "=v"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: tag key {'k' * 40!r}… is 300 characters long: a tag key has 1 to 200 characters"
    ]
    ok = runner.invoke(cli, ["--db", db_url, "ingest", str(root), "--tag", "k" * 200 + "=v"])
    assert ok.exit_code == 0, ok.output
    result = runner.invoke(cli, ["--db", db_url, "score", "--server", "http://127.0.0.1:9", "--worker-id", "w" * 300])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: worker id {'w' * 40!r}… (300 characters): a worker id has at most 200 characters and no NUL"
    ]
    with Store.open(db_url) as store, store.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM workers")).scalar_one() == 0
        assert conn.execute(text("SELECT COUNT(*) FROM scorers")).scalar_one() == 0
        assert conn.execute(text("SELECT COUNT(*) FROM tags")).scalar_one() == 1


# --------------------------------------------------------------------------- loud outcomes (issue 9 §3)


def test_a_file_that_is_not_jsonl_is_one_error(runner, db_path, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nSome text.\n\n```bash\nhcapo-store ingest x\n```\n" + "more text\n" * 150)
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", str(readme)])
    assert result.exit_code == 1
    failed = [line for line in result.stderr.splitlines() if line.startswith("failed: ")]
    assert failed == [
        (
            f"failed: {readme.resolve()}: not a JSONL file: none of its first 5 non-empty lines starts "
            "with '{' (one JSON episode object per line expected)"
        )
    ]
    assert "0 new" in result.stdout and "1 failed" in result.stdout


def test_jsonl_with_a_broken_first_line_is_still_jsonl(store, tmp_path):
    file = tmp_path / "eps.jsonl"
    file.write_text("garbage\n" + json.dumps(jsonl_episode("after")) + "\n")
    r = ingest(store, [file])
    assert (r.new, r.failed) == (1, 1) and "eps.jsonl:1: malformed JSON line" in r.failures[0][1]


def test_warnings_are_listed_with_the_query(runner, db_path, tmp_path):
    ep = jsonl_episode("planless")
    ep["messages"][2]["content"] = "Plan accepted."  # not a JSON object: the plan never starts
    ep["plan_score"] = None
    (tmp_path / "eps.jsonl").write_text(json.dumps(ep) + "\n")
    result = runner.invoke(cli, ["--db", str(db_path), "ingest", str(tmp_path / "eps.jsonl")])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 2
    assert "plan_score is null" in warned[0]
    assert warned[1].endswith(
        "plan has 1 subtask(s) but none of the 1 submit_plan result(s) is a JSON object "
        "without an 'error' key: every step is mapped to planning"
    )
    assert (
        '2 warning(s) stored with the episodes (hcapo-store sql "SELECT name, warnings FROM episodes '
        'WHERE is_current AND warnings IS NOT NULL")'
    ) in result.stdout


def test_plan_without_submit_plan_warns_and_accepted_plan_does_not(store, tmp_path):
    silent = jsonl_episode("accepted")
    no_call = jsonl_episode("no-call")
    no_call["messages"][1] = {"role": "assistant", "content": "thinking about it"}
    (tmp_path / "eps.jsonl").write_text(json.dumps(silent) + "\n" + json.dumps(no_call) + "\n")
    r = ingest(store, [tmp_path / "eps.jsonl"])
    assert r.new == 2 and r.warnings == 1
    assert (
        r.warning_list[0][1]
        == "plan has 1 subtask(s) but no answered submit_plan call: every step is mapped to planning"
    )


def test_lone_surrogates_are_stored_as_replacement_characters_with_a_warning(db_url, tmp_path):
    """An agent that cut a tool output inside an emoji writes a lone UTF-16 surrogate escape
    (``\\ud83d``); it failed the whole batch with a traceback on both databases (issue 21)."""
    root = (tmp_path / "batch").resolve()
    root.mkdir()
    cut = jsonl_episode("cut-jsonl")
    cut["messages"][1]["tool_calls"][0]["id"] = "t\ud83d"
    cut["messages"][2]["tool_call_id"] = "t\ud83d"
    cut["messages"][2]["name"] = "submit_plan\udc00"
    cut["messages"][3]["content"] = [{"type": "text", "text": "smile \ud83d then \ud83d\ude00 whole"}]
    lines = [json.dumps(jsonl_episode("before")), json.dumps(cut), json.dumps(jsonl_episode("after"))]
    (root / "eps.jsonl").write_text("\n".join(lines) + "\n")  # json.dumps escapes the surrogates
    b = pi_episode("cut-pi")
    tool = next(e for e in b.entries if PI_ENTRY["tool"](e))
    tool["message"]["content"][0]["text"] = "output cut in an emoji \ud83d"
    d = b.write(root / "episode_pi")
    (d / "pi_session.jsonl").write_text("\n".join(json.dumps(e) for e in b.entries) + "\n")

    result = CliRunner().invoke(cli, ["--db", db_url, "ingest", str(root)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "4 new" in result.stdout, result.output
    assert "lone UTF-16 surrogate(s)" in result.stderr
    with Store.open(db_url) as store, store.engine.connect() as conn:
        for marker in ("before", "after", "cut-jsonl", "cut-pi"):
            assert _stored(store, marker) == 1, marker
        contents = {
            c for (c,) in conn.execute(text("SELECT content FROM messages WHERE content LIKE :p"), {"p": "%\ufffd%"})
        }
        names = {n for (n,) in conn.execute(text("SELECT name FROM messages WHERE name LIKE :p"), {"p": "%\ufffd%"})}
        ids = {
            i
            for (i,) in conn.execute(
                text("SELECT tool_call_id FROM messages WHERE tool_call_id LIKE :p"), {"p": "%\ufffd%"}
            )
        }
        warned = conn.execute(text("SELECT COUNT(*) FROM episodes WHERE warnings LIKE '%surrogate%'")).scalar_one()
    # the lone halves become U+FFFD; a whole pair (an emoji) stays the emoji
    assert contents == {"smile \ufffd then \U0001f600 whole", "output cut in an emoji \ufffd"}
    assert names == {"submit_plan\ufffd"} and ids == {"t\ufffd"}
    assert warned == 2
