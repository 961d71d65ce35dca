"""Every script in bench/ still runs: each one's --help (imports included), and the cheap ones
end to end at a small size with their own numeric cross-checks. No timing is asserted."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import BENCH, bench_module
from _forked_runs import Forks
from _shared import SHARED

SCRIPTS = sorted(BENCH.glob("*.py"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    """Every script's ``--help`` (exit code, stdout, stderr): one process pays torch's and
    transformers' imports once and forks a child per script that runs it as ``python SCRIPT --help``
    would (tests/_forked_runs.py), instead of a fresh interpreter per script."""
    r = _run(str(Path(__file__).with_name("_forked_runs.py")), *map(str, SCRIPTS))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_bench_script_starts(script: Path, helps: dict[str, list]) -> None:
    code, stdout, stderr = helps[str(script)]
    assert code == 0, stderr
    assert "usage" in stdout.lower()


def test_credits_bench_small(tmp_path: Path, forks: Forks) -> None:
    r = forks.run(
        str(BENCH / "credits.py"), "--episodes", "20", "--steps", "12", "--db", str(tmp_path / "c.db"), "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout[r.stdout.index("{") :])
    assert out["steps"] == 240 and out["max_abs_diff_vs_reference"] < 1e-9


def test_diagnose_bench_small(tmp_path: Path, forks: Forks) -> None:
    r = forks.run(str(BENCH / "diagnose.py"), "--episodes", "20", "--steps", "12", "--db", str(tmp_path / "d.db"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout[r.stdout.index("{") :])
    assert out["steps"] == 240 and out["abs_diff_std_vs_numpy"] < 1e-12


def test_http_client_bench_small(forks: Forks) -> None:
    """Every transport answers every request with its logprobs (the script checks each answer)."""
    r = forks.run(
        str(BENCH / "http_client.py"),
        *("--requests", "24", "--rounds", "2", "--concurrency", "4", "--ids", "100", "300", "--json"),
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout[r.stdout.index("{") :])
    assert {row["transport"] for row in out["rows"]} == {"auto", "anyio", "httpx"} and len(out["rows"]) == 6
    assert all(row["cpu_ms_per_request"] > 0 for row in out["rows"])


@pytest.mark.slow
def test_group_alignment_bench_small(tmp_path: Path) -> None:
    """Both sides run in their own processes on the tree named (here this one, as both)."""
    if not (SHARED / "tokenizers" / "qwen3").is_dir():
        pytest.skip(f"{SHARED / 'tokenizers' / 'qwen3'} is not here (../shared absent)")
    out = tmp_path / "g.json"
    args = ["--groups", "1", "--rows", "2", "--steps-per-subtask", "1", "--rounds", "1", "--json", str(out)]
    episode = SHARED / "samples" / "trajectories" / "episode_001"
    args += ["--episodes", str(episode)] if episode.is_dir() else []
    r = _run(str(BENCH / "group_alignment.py"), *args, "--before", str(BENCH.parent))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert set(doc["sides"]) == {"after", "before"}
    assert set(doc["after_over_before"]) == {"first_row", "other_rows", "episodes"}
    for side in doc["sides"].values():
        assert side["hcapo_store"] == str(BENCH.parent / "hcapo_store")
        run = side["runs"][0]
        assert len(run["first_row_ms"]) == 1 and len(run["other_rows_ms"]) == 1 and run["first_row_ms"][0] > 0
        for ep in run["episodes"]:
            assert ep["steps"] > 0 and ep["placed"][0] == ep["steps"] and ep["ms"] > 0
        assert len(run["episodes"]) == episode.is_dir()


def test_step_prompts_bench_small(tmp_path: Path) -> None:
    """Both sides in their own processes on the tree named; the steps are edited, none falls back."""
    episode = SHARED / "samples" / "trajectories" / "episode_001"
    if not (SHARED / "tokenizers" / "qwen3").is_dir() or not episode.is_dir():
        pytest.skip(f"{SHARED} is not here (../shared absent)")
    out = tmp_path / "s.json"
    args = ["--episodes", str(episode), "--passes", "1", "--rounds", "1", "--max-context", "4096", "--json", str(out)]
    r = _run(str(BENCH / "step_prompts.py"), *args, "--before", str(BENCH.parent))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert set(doc["sides"]) == {"after", "before"}
    assert set(doc["after_over_before"]) == {"checked", "unchecked", "packing"}
    for side in doc["sides"].values():
        assert side["hcapo_store"] == str(BENCH.parent / "hcapo_store")
        assert side["checked_ms_per_step_median"] > 0 and side["unchecked_ms_per_step_median"] > 0
        assert side["packing_ms_per_step_median"] > 0 and side["ids_packed_per_step"] > 0
        assert side["edited_steps_first_pass"] > 0 and side["fallbacks"] == [{}]


def test_tokenizer_load_bench_small(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    """One round on this tree: the spawned worker starts without torch, every field measured."""
    out = tmp_path / "t.json"
    r = _run(
        str(BENCH / "tokenizer_load.py"),
        "--tokenizer",
        str(demo_tokenizer_dir),
        "--rounds",
        "1",
        "--json-out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    (run,) = json.loads(out.read_text())["runs"]["after"]
    assert run["torch"] is False
    for field in ("cpu_s", "rss_mb", "wall_s", "forkserver_imports_cpu_s"):
        assert run[field] > 0, field


@pytest.mark.slow
def test_follow_bench_small(forks: Forks) -> None:
    samples = SHARED / "samples" / "long"
    if not samples.is_dir():
        pytest.skip(f"{samples} is not here (../shared absent)")
    # the episode layout: the script's every part runs, at a sixth of the per-step layout's time
    r = forks.run(
        str(BENCH / "follow.py"),
        *("--groups", "1", "--group-size", "1", "--prompt-layout", "episode", "--samples", str(samples), "--json"),
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout[r.stdout.index("{") :])
    assert out["batches"] == 1 and out["steps"] > 0 and out["lag_p50_s"] > 0 and out["by_hand_first_group_s"] > 0


def test_long_episode_bench_small(demo_tokenizer_dir: Path, forks: Forks) -> None:
    args = ["--tokenizer", str(demo_tokenizer_dir), "--steps", "40", "120", "--max-context", "2048", "--json"]
    r = forks.run(str(BENCH / "long_episode.py"), *args)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout[r.stdout.index("{") :])["rows"]
    assert [row["steps"] > 0 for row in rows] == [True, True]
    for row in rows:  # every step scored by each; the episode layout near the floor
        assert row["episode"]["scored_steps"] == row["per-step"]["scored_steps"] == row["steps"]
        assert row["turns"]["scored_steps"] == row["steps"]
        assert row["episode"]["xfloor"] <= 2.5 < row["per-step"]["xfloor"]
    # the longer session passes 1.6 x the context: its per-step prompts come from bounded renders
    assert rows[-1]["per-step"]["bounded_steps"] > 0 and not rows[-1]["per-step"]["whole_history_episodes"]


@pytest.mark.skipif(not (SHARED / "samples" / "long").is_dir(), reason="needs ../shared/samples/long")
def test_prep_bench_ours_only_small(demo_tokenizer_dir: Path, forks: Forks) -> None:
    """The form used to pair two checkouts: only our per-step build, timed and reported."""
    r = forks.run(
        str(BENCH / "prep.py"),
        "--tokenizer",
        str(demo_tokenizer_dir),
        "--episodes",
        "1",
        "--repeat",
        "2",
        "--ours-only",
    )
    assert r.returncode == 0, r.stderr
    rounds = [line for line in r.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("ours_deployed" in line and "original" not in line for line in rounds)
    assert "ours_deployed: min " in r.stdout and "speed-up" not in r.stdout


def test_gpu_bench_tiny(demo_tokenizer_dir: Path, tmp_path: Path, forks: Forks) -> None:
    """bench/gpu.py's every part on the CPU (--size tiny): the floor, both layouts end to end,
    the forwards' busy share and the bf16 / fp32 drift, in the JSON the GPU run writes."""
    out = tmp_path / "gpu.json"
    r = forks.run(str(BENCH / "gpu.py"), "--size", "tiny", "--tokenizer", str(demo_tokenizer_dir), "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["size"] == "tiny" and doc["episodes"]["count"] == 2 and doc["episodes"]["steps_each"] > 10
    (shape,) = doc["shapes"]
    assert "error" not in shape, shape.get("traceback")
    assert json.loads(r.stdout.splitlines()[0])["shape"] == "tiny"  # one JSON line per shape, as it ends
    assert set(shape["floor"]) == {"128", "256", "512"}
    assert shape["floor_after"]["tokens"] == 256 and shape["floor_after"]["over_before"] > 0
    for point in shape["floor"].values():
        assert point["tokens_per_s"] > 0 and point["score_spans_over_floor"] > 0
    runs = {"episode/c2", "per-step/c2"}  # tiny: concurrency 2 only, prepared both ways, graphs on and off
    ways = {f"{p}/{g}" for p in ("processes", "threads") for g in ("graphs", "eager")}
    assert set(shape["paths"]) == {f"{run}/{way}" for run in runs for way in ways}
    assert set(shape["prepare_compare"]) == {f"{run}/{g}" for run in runs for g in ("graphs", "eager")}
    assert set(shape["graphs_compare"]) == {f"{run}/{p}" for run in runs for p in ("processes", "threads")}
    assert set(shape["graph_warm"]) == {"episode/c2", "per-step/c2"}  # capture passes per layout and concurrency
    # the CPU captures nothing (CUDA graphs need a GPU): nothing replayed, nothing turned off
    assert all(row["graphs"] == {"off": None, "fallbacks": {}} for row in shape["paths"].values())
    for key, row in shape["paths"].items():
        assert row["failed"] == 0 and row["steps"] == row["episodes"] * doc["episodes"]["steps_each"], key
        assert row["conversation_tokens"] > 0 and row["forwards"] >= 1  # short episodes may share one
        assert 0 < row["share_of_floor"] and 0 < row["gpu_busy_share"] <= 1 and row["gpu_idle_ms_per_step"] >= 0
        assert row["forward_kinds"] == {"eager": row["forwards"]} and "replay_over_floor" not in row, key  # no graphs
        ratio = row["busy_s"] / row["floor_s"]  # the forwards' time over the body's, both rounded
        assert row["busy_over_floor"] > 0 and row["busy_over_floor"] == pytest.approx(ratio, rel=0.1), key
    episode, per_step = shape["paths"]["episode/c2/threads/eager"], shape["paths"]["per-step/c2/threads/eager"]
    # the per-step layout forwards each step's history again
    assert per_step["sent_tokens"] / per_step["episodes"] > 2 * episode["sent_tokens"] / episode["episodes"]
    drift = shape["drift"]
    assert drift["scored"] > 0 and 0 < drift["mean_abs_nats"] <= drift["max_abs_nats"] < 0.5
    again = _run(str(BENCH / "gpu.py"), "--summary", str(out))  # the saved run read back, no torch needed
    assert again.returncode == 0, again.stderr
    assert "tiny: floor" in again.stdout and all(key in again.stdout for key in shape["paths"])


def _gpu_all_commands() -> list[list[str]]:
    """Each ``python3 bench/*.py ...`` command of bench/gpu_all.sh, its lines joined and its shell
    values (``$out``, ``$((...))``) put in as words."""
    text = re.sub(r"\\\n\s*", " ", (BENCH / "gpu_all.sh").read_text())
    text = re.sub(r"\$\(\([^)]*\)\)", "100", text).replace('"$out', '"/tmp/out')
    commands = []
    for line in text.splitlines():
        words = (
            shlex.split(line.split("2>&1")[0]) if "python3 bench/" in line and not line.lstrip().startswith("#") else []
        )
        if words:
            commands.append(words[words.index("python3") + 1 :])
    return commands


def test_gpu_all_commands_parse(demo_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bench command bench/gpu_all.sh runs on the lent GPU parses with its script's own
    arguments: an option misspelt there would cost a GPU session's one call."""
    from hcapo_store.rendering import verify

    commands = _gpu_all_commands()
    assert [c[0] for c in commands] == ["bench/gpu.py", "bench/gpu.py", "bench/gpu_trl.py"]
    parsed = []
    for script, *args in commands:
        module = bench_module(Path(script).stem)
        monkeypatch.setattr(sys, "argv", [script, *args, "--tokenizer", str(demo_tokenizer_dir)])
        parsed.append(module.parse_args())
        assert parsed[-1].tokenizer == str(demo_tokenizer_dir)
    big, small, _ = parsed
    assert big.shapes == ["8b"] and set(small.shapes) == {"0.6b", "1.7b"}
    # the 8B's windows: ~2 episodes a packed forward, and still a whole check period of replays
    assert big.run_episodes >= 2 * verify.CUDA_GRAPHS.every and big.episodes >= big.run_episodes


def test_gpu_path_row_reads_a_graphed_window() -> None:
    """bench/gpu.py's row of a graphed run (the CPU never replays one): the replays' time over the
    body's, and the checks the policy's rate gives the window's replays, beside the ones it held."""
    from hcapo_store.rendering import verify

    gpu = bench_module("gpu")
    floor = {"1000": {"seconds": 0.1}, "4000": {"seconds": 0.4}}  # linear: 1e-4 s a token
    every = verify.CUDA_GRAPHS.every
    run = {
        "wall_s": 4 * every * 0.1, "steps": 10, "conversation_tokens": 1, "sent_tokens": 1, "busy_s": every * 0.15,
        "sequence_tokens": [1000] * (2 * every), "replay_sequence_tokens": [2000] * (every - 1),
        "replay_s": (every - 1) * 0.21, "forward_kinds": {"replay": every - 1, "check": 1, "eager": 3},
    }  # fmt: skip
    row = gpu.path_row(run, floor)
    assert row["checks_at_policy_rate"] == 1.0 and row["forward_kinds"]["check"] == 1
    assert row["replay_over_floor"] == pytest.approx(1.05, abs=0.002)
    assert row["share_of_floor"] == pytest.approx(0.5, abs=0.002)
    assert "sequence_tokens" not in row and "replay_s" not in row
    eager = gpu.path_row({**run, "forward_kinds": {"eager": 2 * every}, "replay_sequence_tokens": []}, floor)
    assert "checks_at_policy_rate" not in eager and "replay_over_floor" not in eager
    # the summary line a GPU call prints (and `gpu.py --summary FILE` prints again) names them
    row["graphs"] = {"borrowed": 7}
    doc = {"shapes": [{"shape": "8b", "floor": {"2048": {"tokens_per_s": 1}}, "paths": {"episode/c4": row}}]}
    (line,) = gpu.summary(doc)
    assert "replays x1.05" in line and "'check': 1" in line and "policy's rate: 1.0" in line and "borrowed 7" in line


def test_gpu_gaps_bench_tiny(demo_tokenizer_dir: Path, tmp_path: Path, forks: Forks) -> None:
    """bench/gpu_gaps.py's every measurement on the CPU (--size tiny; the profiler's CPU ops stand in
    for kernels): the forward alone and the body, the LM-head chunks, the runs at two switch
    intervals, the profiled forward inside a run, in the JSON the GPU run writes."""
    out = tmp_path / "gaps.json"
    r = forks.run(
        str(BENCH / "gpu_gaps.py"), "--size", "tiny", "--tokenizer", str(demo_tokenizer_dir), "--out", str(out)
    )
    assert r.returncode == 0, r.stderr
    assert "] tiny: in_run: " in r.stderr  # a progress line per measurement
    doc = json.loads(out.read_text())
    (shape,) = doc["shapes"]
    assert "error" not in shape, shape.get("traceback")
    for key in ("floor", "alone", "head", "in_run"):
        assert "error" not in shape[key] and "skipped" not in shape[key], (key, shape[key])
    alone = shape["alone"]
    for part in ("score_spans", "body", "packed2"):
        profiled = alone[part]["profiled"]
        assert (
            alone[part]["event_ms"] > 0 and profiled["kernels"] > 0 and 0 < profiled["busy_ms"] <= profiled["span_ms"]
        )
        assert sum(n for n, _ in profiled["gaps"].values()) <= profiled["kernels"] - 1
    head = shape["head"]
    chunks = [v for v in head.values() if isinstance(v, dict)]
    assert head["rows"] > 0 and len(chunks) >= 2 and all(c["max_abs_diff_vs_one_chunk"] < 1e-4 for c in chunks)
    assert set(shape["switch"]) == {"c4/default", "c4/switch"}
    assert (
        shape["switch"]["c4/switch"]["switch_interval_s"] == 1e-4 != shape["switch"]["c4/default"]["switch_interval_s"]
    )
    for key, row in [*shape["switch"].items(), ("in_run", shape["in_run"])]:
        assert row["failed"] == 0 and row["steps"] > 0 and 0 < row["share_of_floor"], key
        forwards = row["forwards_detail"]
        assert len(forwards) == row["forwards"] and all(f["event_ms"] > 0 and f["off_cpu_ms"] >= -1 for f in forwards)
    profiled = [f for f in shape["in_run"]["forwards_detail"] if "profile" in f]
    assert len(profiled) == 1 and profiled[0]["profile"]["kernels"] > 0 and "gap_share" in profiled[0]
    assert {"launches", "launch_span_ms", "launch_gaps_gt_500us", "gaps", "runtime"} <= set(profiled[0]["profile"])
    assert doc["summary"] and r.stdout.startswith("tiny (L=")
