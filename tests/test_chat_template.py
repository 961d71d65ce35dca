"""``render_chat`` is ``apply_chat_template(tokenize=False)``, character for character,
rendered in our own sandbox (``ChatSandbox``) while transformers' stays untouched.

Real tokenizers and templates (every one in ../shared/tokenizers when present, the demo
tokenizer, a BOS-emitting ChatML); every prefix of synthetic agent conversations and of the
sample episodes, with and without the generation prompt, with and without tools, in the
stored shape and normalized (arguments as mappings).
"""

from __future__ import annotations

import json

import pytest
from _tokenizers import bos_tokenizer, episode, named_tokenizer

from hcapo_store.rendering import template as chat_template
from hcapo_store.rendering import verify
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


def _direct(tok, tools=None):
    return chat_template._DirectRenderer.of(tok, tools)


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
    before = verify.fallbacks().get("template_sandbox", 0)
    assert render_chat(tok, messages, generation=True) == shifted(
        tok, messages, tokenize=False, add_generation_prompt=True
    )
    assert _direct(tok) is None  # never used again for this template
    assert verify.fallbacks()["template_sandbox"] == before + 1  # counted (issue 40)
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
    known = chat_template.RenderMemo()
    for end in range(2, len(messages) + 1):
        step = inject_hindsight(messages[:end], f"Outcome for {end}\n")
        assert render_chat(tok, step, generation=False, known=known) == render_chat(tok, step, generation=False)
    # messages[1:] once each, and one copy of the first message per render
    assert len(known.plain) == 2 * (len(messages) - 1)


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_tool_arguments_serialized_once_per_episode_render_as_fresh_ones(name, tmp_path, demo_tokenizer_dir):
    """The memo's ``tojson`` texts (a tool call's arguments, once per episode) give the texts an
    uncached render gives, every window of a session, twice over."""
    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    messages = normalize_messages(episode(7, steps=10, tool_chars=120)[0])
    assert any(m.get("tool_calls") for m in messages)
    known = chat_template.RenderMemo()
    for _ in range(2):
        for end in range(2, len(messages) + 1):
            for generation in (False, True):
                fresh = render_chat(tok, messages[:end], generation=generation)
                assert render_chat(tok, messages[:end], generation=generation, known=known) == fresh
    assert known.json  # the arguments were kept, each beside its object
    assert all(key[0] == id(value) for key, (value, _) in known.json.items())


def test_tojson_options_are_part_of_the_memo(tmp_path):
    template = (
        "{{ messages[0].data | tojson }}|{{ messages[0].data | tojson(indent=2) }}|{{ messages[0].data | tojson }}"
    )
    tok = bos_tokenizer(tmp_path, template=template)
    data = {"b": [1, "é"], "a": {"c": None}}
    known = chat_template.RenderMemo()
    text = render_chat(tok, [{"role": "user", "content": "x", "data": data}], generation=False, known=known)
    compact, indented = json.dumps(data, ensure_ascii=False), json.dumps(data, ensure_ascii=False, indent=2)
    assert text == f"{compact}|{indented}|{compact}"
    assert sorted(t for _, t in known.json.values()) == sorted([compact, indented])


# --- our sandbox: the same answers as jinja2's, in less work ---------------------------------


class _Sub(dict):
    role = "class attribute"


class _Loop:
    """An object whose attributes a template reads (``loop.index0``)."""

    index0 = 4
    _hidden = "private"


@pytest.mark.parametrize(
    "obj",
    [
        {"role": "user", "content": "x", "items": "a key named like a method", "_private": 1, "__class__": "k"},
        {},
        _Sub(role="key"),  # a subclass: the sandbox decides, as before
        "a string",
        ["a", "list"],
        None,
        _Loop(),  # judged safe once, then read directly
        chat_template._TemplateNamespace(last_query_index=3),
    ],
    ids=["dict", "empty", "subclass", "str", "list", "none", "object", "namespace"],
)
def test_the_fast_dict_lookup_answers_as_the_sandbox_does(obj):
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    env = ImmutableSandboxedEnvironment()  # jinja2's own, the reference
    ours = chat_template.ChatSandbox()
    names = ["role", "content", "missing", "items", "keys", "get", "_private", "__class__", "__init__", "format"]
    names += ["index0", "last_query_index", "_hidden", "__dict__"]
    for name in [*names, "upper", "startswith", "split", "format_map", "mro", "append", 3, ("t",)]:
        for _ in range(2):  # the second lookup reads the memoized verdicts
            try:
                theirs = SandboxedEnvironment.getattr(env, obj, name)
            except TypeError:  # a name that is not a string
                with pytest.raises(TypeError):
                    ours.getattr(obj, name)
                continue
            got = ours.getattr(obj, name)
            assert type(got) is type(theirs), (obj, name)
            if isinstance(theirs, jinja2_undefined()):
                assert (got._undefined_obj, got._undefined_name) == (theirs._undefined_obj, theirs._undefined_name)
                assert got._undefined_exception is theirs._undefined_exception, (obj, name)  # SecurityError stays
            elif callable(theirs):
                assert getattr(got, "__name__", None) == getattr(theirs, "__name__", None), (obj, name)
            else:
                assert got == theirs, (obj, name)


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
    ours = chat_template.ChatSandbox()
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
            assert ours.call(context, func, *args, **kwargs, **extra) == theirs, (func, args, extra)
    with pytest.raises(TypeError):  # a wrong argument fails the same way on both paths
        SandboxedEnvironment.call(env, context, text.split, 3)
    with pytest.raises(TypeError):
        ours.call(context, text.split, 3)
    for call in (
        lambda: SandboxedEnvironment.call(env, context, _unsafe),
        lambda: ours.call(context, _unsafe),
    ):
        with pytest.raises(SecurityError):
            call()


