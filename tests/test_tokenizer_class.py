"""The ``tokenizer_class`` strategy (rendering/tokenizers.py ``load_as``): a process that
prepares prompts loads its tokenizer through the class ``AutoTokenizer`` chose in the parent,
without importing ``AutoTokenizer`` (and torch under it), held at every load to the parent's
``AutoTokenizer`` load by digest. Real tokenizer files, real transformers classes; the worker
case in a fresh interpreter."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _shared import TOKENIZERS
from _tokenizers import bos_tokenizer

from hcapo_store.rendering import verify
from hcapo_store.rendering.tokenizers import LoadedClass, load_as, load_by_rule, load_digest, loaded_class
from hcapo_store.scoring.preparing import BuilderRecipe

REPO = Path(__file__).resolve().parent.parent
CHAT = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Find the file: naïve café 東京 🙂"},
    {"role": "assistant", "content": "ls -la /tmp\n\tdone"},
]


def _bos_dir(tmp_path: Path) -> Path:
    bos_tokenizer(tmp_path)
    return tmp_path


def _declaring(tmp_path: Path, declared: str | None, *, model_type: str | None = None) -> Path:
    """The small byte-level tokenizer's files with ``tokenizer_class`` set to ``declared`` (left
    out when None), and a ``config.json`` naming ``model_type`` when given: the cases in which
    AutoTokenizer's choice of class differs."""
    directory = _bos_dir(tmp_path)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("tokenizer_class", None)
    if declared is not None:
        config["tokenizer_class"] = declared
    config_path.write_text(json.dumps(config))
    if model_type is not None:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return directory


def _sources(tmp_path: Path, demo_tokenizer_dir: Path) -> dict[str, Path]:
    sources = {
        "demo": demo_tokenizer_dir,
        "byte-level": _bos_dir(tmp_path / "bos"),
        "declares-TokenizersBackend": _declaring(tmp_path / "tb", "TokenizersBackend"),
        "declares-PreTrainedTokenizerFast": _declaring(tmp_path / "ptf", "PreTrainedTokenizerFast"),
        # ByteLevel files declared as Llama's: AutoTokenizer loads TokenizersBackend instead
        "declares-LlamaTokenizerFast": _declaring(tmp_path / "llama", "LlamaTokenizerFast"),
        "no-class-model-type-qwen2": _declaring(tmp_path / "qwen2", None, model_type="qwen2"),
    }
    for name in ("qwen3", "qwen2.5"):
        if (TOKENIZERS / name).is_dir():
            sources[name] = TOKENIZERS / name
    return sources


