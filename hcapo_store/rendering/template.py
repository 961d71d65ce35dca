"""Rendering a conversation with the tokenizer's chat template, in our own Jinja sandbox.

``render_chat`` gives exactly the text of ``apply_chat_template(messages, tokenize=False)``.
The per-step layout renders the conversation up to each step twice per step, so rendering
is most of its preparation. Two costs are cut, neither changing a character:

- transformers copies every message twice before each render (to dicts, then to plain
  JSON data for the sandbox: ~40 % of a render of a 100-step conversation). Messages that
  already are plain JSON data (the stored episodes are) are rendered as they are, with the
  same variables. Anything else (objects, tuples, the reasoning fields transformers renames,
  tools given as functions) goes through ``apply_chat_template``.
- the sandbox's attribute check, memoized per (type, name), and its detours for a dict's
  keys and a str's methods: :class:`ChatSandbox`, a subclass of jinja2's public
  ``ImmutableSandboxedEnvironment`` set up as transformers sets up its own (the same
  options, filters, globals and ``{% generation %}`` tag).

The templates are compiled in :class:`ChatSandbox`, never in transformers' environment,
which stays as transformers made it (``apply_chat_template`` elsewhere in the process, a
trainer's or ``score_live``'s, renders exactly as it would without us). Our environment is
a second implementation of theirs, so for each tokenizer and template its first render is
also made through ``apply_chat_template``, and ours is used only once the two texts agree
(else never for that template).
"""

from __future__ import annotations

import functools
import json
import threading
import time
import weakref
from datetime import datetime
from types import BuiltinMethodType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from hcapo_store.rendering import verify

# message keys transformers copies under other names before rendering (_alias_reasoning_fields)
_REASONING_FIELDS = frozenset(("reasoning_content", "thinking", "reasoning"))
_SCALARS = (str, int, float, bool, type(None))


class TemplateRejected(Exception):
    """The chat template refused these messages (the message says how)."""


# One render in our sandbox may take this long; past it the render fails (TemplateRejected,
# the step fails with the reason) and the template is refused from then on.
RENDER_SECONDS = 10.0
_clock = threading.local()  # .deadline: time.monotonic() past which this thread's render stops


class RenderTimeout(TemplateError):
    """A render ran past RENDER_SECONDS (a template loop that does not end)."""


def _check_deadline() -> None:
    deadline = getattr(_clock, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        _clock.deadline = None
        raise RenderTimeout(f"the chat template ran past {RENDER_SECONDS:g} s (a loop that does not end?)")


class _BoundedRange:
    """``range(...)`` in a template: jinja2's sandboxed range, whose iteration checks the
    render's deadline (the loops a template can make run without bound are over ranges)."""

    __slots__ = ("_range",)

    def __init__(self, *args: Any) -> None:
        self._range = safe_range(*args)

    def __iter__(self) -> Any:
        for n, value in enumerate(self._range):
            if not n & 255:
                _check_deadline()
            yield value

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, key: Any) -> Any:
        return self._range[key]

    def __contains__(self, value: Any) -> bool:
        return value in self._range

    def __reversed__(self) -> Any:
        return iter(_BoundedRange.of(self._range[::-1]))

    @classmethod
    def of(cls, inner: range) -> _BoundedRange:
        out = cls.__new__(cls)
        out._range = inner
        return out


class RenderMemo:
    """What renders of the same message objects share (a per-step layout renders each message once
    per later step): ``plain``, message id -> (the message, what is rendered of it); ``json``,
    (value id, tojson's options) -> (the value, its text). Each entry keeps its object alive, so
    its id is not reused; the messages must not change while the memo is kept (the sandbox lets
    no template change them)."""

    __slots__ = ("json", "plain")

    def __init__(self) -> None:
        self.plain: dict[int, tuple[dict, dict]] = {}
        self.json: dict[tuple[Any, ...], tuple[Any, str]] = {}


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    generation: bool,
    known: RenderMemo | None = None,
    tools: list[dict] | None = None,
) -> str:
    """The chat template's text for ``messages`` (and ``tools``, the JSON schemas a template
    may list); :class:`TemplateRejected` when it refuses them.

    ``known`` remembers which messages are plain JSON data, and the ``tojson`` text of their
    values, across renders of the same message objects (:class:`RenderMemo`)."""
    try:
        direct = _DirectRenderer.of(tokenizer, tools)
        plain = _plain_messages(messages, known) if direct is not None else None
        if direct is not None and plain is not None and (tools is None or plain_data(tools)):
            return direct.render(tokenizer, messages, plain, generation, tools, known)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, tools=tools)
    except Exception as exc:  # templates raise anything (TypeError, TemplateError, ...)
        raise TemplateRejected(f"{type(exc).__name__}: {exc}") from exc


