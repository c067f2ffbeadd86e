"""Chat templates: a model file's Jinja2 program, run as the untrusted code it is.

A chat-tuned model expects its prompt wrapped in special markers (ChatML's ``<|im_start|>user ...
<|im_end|>``). The model file says how, as a Jinja2 template (``tokenizer.chat_template`` in a GGUF,
``chat_template`` in ``tokenizer_config.json``), rendered with the conversation::

    render(template_source, messages=[{"role": "user", "content": "Hi"}],
           add_generation_prompt=True, bos_token=..., eos_token=..., pad_token=...)

Whoever made the file wrote that program, so minicb runs it the way ``transformers`` does, in
Jinja2's ``ImmutableSandboxedEnvironment`` (no access to Python internals, inputs cannot be mutated;
``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``), and adds the
limits a sandbox alone does not have. A sandbox stops a template from *reaching* anything; it does
not stop it from looping for hours (``range`` is capped at 100,000, but four nested loops are 10**20
iterations) or from building a string of terabytes (``'x' * 10**12``, or doubling a string 40 times).
So a render is bounded three ways, all of them **counts**, never the clock: whether a conversation is
accepted must not depend on how busy the machine is (a wall-clock limit of 2 s refused the 1,024-message
chat a server allows whenever the CPUs were busy, and passed it when they were quiet):

* **steps**: at most ``MAX_RENDER_STEPS`` lines of the template's own code. Jinja2 compiles a template
  to Python, so ``sys.settrace`` sees every line the template runs (not the library code it calls) and
  stops it past the count: a loop with an empty body is still a line per iteration. A real template
  runs about 7 lines per message (``python bench/chat_template_steps.py``), so the limit leaves every
  template ~28 times what SmolLM2's needs for the most messages a server accepts;
* **work**: the characters all the operations below build in one render (kept or thrown away) are
  added up, and stop at ``MAX_RENDER_WORK``, so a loop cannot rebuild a 2 MB string on each of its
  steps either;
* **size**: no value the template builds and no output may exceed ``MAX_RENDER_CHARS``. Every
  operation that can *multiply* sizes in one C-level step (``*``, ``+``, ``**``, ``%``, ``~``, and the
  filters and ``str`` methods in ``_FILTER_SIZES`` / ``_METHOD_SIZES``: ``join``, ``replace``,
  ``indent``, ``center``, ``format``, ``sum``, ...) has its worst-case result size computed from its
  arguments *before* it runs, because a check afterwards would come after the gigabytes were
  allocated; every call, filter result, attribute read and output piece is checked after, and
  integer arguments of calls and filters are capped at ``MAX_INT_ARGUMENT``;
* **memory**: what the render adds to the process's resident memory is checked on every 8th
  template line against ``MAX_RENDER_MEMORY`` (anything the size checks miss).

(``a ~ b`` is compiled to a call of ``str_join`` that the sandbox cannot intercept, so
``compile_template`` replaces that name in the compiled template's namespace with a checked one.)

What goes wrong becomes one of minicb's errors, so a caller never sees a Jinja2 exception:

===============================================  ==================================================
the template calls ``raise_exception(msg)``      ``InvalidArgument``: it rejects these messages
output (or a value, or the work) over its limit  ``InvalidArgument``: the conversation is too long
invalid Jinja2 syntax                            ``ModelLoadError``: the model file is broken
over the steps or memory, a sandbox violation,   ``ModelLoadError``: the model's template is broken
undefined name used as a value, any other error
===============================================  ==================================================
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import re
import sys
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache

from minicb.core.errors import InvalidArgument, MinicbError, ModelLoadError, describe

try:                         # the memory guard's fallback where /proc is missing (POSIX only)
    import resource
except ImportError:          # pragma: no cover - Windows
    resource = None

MAX_RENDER_STEPS = 200_000           # template lines per render: ~7 per message in a real template
MAX_RENDER_CHARS = 2**21             # = tokenizer.MAX_TEXT_CHARS: longer text cannot be encoded anyway
MAX_RENDER_WORK = 64 * MAX_RENDER_CHARS   # characters the checked operations may build in one render
MAX_RENDER_MEMORY = 256 * 2**20      # bytes a render may add to the process's resident memory
MAX_INT_ARGUMENT = 100_000           # Jinja2's own cap on range(); widths and indents of that size
_TEMPLATE_FILE = "<template>"        # the file name Jinja2 gives code compiled from a string


class _Rejected(Exception):
    """``raise_exception(message)`` inside a template: the template refuses its input."""


def render(source: str, **context) -> str:
    """Render the chat template ``source`` with ``context`` (``messages``, ``add_generation_prompt``,
    special tokens) under the limits of the module docstring. Raises only ``MinicbError``s."""
    template = compile_template(source)
    guard = _Guard()
    previous = sys.gettrace()
    token = _GUARD.set(guard)
    sys.settrace(guard.on_call)
    try:
        pieces: list[str] = []
        size = 0
        for piece in template.generate(**context):
            size += len(piece)
            guard.built(len(piece))
            if size > MAX_RENDER_CHARS:
                raise InvalidArgument(f"the chat template's output exceeds {MAX_RENDER_CHARS:,} characters "
                                      "(the most minicb encodes); shorten the messages")
            pieces.append(piece)
        return "".join(pieces)
    except MinicbError:
        raise
    except _Rejected as e:
        raise InvalidArgument(f"the model's chat template rejects these messages: {_one_line(e)}") from None
    except RecursionError:
        raise ModelLoadError("the model's chat template recurses without end") from None
    except MemoryError:
        raise ModelLoadError("the model's chat template ran out of memory") from None
    except Exception as e:  # noqa: BLE001 - a template can raise anything; the caller gets one error class
        raise ModelLoadError(f"the model's chat template failed: {type(e).__name__}: "
                             f"{_one_line(e)}") from None
    finally:
        sys.settrace(previous)
        _GUARD.reset(token)


@lru_cache(maxsize=8)
def compile_template(source: str):
    """Compile ``source`` in the limited sandbox (cached: a model's template is compiled once)."""
    import jinja2

    if not isinstance(source, str):
        raise ModelLoadError(f"a chat template must be text, got {type(source).__name__}")
    env = _limited_sandbox()
    try:
        template = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat_template is not valid Jinja2: {_one_line(e)}") from None
    except (RecursionError, MemoryError) as e:   # absurdly deep nesting in the source
        raise ModelLoadError(f"the model's chat_template cannot be compiled: {type(e).__name__}") from None
    namespace = template.root_render_func.__globals__     # the compiled module's names, macros' too
    for name in ("str_join", "markup_join"):
        namespace[name] = _checked_join(namespace[name])
    return template


def _checked_join(join):
    """Jinja2's ``str_join`` / ``markup_join`` (what ``a ~ b`` compiles to), with the size of the
    result checked before it is built and counted as work."""

    @functools.wraps(join)
    def checked(seq):
        parts = list(seq)
        _check_estimate(sum(len(p) if isinstance(p, str) else len(str(p)) for p in parts), "'~'")
        return _sized(join(parts), "'~'", built=True)

    return checked


class _Guard:
    """The step, work and memory limits of one render: steps and memory checked on the template's own
    lines (memory on every 8th), work added up by every checked operation (``built``).

    ``sys.settrace`` is per thread and is put back as it was after the render: a debugger or a
    coverage tool tracing this thread sees nothing of the render itself, and everything else."""

    def __init__(self) -> None:
        self.rss0 = _resident_bytes()
        self.lines = 0
        self.work = 0

    def on_call(self, frame, event, arg):
        """``sys.settrace``'s global hook: trace lines only in frames of compiled template code."""
        if frame.f_code.co_filename != _TEMPLATE_FILE:
            return None
        self.check()
        return self.on_line

    def on_line(self, frame, event, arg):
        self.check()
        return self.on_line

    def check(self) -> None:
        self.lines += 1
        if self.lines > MAX_RENDER_STEPS:
            raise ModelLoadError(f"the model's chat template ran more than {MAX_RENDER_STEPS:,} steps "
                                 "(template lines; an endless or enormous loop?)")
        if self.lines % 8:        # a line cannot allocate much; look at memory every 8th
            return
        if self.rss0 is not None and _resident_bytes() - self.rss0 > MAX_RENDER_MEMORY:
            raise ModelLoadError(f"the model's chat template used more than {MAX_RENDER_MEMORY // 2**20} MiB "
                                 "of memory")


    def built(self, chars: int) -> None:
        """Count ``chars`` characters built by an operation of the template (or output)."""
        self.work += chars
        if self.work > MAX_RENDER_WORK:
            raise InvalidArgument(f"the chat template builds more than {MAX_RENDER_WORK:,} characters in "
                                  "all for these messages; shorten them")


_GUARD: contextvars.ContextVar[_Guard | None] = contextvars.ContextVar("chat_template_guard", default=None)


def _resident_bytes() -> int | None:
    """The process's resident memory now (Linux: ``/proc/self/statm``). Where that file is missing, its
    peak instead (``ru_maxrss``), which is blind to a render's growth until it passes the highest
    resident memory the process ever had: a process that once held gigabytes and freed them would let a
    render take as much again unseen."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    if resource is None:
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss      # kilobytes on Linux (bytes on macOS)
    return kb if sys.platform == "darwin" else kb * 1024


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _sized(value, what: str, built: bool = False):
    """``value`` if it is not a sequence longer than ``MAX_RENDER_CHARS``; ``built``: it is a new value
    an operation made, whose size counts as the render's work (a value read is not)."""
    if isinstance(value, (str, bytes, list, tuple, dict)):
        if len(value) > MAX_RENDER_CHARS:
            raise InvalidArgument(f"the chat template builds a value of {len(value):,} items in {what} "
                                  f"(at most {MAX_RENDER_CHARS:,})")
        guard = _GUARD.get() if built else None
        if guard is not None:
            guard.built(len(value))
    return value


def _check_int_args(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARGUMENT:
            raise InvalidArgument(f"the chat template passes {describe(a)} to {what}; integer arguments "
                                  f"are capped at {MAX_INT_ARGUMENT:,}")


def _limited_sandbox():
    """An ``ImmutableSandboxedEnvironment`` whose operators, calls, attribute reads and filters check
    sizes (see the module docstring), with the globals ``transformers`` gives chat templates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return _sized(super().call_binop(context, operator, left, right), f"'{operator}'", built=True)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja2's own signature
            _check_int_args(args, kwargs, "a call")
            args = _check_method(__obj, args, kwargs)
            return _sized(super().call(__context, __obj, *args, **kwargs), "a call's result", built=True)

        def getattr(self, obj, attribute):
            return _sized(super().getattr(obj, attribute), "an attribute")

        def getitem(self, obj, argument):
            return _sized(super().getitem(obj, argument), "an item")

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _check_binop(operator: str, left, right) -> None:
    """Refuse ``'x' * 10**12``, ``a + b`` past the size limit and ``10 ** 10**9`` before computing."""
    seqs = (str, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, seqs) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_RENDER_CHARS:
                raise InvalidArgument(f"the chat template repeats a value of {len(seq):,} items "
                                      f"{describe(n)} times (at most {MAX_RENDER_CHARS:,} items)")
    elif operator == "+":
        if isinstance(left, seqs) and isinstance(right, seqs) and len(left) + len(right) > MAX_RENDER_CHARS:
            raise InvalidArgument(f"the chat template concatenates past {MAX_RENDER_CHARS:,} items")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
            and right > 0 and right * abs(left).bit_length() > 64 * 1024:
        raise InvalidArgument(f"the chat template computes {describe(left)} ** {describe(right)}, an "
                              "integer of more than 65,536 bits")
    elif operator == "%" and isinstance(left, str):
        _check_estimate(_format_size(left, right if isinstance(right, tuple) else (right,)), "'%'")


def _check_estimate(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise InvalidArgument(f"{what} in the chat template would build about {size:,} characters "
                              f"(at most {MAX_RENDER_CHARS:,})")


def _check_method(obj, args: tuple, kwargs) -> tuple:
    """A ``str`` method from ``_METHOD_SIZES`` (``'x'.center(n)``, ``sep.join(items)``, ...):
    its worst-case result size, before it runs. The sandbox hands ``str.format`` over wrapped;
    ``__wrapped__`` is the original bound method. Returns the arguments to call it with (an iterator
    argument is read into a list once, so that the estimate does not use it up)."""
    target = getattr(obj, "__wrapped__", obj)
    subject, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if isinstance(subject, str) and name in _METHOD_SIZES:
        args = _materialised(args)
        try:
            size = _METHOD_SIZES[name](subject, *args, **kwargs)
        except TypeError:                 # wrong arguments: let the call itself say so
            return args
        _check_estimate(size, f"'.{name}()'")
    return args


def _materialised(args) -> tuple:
    return tuple(list(a) if isinstance(a, Iterator) else a for a in args)


# --- worst-case result sizes of the operations that multiply ----------------------------------------
def _n(x) -> int:
    """A size for estimates: the length of a sized value, else the length of its text (capped)."""
    if isinstance(x, (str, list, tuple, dict)):
        return len(x)
    return 32 if isinstance(x, (int, float, bool)) or x is None else min(len(str(x)), MAX_RENDER_CHARS + 1)


def _width(w) -> int:
    return len(w) if isinstance(w, str) else w if isinstance(w, int) else 0


def _format_size(fmt: str, values) -> int:
    """``fmt % values`` or ``fmt.format(*values)``: the text, the values, and every number written in
    the format string taken as a width (``%999999s``, ``{:>999999}``)."""
    widths = sum(int(d) for d in re.findall(r"\d{1,12}", fmt))
    return len(fmt) + widths + sum(_n(v) for v in values)


def _join_size(sep: str, items) -> int:
    items = list(items) if not isinstance(items, (list, tuple, str)) else items
    return len(sep) * max(len(items) - 1, 0) + sum(_n(i) for i in items)


def _replace_size(s: str, old: str, new: str, count=None) -> int:
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _wrap_size(s: str, width: int, wrapstring: str) -> int:
    """At most one break per ``width`` characters plus one per space or newline (a word can end a line)."""
    breaks = len(s) // max(width, 1) + s.count(" ") + s.count("\n") + 1
    return len(s) + breaks * len(wrapstring)


def _sum_size(items, start=0) -> int:
    if isinstance(start, (str, list, tuple)):
        return _n(start) + sum(_n(i) for i in items)
    return 0


_FILTER_SIZES = {   # filter name -> worst-case size of its result from its arguments
    "center": lambda value, width=80: max(_n(value), _width(width)),
    "indent": lambda s, width=4, first=False, blank=False: _n(s) + (str(s).count("\n") + 1) * _width(width),
    "join": lambda value, d="", attribute=None: _join_size(d if isinstance(d, str) else "", value),
    "replace": lambda s, old, new, count=None: _replace_size(str(s), str(old), str(new), count),
    "format": lambda value, *args, **kwargs: _format_size(str(value), (*args, *kwargs.values())),
    "sum": lambda iterable, attribute=None, start=0: _sum_size(iterable, start),
    "tojson": lambda value, indent=None, **kw: 0 if indent is None or _width(indent) <= 64 else 2**62,
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True:
        _wrap_size(str(s), _width(width), wrapstring or "\n"),
}
_METHOD_SIZES = {   # str method name -> worst-case size of its result (subject first)
    "center": lambda s, width, fill=" ": max(len(s), _width(width)),
    "ljust": lambda s, width, fill=" ": max(len(s), _width(width)),
    "rjust": lambda s, width, fill=" ": max(len(s), _width(width)),
    "zfill": lambda s, width: max(len(s), _width(width)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(_width(tabsize), 0),
    "join": lambda s, items: _join_size(s, items),
    "replace": lambda s, old, new, count=-1: _replace_size(s, str(old), str(new), count),
    "format": lambda s, *args, **kwargs: _format_size(s, (*args, *kwargs.values())),
    "format_map": lambda s, mapping: _format_size(s, tuple(mapping.values()) if hasattr(mapping, "values")
                                                   else ()),
    "translate": lambda s, table: len(s) * max([1] + [_n(v) for v in getattr(table, "values", list)()]),
}


def _guard_filter(name: str, f):
    """``f`` with the integer-argument and result-size checks (``wraps`` keeps Jinja2's
    pass_context / pass_eval_context marks, which live in the function's ``__dict__``)."""

    estimate = _FILTER_SIZES.get(name)

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        _check_int_args(args, kwargs, f"the filter '{name}'")
        if estimate is not None:
            args = _materialised(args)       # join(map(...)): read the generator once, for both
            plain = [a for a in args if not _is_jinja_context(a)]     # Jinja2 passes its context first
            try:
                size = estimate(*plain, **kwargs)
            except TypeError:             # wrong arguments: let the filter itself say so
                size = 0
            _check_estimate(size, f"the filter '{name}'")
        return _sized(f(*args, **kwargs), f"the filter '{name}'", built=True)

    return guarded


def _is_jinja_context(x) -> bool:
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(x, (Environment, EvalContext, Context))


def _raise_exception(message):
    raise _Rejected(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300]
