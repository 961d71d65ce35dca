"""Client-side preparation benchmark: the original `_build_prompt_pair` loop vs PromptBuilder.

    python bench/prep.py --tokenizer ../shared/tokenizers/qwen3 --episodes 2 --repeat 3 [--grouped] [--episode-layout]

Inputs (``--input``): ``real`` (default) copies of the long real-format samples
(bench/ingest.py; ~100 steps, ~90k tokens each), ingested into a temporary store and loaded
back from it, as ``score`` does; ``synthetic`` the older generated episodes. Times per step
(a) a faithful re-implementation of the original scorer's preparation
(`map_steps_to_subtasks` walk, `build_hindsight_info`, `_build_prompt_pair` with its
render/encode of prefix and full text and its decode/re-encode truncation) on the
original's inputs (its loader never kept thinking, docs/ORIGINAL.md Q2), and
(b) `PromptBuilder.build_episode` as deployed (thinking kept, plan from the store) and on
the original's inputs, in the same process, after one unmeasured warm-up of each, in
alternating order, ``--repeat`` times. Checks that the original and ours produce the same
token ids and span on the same inputs wherever the original is correct (no truncation,
aligned prefix). ``--grouped`` also times the requests as the scheduler plans them (prompts,
request grouping and the episode's floor, ``scoring.grouping``) where this branch has it,
and says so where it does not.
``--episode-layout`` also times the requests of ``--prompt-layout episode`` (the conversation
rendered once per episode, its steps placed in it: other prompts than the original's, so no
identity check; what preparation costs when each context is rendered once).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hcapo_store.rendering.prompts import HINDSIGHT_TEMPLATE, PromptBuilder
from hcapo_store.rendering.requests import PromptFailure, StepPrompt
from hcapo_store.rendering.tokenizers import load_tokenizer

# --------------------------------------------------------------------------- synthetic data

_WORDS = (
    "the of and to in is for on that with as this by def return import class self value data "
    "file path error test run build step table index query row column commit select from where "
    "postgres backend buffer page tuple lock latch wal checkpoint vacuum"
).split()


def _prose(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _code(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        name = rng.choice(_WORDS)
        out.append(
            f"{'    ' * rng.randint(0, 3)}{name}_{i} = {rng.choice(_WORDS)}({rng.randint(0, 999)}, '{_prose(rng, 3)}')"
        )
    return "\n".join(out)


def _tool_result(rng: random.Random) -> str:
    body = (
        _code(rng, rng.randint(20, 70))
        if rng.random() < 0.7
        else json.dumps({"status": "ok", "rows": [[_prose(rng, 3), rng.randint(0, 10**6)] for _ in range(40)]})
    )
    if len(body) > 4000:  # the loader's max_tool_result_chars
        body = body[:4000] + f"\n... [truncated, {len(body)} chars total]"
    return body


def synthetic_episode(seed: int, steps: int = 100) -> dict[str, Any]:
    """A Pi-style agent episode: one task message, then assistant tool calls and results."""
    rng = random.Random(seed)
    plan = [{"id": f"S{i}"} for i in range(1, 5)]
    messages: list[dict] = [{"role": "user", "content": "You are working on the postgres task.\n" + _prose(rng, 400)}]
    for t in range(steps):
        thinking = f"<think>\n{_prose(rng, rng.randint(20, 80))}\n</think>\n\n"
        if t == 10:
            name, args = "mcp", {"tool": "openenv_submit_plan", "args": json.dumps({"subtasks": plan})}
        elif t in (40, 70):
            name, args = "mcp", {"tool": "openenv_advance", "args": "{}"}
        else:
            name, args = "bash", {"command": _prose(rng, rng.randint(3, 20))}
        calls = [
            {
                "id": f"call_{t}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
        ]
        if rng.random() < 0.15:  # parallel calls
            calls.append(
                {
                    "id": f"call_{t}b",
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": _prose(rng, 5)})},
                }
            )
        messages.append(
            {"role": "assistant", "content": thinking + _prose(rng, rng.randint(0, 40)), "tool_calls": calls}
        )
        for call in calls:
            if call["function"]["name"] == "mcp":
                content = json.dumps({"ok": True, "next_subtask_id": "S2" if t == 40 else "S3"})
            else:
                content = _tool_result(rng)
            messages.append(
                {"role": "tool", "name": call["function"]["name"], "tool_call_id": call["id"], "content": content}
            )
    return {
        "episode_id": seed,
        "messages": messages,
        "reward": 0.4795,
        "phase": "executing",
        "plan_score": 0.72,
        "plan": plan,
        "frozen_scores": {"S1": 0.5845, "S2": 0.412, "S3": 0.0, "S4": 0.0},
    }


# --------------------------------------------------------------------------- the original procedure
# Re-implemented from compute_hindsight_scores.py @ f8e68b68 (docs/ORIGINAL.md §2).

# The template text is the original's verbatim (tests/test_prompts.py pins the literal).
ORIGINAL_TEMPLATE = HINDSIGHT_TEMPLATE


def _orig_unwrap_arguments(arguments: Any) -> str:
    if isinstance(arguments, dict):
        inner = arguments.get("arguments")
        if inner is not None:
            return inner if isinstance(inner, str) else json.dumps(inner, ensure_ascii=False)
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False) if arguments is not None else "{}"


def _orig_normalize(msg: dict) -> dict:
    msg = dict(msg)
    if msg.get("tool_calls"):
        calls = []
        for tc in msg["tool_calls"]:
            tc = dict(tc)
            fn = dict(tc.get("function", {}))
            fn["arguments"] = _orig_unwrap_arguments(fn.get("arguments"))
            tc["function"] = fn
            calls.append(tc)
        msg["tool_calls"] = calls
    return msg


def _orig_flatten(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"[Tool Result: {m.get('name', 'tool')}]\n{m.get('content', '')}"}
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            for tc in m.get("tool_calls", []):
                fn = tc.get("function", {})
                parts.append(f"[Tool Call: {fn.get('name', '?')}]\n{fn.get('arguments', '{}')}")
            m = {"role": "assistant", "content": "\n".join(parts)}
        out.append(m)
    return out


def _orig_safe_apply(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception:
        return tokenizer.apply_chat_template(
            _orig_flatten(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )


def _orig_effective_names(msg: dict) -> list[str]:
    names = []
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function", {})
        name = fn.get("name", "")
        if name == "mcp":
            raw = fn.get("arguments", {})
            inner_str = raw.get("arguments", "") if isinstance(raw, dict) else raw
            try:
                inner = json.loads(inner_str) if isinstance(inner_str, str) else inner_str
            except (json.JSONDecodeError, TypeError):
                inner = {}
            inner_name = inner.get("tool", "") if isinstance(inner, dict) else ""
            names.append(inner_name or name)
        else:
            names.append(name)
    return names


def _orig_success(content: str) -> bool:
    c = content.strip()
    if not c or c.startswith(("[tool_error]", "Failed to call tool", "Error:")) or not c.startswith("{"):
        return False
    try:
        return "error" not in json.loads(c)
    except (json.JSONDecodeError, TypeError):
        return False


def orig_map_steps(messages: list[dict], episode: dict) -> list[dict]:
    plan = episode.get("plan") or []
    ids = [s["id"] for s in plan]
    frozen = episode.get("frozen_scores", {})
    phase, idx, pending = "planning", -1, None
    info = []
    for msg in messages:
        if msg["role"] == "tool" and pending is not None:
            content = msg.get("content", "") or ""
            if _orig_success(content):
                if pending == "submit_plan":
                    phase, idx = "executing", 0
                else:
                    nxt = json.loads(content).get("next_subtask_id", "")
                    idx = ids.index(nxt) if nxt in ids else min(idx + 1, max(len(ids) - 1, 0))
            pending = None
        if msg["role"] != "assistant":
            continue
        if phase == "planning":
            info.append({"phase": "planning", "subtask_id": None, "subtask_reward": episode.get("plan_score", 0)})
        else:
            sid = ids[idx] if 0 <= idx < len(ids) else None
            info.append(
                {"phase": "executing", "subtask_id": sid, "subtask_reward": frozen.get(sid, 0.0) if sid else 0.0}
            )
        for name in _orig_effective_names(msg):
            canonical = name.replace("openenv_", "")
            if canonical in ("submit_plan", "advance"):
                pending = canonical
    return info


def orig_hindsight(episode: dict, current_subtask: str, current_subtask_score: float) -> str:
    frozen = episode.get("frozen_scores", {})
    plan = episode.get("plan") or frozen
    return ORIGINAL_TEMPLATE.format(
        reward=episode["reward"],
        phase=episode.get("phase", "?"),
        plan_score=episode.get("plan_score", 0),
        scores_summary=", ".join(f"{k}={v:.3f}" for k, v in frozen.items()) or "none",
        scored_count=len(frozen),
        plan_count=max(len(plan), 1),
        current_subtask=current_subtask,
        current_subtask_score=f"{current_subtask_score:.3f}" if current_subtask_score >= 0 else "n/a",
    )


def orig_build_prompt_pair(
    tokenizer: Any, prefix: list[dict], action: dict, hindsight: str, max_context: int
) -> tuple[str, int, int] | None:
    hind_prefix = [_orig_normalize(m) for m in prefix]
    hind_prefix[0] = dict(hind_prefix[0], content=hind_prefix[0].get("content", "") + "\n\n" + hindsight)
    action_msg = _orig_normalize(action)
    full_text = _orig_safe_apply(tokenizer, hind_prefix + [action_msg], add_generation_prompt=False)
    prefix_text = _orig_safe_apply(tokenizer, hind_prefix, add_generation_prompt=True)
    prefix_ids = tokenizer.encode(prefix_text, add_special_tokens=False)
    full_ids = tokenizer.encode(full_text, add_special_tokens=False)
    prefix_len, action_len = len(prefix_ids), len(full_ids) - len(prefix_ids)
    if action_len <= 0:
        return None
    if len(full_ids) > max_context:
        action_ids = full_ids[prefix_len:]
        max_prefix = max_context - len(action_ids)
        if max_prefix <= 0:
            kept = action_ids[-max_context:]
            return tokenizer.decode(kept), 0, len(kept)
        anchor_ids = tokenizer.encode(
            _orig_safe_apply(tokenizer, hind_prefix[:1], add_generation_prompt=False), add_special_tokens=False
        )
        marker_ids = tokenizer.encode(
            "\n\n[... earlier trajectory context truncated; hindsight outcome preserved above ...]\n\n",
            add_special_tokens=False,
        )
        tail_budget = max_prefix - len(anchor_ids) - len(marker_ids)
        if tail_budget > 0:
            trimmed = anchor_ids + marker_ids + prefix_ids[-tail_budget:]
        else:
            trimmed = (anchor_ids[: max(max_prefix - len(marker_ids), 0)] + marker_ids)[:max_prefix]
        prefix_text = tokenizer.decode(trimmed)
        full_text = prefix_text + tokenizer.decode(action_ids)
        prefix_len = len(tokenizer.encode(prefix_text, add_special_tokens=False))
        action_len = len(tokenizer.encode(full_text, add_special_tokens=False)) - prefix_len
    return full_text, prefix_len, action_len


def run_original(tokenizer: Any, episode: dict, max_context: int, max_logprob_tokens: int) -> list[dict]:
    messages = episode["messages"]
    info = orig_map_steps(messages, episode)
    out = []
    for step, m in enumerate(i for i, msg in enumerate(messages) if msg["role"] == "assistant"):
        si = info[step]
        hindsight = orig_hindsight(episode, si["subtask_id"] or si["phase"], si["subtask_reward"])
        pair = orig_build_prompt_pair(tokenizer, messages[:m], messages[m], hindsight, max_context)
        if pair is None:
            out.append({"step": step, "info": si, "empty": True})
            continue
        full_text, prefix_len, action_len = pair
        scored = min(action_len, max_logprob_tokens) if max_logprob_tokens > 0 else action_len
        out.append(
            {
                "step": step,
                "message_index": m,
                "info": si,
                "full_text": full_text,
                "prefix_len": prefix_len,
                "action_len": action_len,
                "logprob_start_len": prefix_len + action_len - scored,
            }
        )
    return out


# --------------------------------------------------------------------------- comparison


def compare(tokenizer: Any, original: list[dict], ours: list[StepPrompt | PromptFailure]) -> dict[str, int]:
    counts = {
        "identical": 0,
        "different": 0,
        "truncated": 0,
        "ours_failed": 0,
        "prompt_tokens_original": 0,
        "prompt_tokens_ours": 0,
    }
    for orig, mine in zip(original, ours):
        if isinstance(mine, PromptFailure):
            counts["ours_failed"] += 1
            continue
        counts["prompt_tokens_ours"] += len(mine.input_ids)
        orig_ids = tokenizer.encode(orig["full_text"], add_special_tokens=False)
        counts["prompt_tokens_original"] += len(orig_ids)
        if mine.truncated_prefix_tokens:
            counts["truncated"] += 1
            continue
        same = (
            orig_ids == mine.input_ids
            and orig["logprob_start_len"] == mine.first_scored
            and orig["action_len"] == mine.total_action_tokens
        )
        counts["identical" if same else "different"] += 1
    return counts


# --------------------------------------------------------------------------- real-shaped inputs


def stored_episodes(root: Path, include_thinking: bool) -> list[tuple[dict[str, Any], list[Any]]]:
    """Ingest the episode directories under root; load them back as ``score`` does.

    Returns per episode the original's episode dict (messages + outcome) and our steps."""
    from sqlalchemy import text

    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.storage.episodes import load_episode
    from hcapo_store.storage.store import Store

    db = root.parent / f"prep-{'thinking' if include_thinking else 'original'}.db"
    store = Store.open(str(db))
    ingest(store, [root], options=ConvertOptions(include_thinking=include_thinking))
    out = []
    with store.engine.connect() as conn:
        for (episode_id,) in conn.execute(text("SELECT id FROM episodes WHERE is_current ORDER BY id")).all():
            ep = load_episode(conn, episode_id)
            o = ep.outcome
            episode = {
                "messages": ep.messages,
                "reward": o.reward,
                "phase": o.phase or "?",
                "plan_score": o.plan_score or 0,
                "plan": o.plan,
                "frozen_scores": o.frozen_scores,
            }
            out.append((episode, list(ep.steps)))
    store.close()
    return out


