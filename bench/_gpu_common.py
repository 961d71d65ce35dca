"""What the GPU benchmarks share (bench/gpu.py, bench/gpu_gaps.py, bench/gpu_trl.py): their common
options, the tokenizer they find, their start-up (device, the JSON's head), the random-weight Qwen3
shapes they build, and writing the JSON. Imported by them; run alone it only says so (--help)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this tree's hcapo_store before any installed one

VOCAB = 151936  # Qwen3's embedding rows (the tokenizer's 151,669 rounded up)
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=6144, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, tie_word_embeddings=True),
}  # fmt: skip
TOKENIZER_ARCHIVE = ROOT / ".gpu" / "qwen3.tar.gz"  # bench/gpu_wheels.sh packs Qwen3's tokenizer here
SHARED_TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "qwen3"


def add_common_args(p: argparse.ArgumentParser, *, out: str, budget_s: float) -> None:
    """The options every GPU benchmark takes."""
    p.add_argument("--size", choices=["gpu", "tiny"], default="gpu", help="gpu: the Qwen3 shapes; tiny: CPU check")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir (default .gpu/qwen3, else .gpu/qwen3.tar.gz unpacked, else ../shared/...)",
    )
    p.add_argument("--out", default=None, help=f"JSON file (default $OUT/{out})")
    p.add_argument("--budget-s", type=float, default=budget_s, help="whole run, seconds (skips what would not fit)")
    p.add_argument("--steps-per-subtask", type=int, default=22, help="22: 99-step episodes, ~9.2k Qwen3 tokens")  # fmt: skip


def resolve_tokenizer(p: argparse.ArgumentParser, given: str | None) -> str:
    """``given``, else .gpu/qwen3, else .gpu/qwen3.tar.gz unpacked in a temporary folder, else
    ../shared/tokenizers/qwen3; none of them: the parser's error."""
    if given:
        return given
    unpacked = ROOT / ".gpu" / "qwen3"
    if unpacked.is_dir():
        return str(unpacked)
    if TOKENIZER_ARCHIVE.is_file():
        into = Path(tempfile.mkdtemp(prefix="hcapo-qwen3-"))
        with tarfile.open(TOKENIZER_ARCHIVE) as archive:
            archive.extractall(into, filter="data")
        return str(into / "qwen3")
    if SHARED_TOKENIZER.is_dir():
        return str(SHARED_TOKENIZER)
    p.error("no tokenizer: pass --tokenizer DIR (bench/gpu_wheels.sh packs Qwen3's into .gpu/qwen3.tar.gz)")
    raise AssertionError  # p.error exits


def start(args: argparse.Namespace, bench: str, out_name: str) -> tuple[Path, Any, dict[str, Any]]:
    """The run's JSON path (``--out``, else ``$OUT/out_name``), its device (the CPU with one
    thread for ``--size tiny``, else the GPU: none is an error) and the JSON's head."""
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / out_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    tiny = args.size == "tiny"
    device = torch.device("cpu" if tiny else "cuda")
    if tiny:  # one thread: the main thread and the model's thread alike, on a shared CPU
        torch.set_num_threads(1)
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run on a GPU machine, or --size tiny on the CPU")
    doc: dict[str, Any] = {
        "bench": bench,
        "size": args.size,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "budget_s": args.budget_s,
        "commit": commit(),
    }
    return out, device, doc


def commit() -> str | None:
    """This tree's commit, when it is a git checkout with git at hand (the GPU machine's copy may be neither)."""
    import subprocess

    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def save(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def elapsed_ms(timing: Any) -> float:
    """A ``ForwardTiming`` of LogprobModel.timings in milliseconds: CUDA events on a GPU (recorded
    by then: synchronise first), perf_counter() seconds on a CPU."""
    if isinstance(timing.started, float):
        return (timing.ended - timing.started) * 1000.0
    return float(timing.started.elapsed_time(timing.ended))


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def episode_prompt(work: Path, steps_per_subtask: int, tiny: bool) -> tuple[list[dict[str, Any]], int]:
    """A synthetic episode's messages up to its last assistant turn (what the agent saw when it
    wrote it), and the episode's step count. ``tiny``: one subtask of the synthetic plan's four (6
    steps, ~510 Qwen3 tokens): on the CPU, TRL's fused LM head scores every prompt position over
    the whole vocabulary, a run's main cost."""
    from hcapo_store.devkit.synth import EpisodeBuilder
    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.storage import db
    from hcapo_store.storage.episodes import load_episode
    from hcapo_store.storage.store import Store

    plan = {"plan_ids": ("S1",)} if tiny else {}
    path = EpisodeBuilder(seed=1, episode_id=1, reward=0.5, **plan).standard(steps_per_subtask=steps_per_subtask)
    path = path.write(work / "source" / "episode_001")
    with Store.open(str(work / "source.db")) as store:
        if ingest(store, [path], jobs=1).failed:
            raise SystemExit("the synthetic episode failed to ingest")
        with db.read(store.engine) as conn:
            (episode_id,) = [int(r[0]) for r in conn.exec_driver_sql("SELECT id FROM episodes")]
            episode = load_episode(conn, episode_id)
    messages = [dict(m) for m in episode.messages]
    last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    return messages[:last], len(episode.steps)


def build_model(shape: str, vocab: int, device: Any, **config: Any) -> Any:
    """A random-weight Qwen3 of ``shape`` in bf16 on ``device``: built on the meta device, its
    storage made there (``to_empty``), weights drawn N(0, 0.02), norms 1, rotary tables recomputed.
    ``config``: more Qwen3Config fields (e.g. the tokenizer's eos/pad ids)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, max_position_embeddings=40960, **SHAPES[shape], **config)
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        for module in list(model.modules()):
            if hasattr(module, "inv_freq"):  # rotary tables are buffers: to_empty left them unset
                fresh = type(module)(config)
                for buffer in ("inv_freq", "original_inv_freq"):
                    if hasattr(fresh, buffer):
                        setattr(module, buffer, getattr(fresh, buffer).to(device))
                if hasattr(fresh, "attention_scaling"):
                    module.attention_scaling = fresh.attention_scaling
    model.config.dtype = torch.bfloat16
    return model.eval()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    print("bench/_gpu_common.py is imported by bench/gpu.py, gpu_gaps.py and gpu_trl.py: run one of those")