def jinja2_undefined() -> type:
    from jinja2 import Undefined

    return Undefined


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file: returns its text",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {"type": "function", "function": {"name": "run", "description": "Run a shell command, <b>&</b> é 東京"}},
]


def _shared_template_names() -> list[str]:
    """Every tokenizer directory in ../shared/tokenizers (skips when absent), and ours."""
    from _shared import TOKENIZERS

    shared = sorted(p.name for p in TOKENIZERS.iterdir() if p.is_dir()) if TOKENIZERS.is_dir() else []
    return [*shared, "demo", "chatml-bos"]


@pytest.mark.parametrize("name", _shared_template_names())
def test_with_tools_every_prefix_renders_as_apply_chat_template_does(name, tmp_path, demo_tokenizer_dir):
    """Tools reach the template as apply_chat_template hands them (Qwen lists them in the system
    turn); our sandbox renders them, after the first render agreed."""
    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    for messages in _conversations()[:2]:
        for end in range(1, len(messages) + 1):
            for generation in (False, True):
                expected = tok.apply_chat_template(
                    messages[:end], tokenize=False, add_generation_prompt=generation, tools=TOOLS
                )
                assert render_chat(tok, messages[:end], generation=generation, tools=TOOLS) == expected
    direct = chat_template._DirectRenderer.of(tok, TOOLS)
    assert direct is not None and direct.agreed


def _sample_conversations(tmp_path) -> list[list[dict]]:
    """The sample episodes (../shared, else the project's examples), ingested and loaded back
    as ``score`` loads them."""
    from _shared import EXAMPLES, SAMPLES
    from sqlalchemy import text

    from hcapo_store.ingestion.pipeline import ingest
    from hcapo_store.ingestion.sources import ConvertOptions
    from hcapo_store.storage.episodes import load_episode
    from hcapo_store.storage.store import Store

    root = SAMPLES if SAMPLES.exists() else EXAMPLES
    out = []
    for thinking in (False, True):
        store = Store.open(str(tmp_path / f"samples-{thinking}.db"))
        try:
            ingest(store, [root], options=ConvertOptions(include_thinking=thinking))
            with store.engine.connect() as conn:
                ids = conn.execute(text("SELECT id FROM episodes WHERE is_current ORDER BY id")).scalars().all()
                out += [load_episode(conn, i).messages for i in ids]
        finally:
            store.close()
    return out


@pytest.mark.parametrize("name", _shared_template_names())
def test_the_sample_episodes_render_as_apply_chat_template_does(name, tmp_path, demo_tokenizer_dir):
    """Every prefix of every sample episode ending at an assistant turn (the renders a per-step
    prompt makes), stored and normalized, with and without the generation prompt."""
    tok = named_tokenizer(name, tmp_path, demo_tokenizer_dir)
    conversations = _sample_conversations(tmp_path)
    assert conversations
    rendered = 0
    for stored in conversations:
        for messages in (stored, normalize_messages(inject_hindsight(stored, "Outcome: reward 1.0"))):
            ends = [i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"][:12]
            for end in ends:
                for generation in (False, True):
                    try:
                        expected = tok.apply_chat_template(
                            messages[:end], tokenize=False, add_generation_prompt=generation
                        )
                    except Exception:  # the template refuses: so does render_chat
                        with pytest.raises(TemplateRejected):
                            render_chat(tok, messages[:end], generation=generation)
                        continue
                    assert render_chat(tok, messages[:end], generation=generation) == expected
                    rendered += 1
    assert rendered > 20
    assert _direct(tok) is not None and _direct(tok).agreed


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__ }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{{ '{0.__class__.__base__}'.format(messages) }}",
    "{{ dict.__call__.__globals__ }}",
    "{% set ns = namespace(_x=1) %}{{ ns }}",
]


