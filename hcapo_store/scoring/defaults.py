"""How a scorer and a scoring process run when nobody says otherwise: the one home of these
values. ``ScoreConfig`` and ``RunOptions`` take their field defaults from here, and so do the
``score``/``follow`` options (this module loads nothing, so ``--help`` stays fast)."""

from __future__ import annotations

from typing import Final

CONCURRENCY: Final = 4  # episodes in flight at once
MAX_ATTEMPTS: Final = 4  # attempts per step before it is marked failed
LEASE_SECONDS: Final = 120.0  # a claim without a heartbeat this long is free for other workers
MAX_NEW_TOKENS: Final = 0  # 1 for old SGLang servers that mishandle prefill-only requests
REQUEST_TIMEOUT_S: Final = 300.0  # one HTTP request, as a whole
GROUPING: Final = "grouped"  # steps whose prompts are exact prefixes of one another share a request
TRUNCATION: Final = "sliding"  # the original's tail per step
ACTION_SPAN: Final = "rendered"  # the original's: everything the template renders for the turn
PROMPT_LAYOUT: Final = "per-step"  # the original's: a prompt per step
# vLLM's --logprobs-mode (vLLM's own names; since vllm #47680 prompt_logprobs follow it). A scorer
# declares the mode its server runs (score/follow --logprobs-mode); only the log-probability modes
# can be stored (the logits modes are not log-probabilities); raw_logprobs, vLLM's default, is ours.
LOGPROBS_MODE: Final = "raw_logprobs"
LOGPROBS_MODES: Final = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
SCORABLE_LOGPROBS_MODES: Final = ("raw_logprobs", "processed_logprobs")

# The in-process model (score --backend transformers, serve-reference, score_live).
DTYPES: Final = ("bfloat16", "float16", "float32")  # --dtype; None: the checkpoint's own on a GPU, float32 on CPU
CPU_DTYPE: Final = "float32"  # what a CPU computes in when no --dtype is given
# A forward may hold several requests (right-padded to the longest) up to this many tokens in all,
# padding included, on a GPU: short sequences leave the chip idle, and each forward costs the host
# its kernel launches. The default prompt budget (rendering.prompts.DEFAULT_MAX_CONTEXT): a packed
# forward holds no more tokens than one request at the default --max-context. 0: one per forward.
PACK_TOKENS: Final = 32768
PACK_WASTE: Final = 0.25  # at most this share of a packed forward's tokens may be padding
# On a GPU, each forward shape (padded to a bucket) is captured once as a CUDA graph and replayed:
# one launch per forward instead of thousands (scoring/graphs.py; checked against the eager path).
CUDA_GRAPHS: Final = True
LM_HEAD_ROWS: Final = 512  # rows of the LM head computed at once (its logits are rows x vocabulary)
# Worker processes that prepare a run's requests (load, render, tokenize each claimed episode) when
# the in-process model computes on a GPU (scoring/preparing.py: off the model thread's GIL), or for
# a large run against a server (off the client's event loop); threads of the scoring process
# otherwise. RunOptions.prepare_workers / score_live(prepare_workers=) override.
PREPARE_PROCESSES: Final = 2
# Against a server, worker processes prepare a run of at least this many steps to score (a per-step
# follow batch of 8 real-size episodes has 792); a smaller one prepares in threads.
PREPARE_PROCESSES_FROM_STEPS: Final = 512