def test_each_class_autotokenizer_chose_loads_the_same_tokenizer(tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    classes = set()
    for name, directory in _sources(tmp_path, demo_tokenizer_dir).items():
        rule = load_by_rule(directory)
        loaded = loaded_class(directory)
        assert loaded is not None, name
        assert (loaded.module, loaded.qualname) == (type(rule).__module__, type(rule).__qualname__), name
        before = verify.fallbacks()
        fast = load_as(directory, loaded)
        assert verify.since(before) == {}, name
        assert type(fast) is type(rule), name
        assert load_digest(fast) == load_digest(rule) == loaded.digest, name
        # what a builder asks of it: the chat's text and ids, with and without special tokens
        text = rule.apply_chat_template(CHAT, tokenize=False)
        assert fast.apply_chat_template(CHAT, tokenize=False) == text, name
        for special in (True, False):
            assert (
                fast(text, add_special_tokens=special)["input_ids"]
                == rule(text, add_special_tokens=special)["input_ids"]
            ), name
        classes.add(loaded.qualname)
    assert len(classes) >= 2  # the cases above do reach different classes


def test_a_load_through_another_class_is_caught_and_the_rule_loaded(tmp_path: Path) -> None:
    directory = _declaring(tmp_path, "LlamaTokenizerFast")
    rule = load_by_rule(directory)
    loaded = loaded_class(directory)
    assert loaded is not None and loaded.qualname == "TokenizersBackend"  # not the declared Llama class
    # Llama's class on these files builds a Metaspace pipeline: another tokenizer
    wrong = dataclasses.replace(
        loaded, module="transformers.models.llama.tokenization_llama", qualname="LlamaTokenizer"
    )
    before = verify.fallbacks()
    got = load_as(directory, wrong)
    assert verify.since(before) == {"tokenizer_class": 1}
    assert type(got) is type(rule) and load_digest(got) == loaded.digest


@pytest.mark.parametrize(
    "change",
    [
        {"digest": "0" * 64},  # a digest that is not this tokenizer's
        {"qualname": "NoSuchTokenizer"},  # a class that is not there
    ],
)
def test_a_disagreement_is_counted_and_the_rule_loaded(tmp_path: Path, change: dict[str, str]) -> None:
    directory = _bos_dir(tmp_path)
    rule = load_by_rule(directory)
    loaded = loaded_class(directory)
    assert loaded is not None
    before = verify.fallbacks()
    got = load_as(directory, dataclasses.replace(loaded, **change))
    assert verify.since(before) == {"tokenizer_class": 1}
    assert load_digest(got) == load_digest(rule)


def test_without_the_parents_load_the_rule_loads_and_nothing_is_counted(tmp_path: Path) -> None:
    directory = _bos_dir(tmp_path)
    loaded = load_as(directory, None)  # nothing to go by (and no record of these new files): the rule
    remembered = loaded_class(directory)
    assert remembered is not None and load_digest(loaded) == remembered.digest
    before = verify.fallbacks()
    # a class outside transformers (remote code): the rule, not a disagreement
    outside = dataclasses.replace(remembered, module="custom_tokenizers", qualname="Mine")
    assert load_digest(load_as(directory, outside)) == remembered.digest
    # files rewritten since the parent's load: its record no longer applies
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = 1234
    config_path.write_text(json.dumps(config))
    assert loaded_class(directory) is None  # the record was of other files
    again = load_as(directory, remembered)
    assert again.model_max_length == 1234 and load_digest(again) != remembered.digest
    assert verify.since(before) == {}


def test_the_digest_tells_apart_what_a_builder_reads(tmp_path: Path) -> None:
    directory = _bos_dir(tmp_path)
    base = load_digest(load_by_rule(directory))
    changed = load_by_rule(directory)
    changed.chat_template = changed.chat_template + "{# another #}"
    assert load_digest(changed) != base
    added = load_by_rule(directory)
    added.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    assert load_digest(added) != base
    assert load_digest(load_by_rule(directory)) == base  # and a fresh load is the same again


def test_a_worker_loads_without_autotokenizer_or_torch(tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    """In a fresh interpreter, as a prepare worker starts: the recipe made here carries the class;
    the worker imports neither AutoTokenizer nor torch, and its tokenizer is this process's."""
    directory = TOKENIZERS / "qwen3" if (TOKENIZERS / "qwen3").is_dir() else demo_tokenizer_dir
    tok = load_by_rule(directory)

    class _Builder:  # BuilderRecipe.of reads only whether the builder renders by the rules
        reference = False

    recipe = BuilderRecipe.of(str(directory), {}, _Builder())  # type: ignore[arg-type]
    assert isinstance(recipe.loaded, LoadedClass) and recipe.loaded.digest == load_digest(tok)
    (tmp_path / "recipe.pickle").write_bytes(pickle.dumps(recipe))
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, pickle, sys
            from hcapo_store.rendering import verify
            from hcapo_store.rendering.tokenizers import load_digest
            recipe = pickle.loads(open({str(tmp_path / "recipe.pickle")!r}, "rb").read())
            builder = recipe.build()
            print(json.dumps({{
                "digest": load_digest(builder.tokenizer),
                "class": type(builder.tokenizer).__qualname__,
                "torch": "torch" in sys.modules,
                "auto": "transformers.models.auto.tokenization_auto" in sys.modules,
                "fallbacks": verify.fallbacks(),
            }}))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "PATH": "/usr/bin:/bin",
            "HCAPO_CACHE_DIR": os.environ["HCAPO_CACHE_DIR"],
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "digest": load_digest(tok),
        "class": type(tok).__qualname__,
        "torch": False,
        "auto": False,
        "fallbacks": {},
    }
