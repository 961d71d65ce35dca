"""Rendering a conversation with the tokenizer's chat template, faster than transformers does.

``render_chat`` gives exactly the text of ``apply_chat_template(messages, tokenize=False)``.
The per-step layout renders the conversation up to each step twice per step, so rendering
is most of its preparation. Two costs are cut, neither changing a character:

- transformers copies every message twice before each render (to dicts, then to plain
  JSON data for the sandbox: ~40 % of a render of a 100-step conversation). Messages that
  already are plain JSON data (the stored episodes are) are rendered as they are, through the
  same compiled template, with the same variables. Anything else (objects, tuples, the
  reasoning fields transformers renames) goes through ``apply_chat_template``.
- the sandbox's attribute check, memoized per (type, name), and its detours for a dict's
  keys and a str's methods (``memoize_sandbox_checks``).

The direct path leans on transformers' private ``_compile_jinja_template``. So for each
tokenizer and template its first render is also made through ``apply_chat_template``, and
the direct path is used only once the two texts agree (else never for that template).
"""

from __future__ import annotations

import weakref
from types import BuiltinMethodType
from typing import Any

# message keys transformers copies under other names before rendering (_alias_reasoning_fields)
_REASONING_FIELDS = frozenset(("reasoning_content", "thinking", "reasoning"))
_SCALARS = (str, int, float, bool, type(None))


class TemplateRejected(Exception):
    """The chat template refused these messages (the message says how)."""


# message id -> (the message, what is rendered of it): see render_chat's ``known``
PlainCache = dict[int, tuple[dict, dict]]


def render_chat(tokenizer: Any, messages: list[dict], *, generation: bool, known: PlainCache | None = None) -> str:
    """The chat template's text for ``messages``; :class:`TemplateRejected` when it refuses them.

    ``known`` remembers which messages are plain JSON data across renders of the same message
    objects (a per-step layout renders each message once per later step); the messages must
    not change while it is kept."""
    try:
        direct = _DirectRenderer.of(tokenizer)
        plain = _plain_messages(messages, known) if direct is not None else None
        if direct is not None and plain is not None:
            return direct.render(tokenizer, messages, plain, generation)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as exc:  # templates raise anything (TypeError, TemplateError, ...)
        raise TemplateRejected(f"{type(exc).__name__}: {exc}") from exc


def _plain_messages(messages: list[dict], known: PlainCache | None = None) -> list[dict] | None:
    """The messages as transformers would hand them to the template (keys whose value is None
    dropped), or None when they are not plain JSON data in the shape rendered directly."""
    if not messages:  # transformers refuses an empty conversation with its own message
        return None
    out = []
    for m in messages:
        hit = known.get(id(m)) if known is not None else None
        if hit is not None and hit[0] is m:  # the entry keeps m alive: its id is not reused
            out.append(hit[1])
            continue
        kept = _plain_message(m)
        if kept is None:
            return None
        if known is not None:
            known[id(m)] = (m, kept)
        out.append(kept)
    return out


def _plain_message(m: Any) -> dict | None:
    if type(m) is not dict:
        return None
    kept = {}
    for key, value in m.items():
        if value is None:
            continue
        if type(key) is not str or key in _REASONING_FIELDS:
            return None
        if type(value) is not str and not _plain(value):
            return None
        kept[key] = value
    return kept


def _plain(value: Any) -> bool:
    if type(value) in _SCALARS:
        return True
    if type(value) is list:
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


class _DirectRenderer:
    """A tokenizer's compiled template and the variables transformers renders it with."""

    _by_tokenizer: weakref.WeakKeyDictionary[Any, dict[str, _DirectRenderer | None]] = weakref.WeakKeyDictionary()

    def __init__(self, template: str, compiled: Any, variables: dict[str, Any]) -> None:
        self.template = template
        self.compiled = compiled
        self.variables = variables
        self.agreed = False  # its first render equalled apply_chat_template's

    @classmethod
    def of(cls, tokenizer: Any) -> _DirectRenderer | None:
        try:
            template = tokenizer.get_chat_template()
        except Exception:  # no template: apply_chat_template says so in its own words
            return None
        try:
            known = cls._by_tokenizer.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable
            return None
        if template not in known:
            known[template] = cls._build(tokenizer, template)
        return known[template]

    @classmethod
    def _build(cls, tokenizer: Any, template: str) -> _DirectRenderer | None:
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template, _plain_template_data
        except ImportError:  # a transformers without them: its own path only
            return None
        try:
            variables = _plain_template_data(dict(tokenizer.special_tokens_map))
            return cls(template, _compile_jinja_template(template), variables)
        except Exception:
            return None

    def render(self, tokenizer: Any, messages: list[dict], plain: list[dict], generation: bool) -> str:
        if self.agreed:
            return self._render(plain, generation)
        reference = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        try:
            agrees = self._render(plain, generation) == reference
        except Exception:
            agrees = False
        if agrees:
            self.agreed = True
        else:  # this transformers renders otherwise: its own path from now on
            _DirectRenderer._by_tokenizer[tokenizer][self.template] = None
        return reference

    def _render(self, plain: list[dict], generation: bool) -> str:
        return self.compiled.render(
            messages=plain, tools=None, documents=None, add_generation_prompt=generation, **self.variables
        )


