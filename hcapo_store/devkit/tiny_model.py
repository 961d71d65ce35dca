"""Build the demo tokenizer and the tiny demo model locally, deterministically.

A user's machine has no Hugging Face access, so the demo cannot download a model. Instead
it trains a small byte-level BPE tokenizer on a corpus kept in this module and builds a
randomly initialised Qwen2 model of that vocabulary. The numbers it produces are real
log-probabilities of a real (if untrained) causal LM, which is all the pipeline needs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hcapo_store.errors import MissingExtra

# The trainer's target; the built-in corpus supports ~1800 tokens (bytes + merges).
DEMO_VOCAB_SIZE = 2000
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Not "special": they are ordinary text the model reads and writes, as in Qwen.
EXTRA_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
# Bump when the build changes, so cached assets built by an older version are rebuilt.
BUILD_VERSION = 1
_MARKER = "hcapo_demo_build.json"

# ChatML. Tool results become <tool_response> blocks inside a user turn (consecutive tool
# messages share one turn); assistant tool calls are JSON objects in <tool_call> blocks.
CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is string -%}{{ content }}
    {%- elif content -%}{%- for part in content -%}{{ part.text }}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system -%}{{- text(system) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions. Their signatures are listed in <tools></tools>:\n<tools>\n' -}}
    {%- for tool in tools -%}{{- tool | tojson + '\n' -}}{%- endfor -%}
    {{- '</tools>\n\nTo call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif system is not none -%}
    {{- '<|im_start|>system\n' + text(system) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- text(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first or message.content -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + fn.name | tojson + ', "arguments": ' + fn.arguments | tojson + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# A few KB of the kinds of text agent trajectories contain: English, shell sessions,
# Python, JSON and chat markup. Training on it gives merges for common words and code.
CORPUS = r'''
The agent reads the task, inspects the repository, runs the tests and edits the code until
every test passes. When a command fails, it reads the error message carefully and tries a
different approach. A good step makes progress towards the goal; a bad step wastes time.
Please fix the failing test in the parser module and explain what you changed.
I will start by listing the files in the project directory to understand its structure.
The function returns the number of lines in the file, or zero when the file is empty.
Let me check the configuration file first, then run the build again with verbose output.
The server answered with status 200 and the response contains the expected fields.
We need to handle the case where the input is missing, otherwise the program crashes.
Hindsight: knowing the final answer, which of these steps was actually useful?
The user wants a summary of the changes, a list of the files touched and the test results.
This is a simple and clear explanation of the problem, with the solution in three parts.

$ ls -la
total 48
drwxr-xr-x  6 user user 4096 Jan 12 10:31 .
drwxr-xr-x 18 user user 4096 Jan 12 10:02 ..
-rw-r--r--  1 user user  1520 Jan 12 10:31 README.md
-rw-r--r--  1 user user   812 Jan 12 10:30 pyproject.toml
drwxr-xr-x  2 user user 4096 Jan 12 10:31 src
drwxr-xr-x  2 user user 4096 Jan 12 10:31 tests
$ git status
On branch main
Changes not staged for commit:
  modified:   src/parser.py
$ python -m pytest -q tests/test_parser.py
..F.                                                                     [100%]
FAILED tests/test_parser.py::test_parse_empty - AssertionError: assert None == []
1 failed, 3 passed in 0.42s
$ grep -rn "def parse" src/
src/parser.py:12:def parse(text: str) -> list[str]:
$ cat /etc/os-release | head -n 2
NAME="Ubuntu"
VERSION="22.04.4 LTS (Jammy Jellyfish)"
$ echo $?
0
bash: foo: command not found
Traceback (most recent call last):
  File "/home/user/project/src/main.py", line 27, in <module>
    main()
  File "/home/user/project/src/main.py", line 19, in main
    result = compute(values)
KeyError: 'value'
ValueError: invalid literal for int() with base 10: 'abc'
TypeError: unsupported operand type(s) for +: 'int' and 'str'

import json
import os
from pathlib import Path


def parse(text: str) -> list[str]:
    """Split the text into non-empty lines."""
    if not text:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


def load_config(path: Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


for index, item in enumerate(items):
    if item is None:
        continue
    print(f"{index}: {item}")

def main() -> None:
    args = sys.argv[1:]
    while args:
        name = args.pop(0)
        try:
            print(os.path.getsize(name))
        except FileNotFoundError as error:
            print("missing:", error, file=sys.stderr)

{"name": "bash", "arguments": {"command": "ls -la"}}
{"name": "read_file", "arguments": {"path": "src/parser.py", "offset": 0, "limit": 200}}
{"name": "edit_file", "arguments": {"path": "src/parser.py", "old": "return None", "new": "return []"}}
{"name": "run_tests", "arguments": {"paths": ["tests/test_parser.py"], "verbose": true}}
{"type": "function", "function": {"name": "search", "description": "Search the code.",
 "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
 "required": ["query"]}}}
{"id": 17, "status": "ok", "reward": 1.0, "steps": 12, "result": null, "tags": ["test", "fix"]}
{"error": {"message": "Invalid request: the field is required.", "code": 400}}

Reading the logs, the failure happens only on the second request, after the cache warms up.
First, reproduce the problem with a minimal example; second, find the smallest change that
fixes it; third, add a regression test so the bug cannot come back unnoticed.
The documentation says the option is deprecated and will be removed in the next release.
Because the database is locked by another process, the migration must wait and retry later.
Each episode has a reward between zero and one, and every step has a probability under the
reference model. Steps that become much more likely in hindsight receive more of the credit.
Summary: updated the parser, added two tests, and all forty-two tests pass on Python 3.11.
Could you also rename the variable, update the changelog, and bump the version number?
Sorry, I made a mistake in the previous command; the path should be relative, not absolute.
The output is long, so I will only show the first twenty lines and the last ten lines.
Downloading is not possible because the machine has no network access during the build.

$ pip install -e .
Obtaining file:///home/user/project
  Installing build dependencies ... done
Successfully installed project-0.1.0
$ make test
mkdir -p build && cd build && cmake .. && make -j4
[ 50%] Building C object CMakeFiles/app.dir/main.c.o
[100%] Linking C executable app
$ ./app --help
usage: app [-h] [--verbose] [--output FILE] input
error: the following arguments are required: input
$ find . -name "*.py" | xargs wc -l | sort -n | tail -3
   120 ./src/cli.py
   388 ./src/parser.py
  1024 total
$ curl -s http://localhost:8000/health
{"status": "healthy", "uptime_seconds": 3600}
$ docker ps
CONTAINER ID   IMAGE          COMMAND       STATUS         PORTS
3f2a9c1b7d4e   postgres:16    "postgres"    Up 2 hours     5432/tcp
$ sed -n '10,20p' src/util.js
$ npm test
  PASS  tests/util.test.js
  Tests:       8 passed, 8 total
warning: unused variable `count`
permission denied: /var/log/syslog
fatal: not a git repository (or any of the parent directories): .git

function debounce(callback, delay) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => callback(...args), delay);
  };
}

const response = await fetch(`${baseUrl}/api/items?limit=${limit}`);
if (!response.ok) {
  throw new Error(`request failed: ${response.status}`);
}

SELECT episode_id, COUNT(*) AS steps, AVG(logprob) AS mean_logprob
FROM step_scores
WHERE scorer = 'hindsight' AND logprob IS NOT NULL
GROUP BY episode_id
ORDER BY mean_logprob DESC
LIMIT 10;

CREATE TABLE IF NOT EXISTS episodes (id INTEGER PRIMARY KEY, name TEXT NOT NULL, reward REAL);
INSERT INTO episodes (name, reward) VALUES ('fix-parser', 1.0), ('add-feature', 0.0);

@dataclass(frozen=True)
class Step:
    index: int
    role: str
    content: str
    tokens: list[int] = field(default_factory=list)


async def fetch_all(client: httpx.AsyncClient, urls: list[str]) -> list[dict]:
    tasks = [client.get(url, timeout=30.0) for url in urls]
    responses = await asyncio.gather(*tasks)
    return [response.json() for response in responses if response.status_code == 200]


def test_counter_increments() -> None:
    counter = Counter(start=5)
    assert counter.increment() == 6
    assert counter.increment(step=4) == 10


with torch.inference_mode():
    logits = model(input_ids).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)

{"role": "user", "content": "What does this function return?"}
{"role": "assistant", "content": "It returns a list of strings.", "tool_calls": []}
{"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0}
{"timestamp": "2025-01-12T10:31:07Z", "level": "INFO", "message": "server started", "port": 8000}
{"files": {"src/parser.py": {"lines": 388, "functions": 12}, "src/cli.py": {"lines": 120}}}

<|im_start|>system
You are a helpful assistant that solves programming tasks.<|im_end|>
<|im_start|>user
Fix the bug in the parser, please.<|im_end|>
<|im_start|>assistant
<think>
The test expects an empty list for empty input.
</think>

I will look at the parser first.
<tool_call>
{"name": "read_file", "arguments": {"path": "src/parser.py"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
def parse(text):
    return None
</tool_response><|im_end|>
<|im_start|>assistant
The function returns None instead of an empty list. I changed it and the tests pass now.<|im_end|>
'''


def _train_tokenizer() -> Any:
    """Train the byte-level BPE model (deterministic for a fixed corpus and vocab size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the corpus without its chat markup, so the markup only ever becomes the
    # added tokens appended after the learned vocabulary (their ids are last, as in Qwen).
    text = CORPUS
    for token in SPECIAL_TOKENS + EXTRA_TOKENS:
        text = text.replace(token, "\n")
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def build_demo_tokenizer(out_dir: str | os.PathLike[str]) -> Path:
    """Write the demo tokenizer: tokenizer.json and tokenizer_config.json (with the chat
    template), loadable with ``AutoTokenizer.from_pretrained(out_dir)``."""
    from tokenizers import AddedToken

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    # Written by hand rather than by save_pretrained: its format differs between
    # transformers releases, and this one loads in all of them.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": [SPECIAL_TOKENS[1]],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """Hide transformers' progress bars, which are noise for a model of a few MB."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _build_params(tokenizer_dir: Path, **params: int) -> dict[str, Any]:
    return {"version": BUILD_VERSION, "tokenizer": str(tokenizer_dir.resolve()), **params}


def _is_built(out: Path, params: dict[str, Any]) -> bool:
    try:
        return json.loads((out / _MARKER).read_text()) == params
    except (OSError, ValueError):
        return False


def _publish(staging: Path, out: Path) -> None:
    """Move a finished build into place; the marker is written last, so a crash never
    leaves a directory that looks built."""
    staging.chmod(0o755)  # mkdtemp makes it private
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_position_embeddings: int = 32768,
) -> Path:
    """Save a randomly initialised Qwen2 causal LM with the tokenizer's vocabulary.

    The tokenizer files are saved next to the weights, so the directory alone is a
    complete model. Rebuilding with the same parameters is a no-op.
    """
    try:
        import torch
    except ImportError as exc:
        raise MissingExtra("torch", "local", "building the tiny demo model") from exc
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out, tok_dir = Path(out_dir), Path(tokenizer_dir)
    params = _build_params(
        tok_dir,
        seed=seed,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        max_position_embeddings=max_position_embeddings,
    )
    if _is_built(out, params):
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # rounded up, as real checkpoints are
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
        with _quiet_progress():
            model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        (staging / _MARKER).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def ensure_demo_model(cache_dir: str | os.PathLike[str]) -> Path:
    """Build the demo tokenizer and tiny model under ``cache_dir`` once; return the model dir."""
    cache = Path(cache_dir)
    tokenizer_dir = cache / "demo-tokenizer"
    marker = {"version": BUILD_VERSION, "vocab_size": DEMO_VOCAB_SIZE}
    if not _is_built(tokenizer_dir, marker):
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".demo-tokenizer.", dir=cache))
        try:
            build_demo_tokenizer(staging)
            (staging / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            _publish(staging, tokenizer_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return build_tiny_model(cache / "tiny-qwen2", tokenizer_dir)