def render_by_rule(tokenizer: Any, messages: list[dict], *, generation: bool) -> str:
    """The rule render_chat stands in for: ``apply_chat_template`` itself (reference mode)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as exc:
        raise TemplateRejected(f"{type(exc).__name__}: {exc}") from exc


def _plain_messages(messages: list[dict], known: RenderMemo | None = None) -> list[dict] | None:
    """The messages as transformers would hand them to the template (keys whose value is None
    dropped), or None when they are not plain JSON data in the shape rendered directly."""
    if not messages:  # transformers refuses an empty conversation with its own message
        return None
    out = []
    for m in messages:
        hit = known.plain.get(id(m)) if known is not None else None
        if hit is not None and hit[0] is m:  # the entry keeps m alive: its id is not reused
            out.append(hit[1])
            continue
        kept = _plain_message(m)
        if kept is None:
            return None
        if known is not None:
            known.plain[id(m)] = (m, kept)
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
        if type(value) is not str and not plain_data(value):
            return None
        kept[key] = value
    return kept


def plain_data(value: Any) -> bool:
    """Whether ``value`` is plain JSON data: str, int, float, bool, None, lists, dicts with str keys
    (whose ``repr`` is exact, in their order)."""
    if type(value) in _SCALARS:
        return True
    if type(value) is list:
        return all(plain_data(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and plain_data(v) for k, v in value.items())
    return False


def _special_source(tokenizer: Any) -> Any:
    """What a tokenizer's special tokens are read from, cheap to compare: transformers' own
    map of them (a copy of it compares equal at once while it holds the same objects; setting
    a token replaces its entry), else the public map."""
    raw = getattr(tokenizer, "_special_tokens_map", None)
    return raw if isinstance(raw, dict) else tokenizer.special_tokens_map


class _DirectRenderer:
    """A tokenizer's template compiled in our sandbox and the variables transformers renders
    it with (the tokenizer's special tokens)."""

    _by_tokenizer: weakref.WeakKeyDictionary[Any, dict[str, _DirectRenderer | None]] = weakref.WeakKeyDictionary()

    def __init__(self, template: str, compiled: jinja2.Template, variables: dict[str, Any]) -> None:
        self.template = template
        self.compiled = compiled
        self.variables = variables
        self.source: Any = None  # what the variables were read from (_special_source), to notice a change
        self.agreed = False  # its first render equalled apply_chat_template's
        self.timed_out: str | None = None  # a render ran past RENDER_SECONDS: refused from then on

    @classmethod
    def of(cls, tokenizer: Any, tools: list[dict] | None = None) -> _DirectRenderer | None:
        try:  # with tools a tokenizer may pick its tool-use template, as apply_chat_template does
            template = tokenizer.get_chat_template(None, tools)
        except Exception:  # no template: apply_chat_template says so in its own words
            return None
        try:
            known = cls._by_tokenizer.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable
            return None
        if template not in known:
            known[template] = cls._build(tokenizer, template)
        renderer = known[template]
        if renderer is not None and renderer.source != _special_source(tokenizer):
            # the caller changed the tokenizer's special tokens: render with the new ones,
            # checked against apply_chat_template again
            renderer = known[template] = cls._build(tokenizer, template)
        return renderer

    @classmethod
    def _build(cls, tokenizer: Any, template: str) -> _DirectRenderer | None:
        try:
            source = dict(_special_source(tokenizer))  # a copy: the tokenizer's map changes in place
            variables = dict(tokenizer.special_tokens_map)
            if not plain_data(variables):  # transformers would copy them into plain data: its own path
                return None
            renderer = cls(template, compile_template(template), variables)
            renderer.source = source
            return renderer
        except Exception:  # a template our sandbox cannot compile: apply_chat_template's verdict stands
            return None

    def render(
        self,
        tokenizer: Any,
        messages: list[dict],
        plain: list[dict],
        generation: bool,
        tools: list[dict] | None,
        memo: RenderMemo | None = None,
    ) -> str:
        if self.timed_out is not None:
            raise RenderTimeout(self.timed_out)
        if self.agreed:
            return self._render(plain, generation, tools, memo)
        # ours first, under the time bound: a template that never ends is refused before
        # apply_chat_template (which has none) is asked
        try:
            ours: str | None = self._render(plain, generation, tools, memo)
        except RenderTimeout:
            raise
        except Exception:
            ours = None
        reference = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, tools=tools
        )
        if ours == reference:
            self.agreed = True
        else:  # this transformers renders otherwise: its own path from now on
            _DirectRenderer._by_tokenizer[tokenizer][self.template] = None
            if ours is not None:
                verify.disagreed(verify.TEMPLATE_SANDBOX, "the first render differs from apply_chat_template's")
        return reference

    def _render(self, plain: list[dict], generation: bool, tools: list[dict] | None, memo: RenderMemo | None) -> str:
        _clock.deadline = time.monotonic() + RENDER_SECONDS
        _clock.json = None if memo is None else memo.json
        try:
            return self.compiled.render(
                messages=plain, tools=tools, documents=None, add_generation_prompt=generation, **self.variables
            )
        except RenderTimeout as exc:
            self.timed_out = str(exc)
            raise
        finally:
            _clock.deadline = _clock.json = None


