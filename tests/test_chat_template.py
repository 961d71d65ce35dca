"""``render_chat`` is ``apply_chat_template(tokenize=False)``, character for character.

Real tokenizers and templates (Qwen3 and Qwen2.5 from ../shared when present, the demo
tokenizer, a BOS-emitting ChatML); every prefix of synthetic agent conversations, with and
without the generation prompt, in the stored shape and normalized (arguments as mappings).
"""

from __future__ import annotations

import pytest
from _tokenizers import bos_tokenizer, episode, named_tokenizer

from hcapo_store.rendering import template as chat_template
from hcapo_store.rendering.prompts import inject_hindsight, normalize_messages
from hcapo_store.rendering.template import TemplateRejected, render_chat
from hcapo_store.rendering.tokenizers import load_tokenizer


def _conversations() -> list[list[dict]]:
    out = []
    for seed in range(3):
        messages, _, _ = episode(seed, steps=9, tool_chars=300)
        out.append(messages)
        out.append(normalize_messages(inject_hindsight(messages, "Outcome: reward 0.5\n\n")))
    return out


def _direct(tok):
    return chat_template._DirectRenderer.of(tok)


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "demo", "chatml-bos"])
def test_every_prefix_renders_as_apply_chat_template_does(name, tmp_path, demo_tokenizer_dir):
    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    for messages in _conversations():
        for end in range(1, len(messages) + 1):
            for generation in (False, True):
                expected = tok.apply_chat_template(messages[:end], tokenize=False, add_generation_prompt=generation)
                assert render_chat(tok, messages[:end], generation=generation) == expected
    direct = _direct(tok)
    assert direct is not None and direct.agreed  # the direct path was taken, not only the fallback


def test_messages_transformers_rewrites_go_through_transformers(tmp_path):
    tok = bos_tokenizer(tmp_path)
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "tool_calls": None}]
    odd = [
        base,  # a None value: dropped, as transformers drops it (direct path)
        [*base[:1], {"role": "assistant", "content": "ok", "reasoning_content": "because"}],  # aliased by transformers
        [*base[:1], {"role": "assistant", "content": ("a", "b")}],  # a tuple: not plain JSON data
        [{"role": "user", "content": "x", "meta": {1: "int key"}}],
    ]
    for messages in odd:
        for generation in (False, True):
            expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            assert render_chat(tok, messages, generation=generation) == expected
    assert _direct(tok) is not None and _direct(tok).agreed
    with pytest.raises(TemplateRejected, match="empty"):
        render_chat(tok, [], generation=False)


def test_a_transformers_that_renders_otherwise_keeps_its_own_text(tmp_path, monkeypatch):
    tok = bos_tokenizer(tmp_path)
    original = type(tok).apply_chat_template

    def shifted(self, *args, **kwargs):  # stands for a transformers whose rendering changed
        return original(self, *args, **kwargs) + "\n"

    monkeypatch.setattr(type(tok), "apply_chat_template", shifted)
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, messages, generation=True) == shifted(
        tok, messages, tokenize=False, add_generation_prompt=True
    )
    assert _direct(tok) is None  # never used again for this template
    assert render_chat(tok, messages, generation=False).endswith("\n")


def test_a_template_that_refuses_refuses_on_both_paths(tmp_path):
    refusing = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ m.content }}{% endfor %}"
    tok = bos_tokenizer(tmp_path, template=refusing)
    assert render_chat(tok, [{"role": "user", "content": "a"}], generation=False) == "a"  # agreed: direct from now on
    assert _direct(tok).agreed
    with pytest.raises(TemplateRejected, match="no tools"):
        render_chat(tok, [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], generation=False)


def test_messages_checked_once_per_episode_render_as_fresh_ones(tmp_path, demo_tokenizer_dir):
    """The per-episode cache of plain messages gives the texts an uncached render gives, and
    holds one entry per message object (inject_hindsight copies only the first message)."""
    tok = load_tokenizer(demo_tokenizer_dir)
    messages = normalize_messages(episode(4, steps=8, tool_chars=200)[0])
    known: chat_template.PlainCache = {}
    for end in range(2, len(messages) + 1):
        step = inject_hindsight(messages[:end], f"Outcome for {end}\n")
        assert render_chat(tok, step, generation=False, known=known) == render_chat(tok, step, generation=False)
    # messages[1:] once each, and one copy of the first message per render
    assert len(known) == 2 * (len(messages) - 1)