def _grouping() -> Any:
    try:
        return importlib.import_module("hcapo_store.scoring.grouping")
    except ImportError:
        return None


def time_ours(
    builder: PromptBuilder, inputs: list[tuple[dict[str, Any], list[Any]]], grouped: bool = False
) -> tuple[float, list[list[Any]]]:
    """ms per step of build_episode (``grouped``: the requests as the scheduler plans them,
    prompts, grouping and the episode's floor), and the prompts (or requests) built."""
    grouping = _grouping() if grouped else None
    planned = getattr(grouping, "plan_requests_and_floor", None)
    built, steps, start = [], 0, time.perf_counter()
    for episode, ep_steps in inputs:
        if planned is not None:
            built.append(planned(builder, episode["messages"], episode, ep_steps, ep_steps)[0])
        else:
            prompts = builder.build_episode(episode["messages"], episode, ep_steps)
            built.append(grouping.group_prompts(prompts, grouping="grouped") if grouping else prompts)
        steps += len(ep_steps)
    return (time.perf_counter() - start) * 1000 / steps, built


def time_episode_layout(
    builder: PromptBuilder, inputs: list[tuple[dict[str, Any], list[Any]]]
) -> tuple[float, list[list[Any]]]:
    """ms per step of the episode layout's requests (one rendering per episode) and its floor."""
    from hcapo_store.rendering.episode_layout import conversation_tokens
    from hcapo_store.scoring.grouping import plan_requests

    built, steps, start = [], 0, time.perf_counter()
    for episode, ep_steps in inputs:
        built.append(plan_requests(builder, episode["messages"], episode, ep_steps))
        conversation_tokens(builder, episode["messages"], episode, ep_steps)
        steps += len(ep_steps)
    return (time.perf_counter() - start) * 1000 / steps, built


