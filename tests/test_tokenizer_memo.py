"""AutoTokenizer's class kept across processes (rendering/tokenizer_memo.py): a process that
loads a tokenizer an earlier process loaded by the rule goes through the recorded class without
importing ``AutoTokenizer`` and torch, held to the recorded digest (the ``tokenizer_class``
strategy); a record of other files, another ``config.json``, other library versions, or an
unreadable one is not used; a wrong record is caught, counted, and the rule's tokenizer
returned and recorded. Real tokenizer files and fresh interpreters where a process's imports
are what is judged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _shared import TOKENIZERS
from test_tokenizer_class import _bos_dir

from hcapo_store.rendering import tokenizer_memo
from hcapo_store.rendering.tokenizers import files_state, load_by_rule, load_digest

REPO = Path(__file__).resolve().parent.parent
CHAT = [
    {"role": "user", "content": "Find the file: naïve café 東京 🙂"},
    {"role": "assistant", "content": "ls -la /tmp\n\tdone"},
]

# In a fresh interpreter: load each directory given with load_tokenizer and report, per load,
# what it imported by then, what it loaded, and the fallbacks counted.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from hcapo_store.rendering import verify
    from hcapo_store.rendering.tokenizers import load_digest, load_tokenizer, loaded_class
    chat = json.loads(sys.argv[1])
    seen = []
    for directory in sys.argv[2:]:
        before = verify.fallbacks()
        tok = load_tokenizer(directory)
        seen.append({
            "torch": "torch" in sys.modules,
            "auto": "transformers.models.auto.tokenization_auto" in sys.modules,
            "class": type(tok).__qualname__,
            "digest": load_digest(tok),
            "remembered": loaded_class(directory).digest,
            "ids": tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"],
            "fallbacks": verify.since(before),
        })
    print(json.dumps(seen))
    """
)


def _run(cache: Path, *directories: Path, rendering: str = "fast") -> list[dict]:
    env = {
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HCAPO_CACHE_DIR": str(cache),
        "HCAPO_RENDERING": rendering,
    }
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(CHAT), *map(str, directories)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rule(directory: Path) -> dict:
    tok = load_by_rule(directory)
    return {
        "class": type(tok).__qualname__,
        "digest": load_digest(tok),
        "ids": tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"],
    }


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own records, for this process and the ones it starts."""
    where = tmp_path / "cache"
    monkeypatch.setenv(tokenizer_memo.CACHE_ENV, str(where))
    return where


def _record_path(directory: Path) -> Path:
    return tokenizer_memo._path(tokenizer_memo.key(files_state(directory)))


def test_a_later_process_loads_through_the_recorded_class_without_torch(
    tmp_path: Path, cache: Path, demo_tokenizer_dir: Path
) -> None:
    real = TOKENIZERS / "qwen3" if (TOKENIZERS / "qwen3").is_dir() else demo_tokenizer_dir
    good = Path(shutil.copytree(real, tmp_path / "good"))
    wrong = _bos_dir(tmp_path / "wrong")
    rules = {d: _rule(d) for d in (good, wrong)}  # by the rule here: both recorded
    for d, rule in rules.items():
        assert tokenizer_memo.read(files_state(d))[1:] == (rule["class"], rule["digest"])
    # a record that names the right class with another digest: caught when next used
    record = json.loads(_record_path(wrong).read_text())
    record["digest"] = "0" * 64
    _record_path(wrong).write_text(json.dumps(record))

    first, second = _run(cache, good, wrong)
    # the recorded class, no AutoTokenizer and no torch, the rule's tokenizer
    assert {k: first[k] for k in ("torch", "auto", "fallbacks")} == {"torch": False, "auto": False, "fallbacks": {}}
    assert {k: first[k] for k in ("class", "digest", "ids")} == rules[good]
    assert first["remembered"] == rules[good]["digest"]  # what its prepare workers are held to
    # the wrong record: counted, the rule's tokenizer (AutoTokenizer imported for it), recorded again
    assert second["fallbacks"] == {"tokenizer_class": 1} and second["auto"]
    assert {k: second[k] for k in ("class", "digest", "ids")} == rules[wrong]
    assert second["remembered"] == rules[wrong]["digest"]
    assert json.loads(_record_path(wrong).read_text())["digest"] == rules[wrong]["digest"]


def test_reference_mode_loads_by_the_rule_with_a_record_there(cache: Path, demo_tokenizer_dir: Path) -> None:
    rule = _rule(demo_tokenizer_dir)
    assert tokenizer_memo.read(files_state(demo_tokenizer_dir)) is not None
    (seen,) = _run(cache, demo_tokenizer_dir, rendering="reference")
    assert seen["auto"] and seen["fallbacks"] == {}
    assert {k: seen[k] for k in ("class", "digest", "ids")} == rule


def test_a_record_is_only_of_its_files_config_and_libraries(tmp_path: Path, cache: Path) -> None:
    directory = _bos_dir(tmp_path / "tok")
    load_by_rule(directory)
    assert tokenizer_memo.read(files_state(directory)) is not None
    k = tokenizer_memo.key(files_state(directory))
    import tokenizers
    import transformers

    libraries = dict(k["libraries"])
    assert libraries["transformers"] == transformers.__version__
    assert libraries["tokenizers"] == tokenizers.__version__

    # the same name with another key inside (another transformers): not used
    path = _record_path(directory)
    record = json.loads(path.read_text())
    record["key"]["libraries"] = [[n, "0.0.1" if n == "transformers" else v] for n, v in record["key"]["libraries"]]
    path.write_text(json.dumps(record))
    assert tokenizer_memo.read(files_state(directory)) is None
    load_by_rule(directory)  # the rule records anew
    assert tokenizer_memo.read(files_state(directory)) is not None

    # a config.json (AutoTokenizer reads its model type) added, then changed: other keys
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert tokenizer_memo.read(files_state(directory)) is None
    load_by_rule(directory)
    assert tokenizer_memo.read(files_state(directory)) is not None
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "x": 1}))
    assert tokenizer_memo.read(files_state(directory)) is None

    # a tokenizer file rewritten: another key
    load_by_rule(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["model_max_length"] = 4321
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_memo.read(files_state(directory)) is None


def test_an_unreadable_record_or_an_unwritable_cache_costs_only_the_rule(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _bos_dir(tmp_path / "tok")
    digest = load_digest(load_by_rule(directory))
    path = _record_path(directory)
    for garbage in (b"", b"{not json", b"[1, 2]", json.dumps({"key": None}).encode()):
        path.write_bytes(garbage)
        assert tokenizer_memo.read(files_state(directory)) is None
    load_by_rule(directory)
    assert tokenizer_memo.read(files_state(directory))[2] == digest

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(tokenizer_memo.CACHE_ENV, str(blocked))
    assert load_digest(load_by_rule(directory)) == digest  # loads; nothing recorded, no error
    assert tokenizer_memo.read(files_state(directory)) is None
    assert blocked.read_text() == "not a directory"


def test_the_cache_directory_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(tokenizer_memo.CACHE_ENV, str(tmp_path / "mine"))
    assert tokenizer_memo.memo_dir() == tmp_path / "mine" / "tokenizer-classes"
    monkeypatch.delenv(tokenizer_memo.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokenizer_memo.memo_dir() == tmp_path / "xdg" / "hcapo-store" / "tokenizer-classes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tokenizer_memo.memo_dir() == tmp_path / "home" / ".cache" / "hcapo-store" / "tokenizer-classes"