@pytest.mark.parametrize("escape", ESCAPES)
def test_transformers_sandbox_is_untouched_after_we_render(escape, tmp_path, demo_tokenizer_dir):
    """After hcapo-store has rendered (a prompt builder built steps, render_chat agreed and
    rendered in our sandbox), a template that tries to escape the sandbox still raises
    SecurityError through ``tokenizer.apply_chat_template`` in the same process, and
    transformers' environment object is jinja2's class with nothing set on it. Ours refuses
    the same templates."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from hcapo_store.rendering.prompts import PromptBuilder

    tok = load_tokenizer(demo_tokenizer_dir)
    messages, outcome, steps = episode(2, steps=6, tool_chars=200)
    builder = PromptBuilder(tok, max_context=400)
    assert builder.build_episode(messages, outcome, steps)
    assert _direct(tok) is not None and _direct(tok).agreed  # our sandbox did the rendering

    theirs = _compile_jinja_template(tok.get_chat_template()).environment
    assert type(theirs) is ImmutableSandboxedEnvironment
    assert not {"getattr", "call", "is_safe_attribute", "is_safe_callable"} & set(vars(theirs))
    with pytest.raises(SecurityError):
        tok.apply_chat_template(messages[:2], tokenize=False, chat_template=escape)
    escaping = _compile_jinja_template(escape).environment
    assert type(escaping) is ImmutableSandboxedEnvironment and "getattr" not in vars(escaping)
    with pytest.raises(SecurityError):
        chat_template.compile_template(escape).render(messages=normalize_messages(messages[:2]))
    tok.chat_template = escape
    with pytest.raises(TemplateRejected, match="SecurityError"):
        render_chat(tok, messages[:2], generation=False)


FEATURES = (
    "{% set ns = namespace(n=0) %}{% set d = dict(a=1, b=dict.fromkeys(['x'], 2)) %}"
    "[{{ strftime_now('%Y') }}] {{ d | tojson(indent=2, sort_keys=True) }} {{ tools | tojson(separators=(',', ':')) }}\n"
    "{%- for m in messages %}\n"
    "  {% if m.role == 'tool' %}{% set ns.n = ns.n + 1 %}{% continue %}{% endif %}\n"
    "  {% if loop.index > 6 %}{% break %}{% endif %}\n"
    "<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}\n"
    "{% endfor %}{{ ns.n }} tool results {{ '東京 <&>' | tojson }}{{ bos_token }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if messages | length > 40 %}{{ raise_exception('too long') }}{% endif %}"
)


def test_the_globals_filters_and_tags_transformers_gives(tmp_path):
    """namespace, dict, strftime_now, tojson with its arguments (no HTML escaping), the
    {% generation %} tag, loop controls, trim_blocks/lstrip_blocks, raise_exception: the same
    text as apply_chat_template, and the same refusal."""
    tok = bos_tokenizer(tmp_path, template=FEATURES)
    for messages in _conversations()[:2]:
        for end in range(1, len(messages) + 1):
            for generation in (False, True):
                for tools in (None, TOOLS):
                    expected = tok.apply_chat_template(
                        messages[:end], tokenize=False, add_generation_prompt=generation, tools=tools
                    )
                    assert render_chat(tok, messages[:end], generation=generation, tools=tools) == expected
    assert _direct(tok).agreed and _direct(tok, TOOLS).agreed
    assert expected.endswith("<s><assistant>")  # the last render checked had the generation prompt
    too_long = [{"role": "user", "content": str(i)} for i in range(41)]
    with pytest.raises(TemplateRejected, match="TemplateError: too long"):
        render_chat(tok, too_long, generation=False)


def test_changed_special_tokens_are_rendered_as_changed(tmp_path):
    """Issue 41: render_chat kept a tokenizer's old special tokens after the caller changed them."""
    tok = bos_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, messages, generation=False).startswith("<s>")
    tok.bos_token = "</s>"
    expected = tok.apply_chat_template(messages, tokenize=False)
    assert expected.startswith("</s>")
    assert render_chat(tok, messages, generation=False) == expected
    assert render_chat(tok, messages, generation=False) == expected  # and once the new one agreed


LOOPING = "{% for a in range(99999) %}{% for b in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"


def test_a_template_that_never_ends_fails_the_step_with_its_reason(tmp_path, monkeypatch):
    """Issue 41: a chat template that loops (near) forever made ``score`` hang silently. A render
    is bounded in time: the step fails as a template failure that says so, and the template is
    refused from then on (the next render does not wait again)."""
    from hcapo_store.rendering.prompts import PromptBuilder

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)
    tok = bos_tokenizer(tmp_path, template=LOOPING)
    messages, outcome, steps = episode(0, steps=3)
    prompts = PromptBuilder(tok, max_context=4096).build_episode(messages, outcome, steps)
    assert [p.reason for p in prompts] == ["template"] * 3
    assert all("ran past 0.2 s" in p.message for p in prompts)