def time_original(
    tokenizer: Any, inputs: list[tuple[dict[str, Any], list[Any]]], max_context: int, max_logprob_tokens: int
) -> tuple[float, list[list[dict]]]:
    built, steps, start = [], 0, time.perf_counter()
    for episode, _ in inputs:
        built.append(run_original(tokenizer, episode, max_context, max_logprob_tokens))
        steps += len(built[-1])
    return (time.perf_counter() - start) * 1000 / steps, built


def _mmm(values: list[float], unit: str = "") -> str:
    return f"min {unit}{min(values):.2f} / median {unit}{statistics.median(values):.2f} / max {unit}{max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (e.g. Qwen3)")
    parser.add_argument("--input", choices=("real", "synthetic"), default="real")
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="synthetic episodes only")
    parser.add_argument("--repeat", type=int, default=3, help="paired rounds (alternating order)")
    parser.add_argument(
        "--grouped", action="store_true", help="also time the requests as planned (prompts, grouping, floor)"
    )
    parser.add_argument(
        "--episode-layout", action="store_true", help="also time --prompt-layout episode (one rendering per episode)"
    )
    parser.add_argument(
        "--ours-only",
        action="store_true",
        help="time only our per-step build as deployed (to pair two checkouts: run this in each, alternating)",
    )
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--max-logprob-tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.input == "synthetic":
        return main_synthetic(args)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ingest import write_real_episodes

    tokenizer = load_tokenizer(args.tokenizer)
    tmp = Path(tempfile.mkdtemp(prefix="hcapo-bench-prep-"))
    try:
        write_real_episodes(tmp / "episodes", args.episodes)
        deployed = stored_episodes(tmp / "episodes", include_thinking=True)
        original_inputs = stored_episodes(tmp / "episodes", include_thinking=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    builder = PromptBuilder(tokenizer, max_context=args.max_context, max_logprob_tokens=args.max_logprob_tokens)
    print(f"fast path: {builder.encoder.fast_path_off_reason or 'on'}")
    for name, inputs in (("deployed (thinking kept)", deployed), ("original's inputs", original_inputs)):
        sizes = [
            len(
                tokenizer.encode(tokenizer.apply_chat_template(e["messages"], tokenize=False), add_special_tokens=False)
            )
            for e, _ in inputs
        ]
        print(f"{name}: {len(inputs)} episodes, steps {[len(s) for _, s in inputs]}, tokens {sizes}")

    cases = {
        "original": lambda: time_original(tokenizer, original_inputs, args.max_context, args.max_logprob_tokens),
        "ours_deployed": lambda: time_ours(builder, deployed),
        "ours_original_inputs": lambda: time_ours(builder, original_inputs),
    }
    if args.ours_only:
        cases = {"ours_deployed": cases["ours_deployed"]}
    if args.grouped:
        if _grouping() is None:
            print("--grouped: skipped, this branch has no hcapo_store.scoring.grouping")
        else:
            cases["ours_deployed_grouped"] = lambda: time_ours(builder, deployed, grouped=True)
    if args.episode_layout:
        layout = PromptBuilder(
            tokenizer, max_context=args.max_context, max_logprob_tokens=args.max_logprob_tokens, layout="episode"
        )
        cases["ours_deployed_episode_layout"] = lambda: time_episode_layout(layout, deployed)
    results = {name: case() for name, case in cases.items()}  # warm-up (template compile, caches)
    if "original" in results:
        _report_identity(tokenizer, results["original"][1], results["ours_original_inputs"][1])
    if "ours_deployed_grouped" in results:
        groups = [g for ep in results["ours_deployed_grouped"][1] for g in ep]
        steps = sum(len(s) for _, s in deployed)
        print(f"grouped: {len(groups)} requests for {steps} steps")
    ms: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.repeat):
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for name in order:
            ms[name].append(cases[name]()[0])
        print(
            f"round {rep + 1} ({' → '.join(order)}): " + ", ".join(f"{n} {ms[n][-1]:.2f}" for n in cases) + " ms/step"
        )
    for name, values in ms.items():
        print(f"{name}: {_mmm(values)} ms/step")
    for name in cases:
        if name != "original" and "original" in ms:
            ratios = [o / m for o, m in zip(ms["original"], ms[name])]
            print(f"speed-up original / {name} (paired): {_mmm(ratios, '×')}")
    if "original" in ms:
        print("budget (BENCHMARKS.md budgets): >= 20x per step vs the original, same token ids")