# --- the sandbox's attribute lookup on plain dicts (memoize_sandbox_checks) -------------------


class _Sub(dict):
    role = "class attribute"


@pytest.mark.parametrize(
    "obj",
    [
        {"role": "user", "content": "x", "items": "a key named like a method", "_private": 1, "__class__": "k"},
        {},
        _Sub(role="key"),  # a subclass: the sandbox decides, as before
        "a string",
        ["a", "list"],
        None,
    ],
    ids=["dict", "empty", "subclass", "str", "list", "none"],
)
def test_the_fast_dict_lookup_answers_as_the_sandbox_does(obj):
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    fast = chat_template.fast_getattr(env)
    names = ["role", "content", "missing", "items", "keys", "get", "_private", "__class__", "__init__", "format"]
    for name in [*names, "upper", "startswith", "split", "format_map", "mro", "append", 3, ("t",)]:
        try:
            theirs = SandboxedEnvironment.getattr(env, obj, name)
        except TypeError:  # a name that is not a string
            with pytest.raises(TypeError):
                fast(obj, name)
            continue
        ours = fast(obj, name)
        assert type(ours) is type(theirs), (obj, name)
        if isinstance(theirs, jinja2_undefined()):
            assert (ours._undefined_obj, ours._undefined_name) == (theirs._undefined_obj, theirs._undefined_name)
        elif callable(theirs):
            assert getattr(ours, "__name__", None) == getattr(theirs, "__name__", None), (obj, name)
        else:
            assert ours == theirs, (obj, name)


def _unsafe() -> str:
    return "ran"


_unsafe.unsafe_callable = True  # type: ignore[attr-defined]  # the sandbox refuses to call it


def _with_context(context, value):
    return (type(context).__name__, value)


def test_the_fast_call_answers_as_the_sandbox_does():
    from jinja2 import pass_context
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    fast = chat_template.fast_call(env)
    context = env.from_string("").new_context({})
    text = "<think>\nreasoning\n</think>\n\n  answer  "
    calls = [
        (text.split, ("</think>",), {}),
        (text.split, (), {"maxsplit": 1}),
        (text.lstrip, ("\n",), {}),
        (text.strip, (), {}),
        (text.startswith, (("<think>", "x"),), {}),
        (", ".join, (["a", "b"],), {}),
        (text.count, ("\n",), {}),
        (text.format, (), {}),  # the raw method: left to the sandbox
        (env.getattr("{0}", "format"), (1,), {}),  # the sandbox's wrapped format
        (len, (text,), {}),
        (pass_context(_with_context), (7,), {}),
    ]
    for func, args, kwargs in calls:
        for extra in ({}, {"_loop_vars": {"x": 1}, "_block_vars": {}}):
            theirs = SandboxedEnvironment.call(env, context, func, *args, **kwargs, **extra)
            assert fast(context, func, *args, **kwargs, **extra) == theirs, (func, args, extra)
    with pytest.raises(TypeError):  # a wrong argument fails the same way on both paths
        SandboxedEnvironment.call(env, context, text.split, 3)
    with pytest.raises(TypeError):
        fast(context, text.split, 3)
    for call in (
        lambda: SandboxedEnvironment.call(env, context, _unsafe),
        lambda: fast(context, _unsafe),
    ):
        with pytest.raises(SecurityError):
            call()


def jinja2_undefined() -> type:
    from jinja2 import Undefined

    return Undefined


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "demo", "chatml-bos"])
def test_the_patched_sandbox_renders_as_a_fresh_one(name, tmp_path, demo_tokenizer_dir):
    """transformers compiles a template once and shares it, so apply_chat_template renders with
    the patched environment too; here the reference is a fresh, unpatched compilation."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    chat_template.memoize_sandbox_checks(tok)
    template = tok.get_chat_template()
    patched = _compile_jinja_template(template)
    assert {"getattr", "call"} <= set(vars(patched.environment))  # the fast lookup and call are on
    fresh = _compile_jinja_template.__wrapped__(template)
    assert not {"getattr", "call"} & set(vars(fresh.environment))
    variables = dict(_direct(tok).variables) if _direct(tok) is not None else {}
    for messages in _conversations():
        plain = normalize_messages(messages)
        for end in range(1, len(plain) + 1):
            for generation in (False, True):
                kwargs = dict(messages=plain[:end], tools=None, documents=None, add_generation_prompt=generation)
                assert patched.render(**kwargs, **variables) == fresh.render(**kwargs, **variables)
