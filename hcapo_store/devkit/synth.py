"""Write realistic episodes in the real on-disk format (result.json + Pi session JSONL).

Used by the tests, the benchmarks, the demo and ``examples/``. ``EpisodeBuilder`` produces the
shapes of the Pi session format (v1, v2 and v3 session files, mcp proxy calls with
string or object args, thinking blocks, errors, compaction entries, extra roles).
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORDS = (
    "parse executor checkpoint wire table rollback hash query latch vacuum btree socket "
    "handshake catalog column index tuple schema commit portal merge planner filter heap "
    "scan buffer cursor lock page row project aggregate sort join window protocol"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class EpisodeBuilder:
    """Builds one episode turn by turn; ``write(dir)`` writes it in Pi session format."""

    version: int = 3
    seed: int = 0
    episode_id: int = 1
    reward: float | None = 0.5
    plan_score: float | None = 0.7
    phase: str = "DONE"
    plan_ids: tuple[str, ...] = ("S1", "S2", "S3", "S4")
    frozen_scores: dict[str, float] | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    _n: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        if self.frozen_scores is None:
            self.frozen_scores = {sid: round(self.rng.random(), 4) for sid in self.plan_ids}

    # -- entries -------------------------------------------------------------
    def _id(self) -> str:
        self._n += 1
        return f"{self._n:08x}"

    def _entry(self, type_: str, **fields: Any) -> dict[str, Any]:
        e: dict[str, Any] = {"type": type_}
        if self.version >= 2:
            e["id"] = self._id()
            e["parentId"] = self.entries[-1]["id"] if self.entries and "id" in self.entries[-1] else None
        e["timestamp"] = f"2026-04-20T11:{self._n // 60:02d}:{self._n % 60:02d}.000Z"
        e.update(fields)
        self.entries.append(e)
        return e

    def header(self) -> EpisodeBuilder:
        h: dict[str, Any] = {"type": "session", "timestamp": "2026-04-20T11:00:00Z", "cwd": "/app/postgres-sqlite"}
        if self.version >= 2:
            h["version"] = self.version
            # Unique per (seed, episode): real Pi session ids are UUIDs, the identity of an episode.
            h["id"] = f"{self.seed:08x}-0000-4000-8000-{self.episode_id:012d}"
        else:
            h.update({"provider": "openai-compat", "modelId": "Qwen/Qwen3.6-27B", "thinkingLevel": "medium"})
        self.entries.append(h)
        if self.version >= 2:
            self._entry("model_change", provider="openai-compat", modelId="Qwen/Qwen3.6-27B")
        return self

    def user(self, text: str) -> EpisodeBuilder:
        self._entry("message", message={"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 0})
        return self

    def assistant(
        self, *, text: str | None = None, thinking: str | None = None, calls: Sequence[tuple[str, str, Any]] = ()
    ) -> EpisodeBuilder:
        """``calls`` = [(call_id, name, arguments)]."""
        content: list[dict[str, Any]] = []
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "thinkingSignature": "reasoning_content"})
        if text:
            content.append({"type": "text", "text": text})
        for call_id, name, args in calls:
            content.append({"type": "toolCall", "id": call_id, "name": name, "arguments": args})
        self._entry(
            "message",
            message={
                "role": "assistant",
                "content": content,
                "api": "openai-completions",
                "provider": "openai-compat",
                "model": "Qwen/Qwen3.6-27B",
                "stopReason": "toolUse" if calls else "stop",
                "timestamp": 0,
                "usage": {
                    "input": 100,
                    "output": 10,
                    "cacheRead": 0,
                    "cacheWrite": 0,
                    "totalTokens": 110,
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
                },
            },
        )
        return self

    def tool_result(self, call_id: str, name: str, text: str, *, is_error: bool = False) -> EpisodeBuilder:
        self._entry(
            "message",
            message={
                "role": "toolResult",
                "toolCallId": call_id,
                "toolName": name,
                "content": [{"type": "text", "text": text}],
                "isError": is_error,
                "timestamp": 0,
            },
        )
        return self

    def compaction(self) -> EpisodeBuilder:
        if self.version == 1:
            self._entry("compaction", summary="earlier work", firstKeptEntryIndex=2, tokensBefore=115000)
        else:
            self._entry(
                "compaction", summary="earlier work", firstKeptEntryId=self.entries[2].get("id"), tokensBefore=115000
            )
        return self

    def raw_message(self, role: str, **fields: Any) -> EpisodeBuilder:
        self._entry("message", message={"role": role, **fields})
        return self

    # -- higher-level turns ---------------------------------------------------
    def mcp(self, call_id: str, tool: str, args: Any, *, as_string: bool = False) -> tuple[str, str, Any]:
        return (call_id, "mcp", {"tool": f"openenv_{tool}", "args": json.dumps(args) if as_string else args})

    def bash_turn(self, n: int = 1, *, output_words: int = 40) -> EpisodeBuilder:
        for _ in range(n):
            cid = f"call_{self._id()}"
            self.assistant(thinking=words(self.rng, 12), calls=[(cid, "bash", {"command": f"ls {words(self.rng, 2)}"})])
            self.tool_result(cid, "bash", words(self.rng, output_words))
        return self

    def submit_plan(self, *, ok: bool = True, with_bash: bool = False, as_string: bool = False) -> EpisodeBuilder:
        cid = f"call_{self._id()}"
        plan = [
            {"id": s, "description": words(self.rng, 6), "acceptance_criteria": words(self.rng, 4)}
            for s in self.plan_ids
        ]
        calls = []
        bash_id = f"call_{self._id()}"
        if with_bash:
            calls.append((bash_id, "bash", {"command": "cat PLAN.md"}))
        calls.append(self.mcp(cid, "submit_plan", {"subtasks": plan}, as_string=as_string))
        self.assistant(text="Submitting the plan.", calls=calls)
        if with_bash:
            self.tool_result(bash_id, "bash", "# plan\n" + words(self.rng, 10))
        body = (
            {
                "plan_score": self.plan_score,
                "feedback": words(self.rng, 8),
                "phase": "EXECUTING",
                "current_subtask": self.plan_ids[0],
            }
            if ok
            else {"error": "Plan must have 1-5 subtasks, got 7"}
        )
        self.tool_result(cid, "mcp", json.dumps(body))
        return self

    def submit_subtask(self, sid: str) -> EpisodeBuilder:
        cid = f"call_{self._id()}"
        self.assistant(calls=[self.mcp(cid, "submit_subtask", {"subtask_id": sid})])
        scores = self.frozen_scores
        assert scores is not None  # filled in by __post_init__
        self.tool_result(
            cid,
            "mcp",
            json.dumps({"score": scores[sid], "best_score": scores[sid], "feedback": "ok", "attempts_remaining": 1}),
        )
        return self

    def advance(self, next_id: str | None, *, ok: bool = True) -> EpisodeBuilder:
        cid = f"call_{self._id()}"
        self.assistant(text="Moving on.", calls=[self.mcp(cid, "advance", {})])
        body: dict[str, Any] = (
            {"frozen_score": 0.5, "next_subtask_id": next_id, "episode_done": next_id is None}
            if ok
            else {"error": "Cannot advance in phase PLANNING"}
        )
        self.tool_result(cid, "mcp", json.dumps(body))
        return self

    def standard(self, *, steps_per_subtask: int = 2, output_words: int = 40) -> EpisodeBuilder:
        """header, task, exploration, plan, each subtask worked, submitted and advanced."""
        self.header().user("# PostgreSQL Wire Adapter\n" + words(self.rng, 30) + "\n\nPlease begin.")
        self.bash_turn(1, output_words=output_words)
        self.submit_plan()
        for i, sid in enumerate(self.plan_ids):
            self.bash_turn(steps_per_subtask, output_words=output_words)
            self.submit_subtask(sid)
            self.advance(self.plan_ids[i + 1] if i + 1 < len(self.plan_ids) else None)
        self.assistant(text="All subtasks are done.")
        return self

    # -- output ----------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "worker_id": 0,
            "turns": 5,
            "elapsed_s": 100.0,
            "phase": self.phase,
            "plan_score": self.plan_score,
            "frozen_scores": self.frozen_scores,
            "episode_reward": self.reward,
            "tool_call_count": 42,
            "plan": [
                {"id": s, "description": words(random.Random(i), 6), "acceptance_criteria": "tests pass"}
                for i, s in enumerate(self.plan_ids)
            ],
            "done": True,
        }

    def session_text(self) -> str:
        return "".join(json.dumps(e) + "\n" for e in self.entries)

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "result.json").write_text(json.dumps(self.result(), indent=2))
        (directory / "pi_session.jsonl").write_text(self.session_text())
        return directory


def write_standard_episodes(
    root: Path, n: int, *, seed: int = 0, steps_per_subtask: int = 2, output_words: int = 40
) -> list[Path]:
    out = []
    for i in range(1, n + 1):
        b = EpisodeBuilder(seed=seed + i, episode_id=i, reward=round(random.Random(seed + i).random(), 4))
        out.append(
            b.standard(steps_per_subtask=steps_per_subtask, output_words=output_words).write(root / f"episode_{i:03d}")
        )
    return out


def write_bad_episodes(root: Path) -> dict[str, Path]:
    """One directory per bad case (see the ingest issue); returns name → path."""
    cases: dict[str, Path] = {}

    def std(name: str, **kw: Any) -> EpisodeBuilder:
        b = EpisodeBuilder(seed=zlib.crc32(name.encode()) % 1000, **kw).standard()
        cases[name] = b.write(root / f"episode_{name}")
        return b

    b = std("malformed_line")
    lines = b.session_text().splitlines(keepends=True)
    lines[4] = lines[4][: len(lines[4]) // 2] + "\n"
    (cases["malformed_line"] / "pi_session.jsonl").write_text("".join(lines))

    b = std("truncated_last")
    text = b.session_text()
    (cases["truncated_last"] / "pi_session.jsonl").write_text(text[:-40])

    std("missing_result")
    (cases["missing_result"] / "result.json").unlink()

    std("missing_session")
    (cases["missing_session"] / "pi_session.jsonl").unlink()

    std("null_reward", reward=None)
    std("null_plan_score", plan_score=None)

    b = std("non_utf8")
    data = b.session_text().encode()
    i = data.index(b"ls ")
    (cases["non_utf8"] / "pi_session.jsonl").write_bytes(data[:i] + b"\xff\xfe" + data[i:])

    std("empty_session")
    (cases["empty_session"] / "pi_session.jsonl").write_text("")

    b = EpisodeBuilder(seed=7).standard()
    b.raw_message("bashExecution", command="ls", output="x", exitCode=0)
    b.raw_message("custom", customType="note", content="hidden", display=False)
    cases["unknown_roles"] = b.write(root / "episode_unknown_roles")
    return cases


def write_examples(root: Path) -> list[Path]:
    """The project's example episodes: four runs of the PostgreSQL task, varied plans and outcomes."""
    specs = [
        dict(seed=11, plan_ids=("S1", "S2", "S3"), reward=0.6997, plan_score=0.6571),
        dict(seed=12, plan_ids=("S1", "S2", "S3", "S4"), reward=0.4858, plan_score=0.7985),
        dict(seed=13, plan_ids=("S1", "S2"), reward=0.5218, plan_score=0.319),
        dict(seed=14, plan_ids=("S1", "S2", "S3"), reward=0.7533, plan_score=0.8987, version=2),
    ]
    out = []
    for i, spec in enumerate(specs, start=1):
        b = EpisodeBuilder(episode_id=i, **spec)  # type: ignore[arg-type]
        out.append(b.standard(steps_per_subtask=2 + i % 2, output_words=60).write(root / f"episode_{i:03d}"))
    return out