def memoize_sandbox_checks(tokenizer: Any) -> None:
    """Cache the Jinja sandbox's attribute-safety verdicts of the tokenizer's chat template,
    and look up a plain dict's keys and a str's methods, and call a str's methods, without
    the sandbox's detours (``fast_getattr``, ``fast_call``).

    Rendering a 200-message conversation spends about half its time in
    ``is_safe_attribute``. Jinja's own implementations of that check read only the type of
    the object and the attribute name (``value`` is unused), so caching the verdict per
    (type, name) changes no output and keeps the sandbox. A subclass that overrides the
    check is left alone.

    The environment to patch is the one transformers renders with, reached through its
    private ``_compile_jinja_template``; a transformers without it renders unpatched: the
    same text, only slower (an environment compiled here would not be the one in use).
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    try:
        template = tokenizer.get_chat_template()
    except ValueError:  # no template: rendering fails later with a clear message
        return
    env = getattr(_compile_jinja_template(template), "environment", None)
    if env is None:  # a transformers whose private helper changed shape
        return
    check = type(env).is_safe_attribute
    if check not in (ImmutableSandboxedEnvironment.is_safe_attribute, SandboxedEnvironment.is_safe_attribute):
        return
    if "is_safe_attribute" in vars(env):  # already memoized (the compiled template is shared)
        return
    verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        if key not in verdicts:
            verdicts[key] = check(env, obj, attr, value)
        return verdicts[key]

    env.is_safe_attribute = is_safe_attribute
    sandbox = type(env)
    if sandbox.getattr is SandboxedEnvironment.getattr:
        env.getattr = fast_getattr(env)
    if sandbox.call is SandboxedEnvironment.call and sandbox.is_safe_callable is SandboxedEnvironment.is_safe_callable:
        env.call = fast_call(env)


def fast_call(env: Any) -> Any:
    """``environment.call`` for ``env`` (a sandbox that overrides neither ``call`` nor
    ``is_safe_callable``), the same answers with less work for the calls templates make most:
    a str's own methods (``content.split('</think>')``: nearly every call a Qwen3 render
    makes). For them the sandbox's verdict is always yes (a builtin method carries no
    ``unsafe_callable`` / ``alters_data`` mark) and Jinja's ``Context.call`` passes no context
    (a builtin has no ``pass_context`` mark), so both are skipped; the loop and block
    variables the compiled template hands every call are dropped, as ``Context.call`` drops
    them (a str method raises no StopIteration, the one other thing it handles). Everything
    else goes through the sandbox."""
    from jinja2.sandbox import SandboxedEnvironment

    sandboxed = SandboxedEnvironment.call

    def call(context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        if type(obj) is BuiltinMethodType and type(obj.__self__) is str:
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            return obj(*args, **kwargs)
        return sandboxed(env, context, obj, *args, **kwargs)

    return call


# Every attribute a dict instance has: all of them come from its type (a dict has no __dict__).
_DICT_ATTRIBUTES = frozenset(dir(dict))


def fast_getattr(env: Any) -> Any:
    """``environment.getattr`` for ``env`` (a sandbox that does not override it), the same
    answers with less work for the two lookups templates make most:

    * ``message.role`` on a plain dict: the sandbox first tries the attribute, which a dict
      has only for the names of ``dir(dict)``, so for any other name it raises AttributeError
      (about a third of a render) and then returns ``obj[name]`` or undefined; here that
      branch is taken directly for exactly those names;
    * ``content.startswith`` on a str: the sandbox checks each time that the method is not
      ``format``/``format_map`` and that the name is safe, which depends only on the type and
      the name; here those verdicts are taken once.

    Everything else goes through the sandbox as before."""
    from jinja2.sandbox import SandboxedEnvironment

    sandboxed = SandboxedEnvironment.getattr
    safe_str = frozenset(
        name
        for name in dir(str)
        if name not in ("format", "format_map") and env.is_safe_attribute("", name, getattr("", name))
    )

    def getattr_(obj: Any, attribute: Any) -> Any:
        if type(attribute) is str:
            if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except LookupError:
                    return env.undefined(obj=obj, name=attribute)
            if type(obj) is str and attribute in safe_str:
                return getattr(obj, attribute)
        return sandboxed(env, obj, attribute)

    return getattr_