# --------------------------------------------------------------------------- our sandbox


@functools.lru_cache(maxsize=64)
def compile_template(template: str) -> jinja2.Template:
    """``template`` compiled in a :class:`ChatSandbox` of its own (one per template, as
    transformers does; the few templates of a process are compiled once)."""
    return ChatSandbox().from_string(template)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: no HTML escaping (Jinja's own filter escapes), with json.dumps' options
    memo = getattr(_clock, "json", None)  # a render's RenderMemo.json: a tool call's arguments once per episode
    if memo is None or type(x) not in (dict, list):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    key: tuple[Any, ...] | None = (
        id(x),
        ensure_ascii,
        indent,
        tuple(separators) if type(separators) in (list, tuple) else separators,
        sort_keys,
    )
    try:
        hit = memo.get(key)
    except TypeError:  # options that cannot be a key: not kept
        hit, key = None, None
    if hit is not None and hit[0] is x:
        return hit[1]
    text = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if key is not None:
        memo[key] = (x, text)
    return text


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template: builds dicts, exposes nothing of the type (as transformers')."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore names (as transformers'): no way to CPython's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers' tag also
    records where, for assistant masks; nothing here asks for them)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


# Every attribute a dict instance has: all of them come from its type (a dict has no __dict__).
_DICT_ATTRIBUTES = frozenset(dir(dict))
# jinja2's own lookup and call, for everything the fast paths leave to the sandbox (named
# once: a template makes tens of thousands of these calls per render, super() each time adds up)
_sandboxed_getattr = ImmutableSandboxedEnvironment.getattr
_sandboxed_call = ImmutableSandboxedEnvironment.call


class ChatSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox as transformers configures it for chat templates, with the
    same answers reached in less work:

    * ``is_safe_attribute`` memoized per (type, name): jinja2's own implementations read only
      the object's type and the name (``value`` is unused), and rendering a 200-message
      conversation spends about half its time there otherwise;
    * ``getattr``: ``message.role`` on a plain dict goes to the key directly for every name
      a dict has no attribute of (the sandbox first tries the attribute, which raises
      AttributeError: about a third of a render); a str's safe methods are looked up once
      per name, not checked each time; an attribute whose (type, name) was judged safe before
      (``loop.index0``, a namespace's fields: a third of the lookups left) is read directly;
    * ``call``: a str's own methods (``content.split('</think>')``: nearly every call a Qwen3
      render makes) are called directly. The sandbox's verdict on them is always yes (a
      builtin method carries no ``unsafe_callable`` / ``alters_data`` mark) and Jinja's
      ``Context.call`` passes no context to a builtin, so both are skipped; the loop and block
      variables the compiled template hands every call are dropped, as ``Context.call``
      drops them.

    Everything else goes through the sandbox as jinja2 wrote it."""

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace
        self.globals["range"] = _BoundedRange
        self._verdicts: dict[tuple[type, str], bool] = {}
        self._calls = 0
        self._safe_str = frozenset(
            name
            for name in dir(str)
            if name not in ("format", "format_map") and self.is_safe_attribute("", name, getattr("", name))
        )

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
        return verdict

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(attribute) is str:
            if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except LookupError:
                    return self.undefined(obj=obj, name=attribute)
            if type(obj) is str and attribute in self._safe_str:
                return getattr(obj, attribute)
            if self._verdicts.get((type(obj), attribute)):
                # judged safe before (``loop.index0``, ``ns.last_query_index``): the sandbox would
                # read the attribute and return it; only a missing one goes its longer way
                try:
                    return getattr(obj, attribute)
                except AttributeError:
                    pass
        return _sandboxed_getattr(self, obj, attribute)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        # positional-only, as jinja2's: a call's own keyword arguments may be named obj or context
        self._calls += 1
        if not self._calls & 1023:
            _check_deadline()
        if type(obj) is BuiltinMethodType and type(obj.__self__) is str:
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            return obj(*args, **kwargs)
        return _sandboxed_call(self, context, obj, *args, **kwargs)