def _report_identity(tokenizer: Any, originals: list[list[dict]], ours: list[list[Any]]) -> None:
    for i, (orig, mine) in enumerate(zip(originals, ours)):
        by_index = {p.step_index: p for p in mine}
        if len(orig) != len(mine):
            print(f"episode {i}: original {len(orig)} steps, ours {len(mine)}")
        aligned = [by_index[o["step"]] for o in orig if o["step"] in by_index]
        print(f"episode {i}: {compare(tokenizer, orig, aligned)}")


def main_synthetic(args: argparse.Namespace) -> None:
    """The older single-pass synthetic run (both on the same generated messages)."""
    tokenizer = load_tokenizer(args.tokenizer)
    episodes = [synthetic_episode(seed, args.steps) for seed in range(args.episodes)]
    # The original runs first (PromptBuilder renders in its own sandbox: the original's
    # apply_chat_template renders are not sped up either way).
    originals, orig_ms = [], []
    for episode in episodes:
        start = time.perf_counter()
        originals.append(run_original(tokenizer, episode, args.max_context, args.max_logprob_tokens))
        orig_ms.append((time.perf_counter() - start) * 1000 / len(originals[-1]))
    builder = PromptBuilder(tokenizer, max_context=args.max_context, max_logprob_tokens=args.max_logprob_tokens)
    print(f"fast path: {builder.encoder.fast_path_off_reason or 'on'}")
    ours_ms = []
    for seed, (episode, original) in enumerate(zip(episodes, originals)):
        messages = episode["messages"]
        steps = [{"step_index": o["step"], "message_index": o["message_index"], **o["info"]} for o in original]
        start = time.perf_counter()
        ours = builder.build_episode(messages, episode, steps)
        ours_ms.append((time.perf_counter() - start) * 1000 / len(ours))
        counts = compare(tokenizer, original, ours)
        total = len(tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False))
        print(
            f"episode {seed}: {len(steps)} steps, {total} tokens, {len(messages)} messages | "
            f"original {orig_ms[seed]:.1f} ms/step, ours {ours_ms[-1]:.2f} ms/step, "
            f"x{orig_ms[seed] / ours_ms[-1]:.1f} | {counts}"
        )
    orig_mean, ours_mean = statistics.mean(orig_ms), statistics.mean(ours_ms)
    print(
        f"mean: original {orig_mean:.1f} ms/step, ours {ours_mean:.2f} ms/step, speed-up x{orig_mean / ours_mean:.1f}"
    )


if __name__ == "__main__":
    main()
