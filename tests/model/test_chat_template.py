"""A chat template is untrusted code from a model file (``minicb.model.text.chat_template``): it renders
like ``transformers`` renders it when it is well-behaved, and when it is not, it stops within its
limits (steps, work, size, memory: counts, never the clock) with a minicb error instead of running
for hours, allocating terabytes or leaking a Jinja2 exception.

Every hostile template below ran unbounded (or raised a bare ``jinja2`` / ``ZeroDivisionError``)
before the limits existed. A template that never returns would hang the suite, so each render runs
in a daemon thread that must finish within a generous bound (``finishes``: a hang guard, not a
limit). The memory limit is lowered for these tests (64 MiB) so that the memory case costs little.
"""

from __future__ import annotations

import sys

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from minicb.core.errors import InvalidArgument, MinicbError, ModelLoadError
from minicb.model.text import chat_template as ct
from minicb.model.text.tokenizer import Tokenizer
from robust_helpers import finishes
from tokenizer_fixtures import CHATML, tiny_gguf_tokenizer_metadata

MESSAGES = [{"role": "user", "content": "hi"}]
DEFAULT_MEMORY = ct.MAX_RENDER_MEMORY     # read before any test lowers it


@pytest.fixture(autouse=True)
def small_limits(monkeypatch):
    monkeypatch.setattr(ct, "MAX_RENDER_MEMORY", 64 * 2**20)


def render(source: str, messages=MESSAGES):
    """``ct.render`` in a bounded thread; also checks that the thread's tracer is restored after it."""

    def run():
        before = sys.gettrace()
        try:
            return ct.render(source, messages=messages, add_generation_prompt=True, bos_token="<s>",
                             eos_token="</s>", pad_token=None)
        finally:
            assert sys.gettrace() is before, "the step guard's tracer was left installed"

    return finishes(run)


# (template, expected error class, words the one-line message holds)
HOSTILE = {
    # steps: loops the sandbox allows (range is capped at 100,000 but nesting multiplies)
    "nested ranges": ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}"
                      "{% endfor %}{% endfor %}{% endfor %}", ModelLoadError, ["more than 200,000 steps"]),
    "nested lists": ("{% set x = range(1000)|list %}{% for a in x %}{% for b in x %}{% for c in x %}"
                     "{% endfor %}{% endfor %}{% endfor %}", ModelLoadError, ["more than 200,000 steps"]),
    # work: a 2 MB string rebuilt (and thrown away) on every step of a loop, by '~' and by '+'
    "rebuild by ~": ("{% set big = 'x' * 1000000 %}{% for i in range(100000) %}{% set t = big ~ big %}"
                     "{% endfor %}", InvalidArgument, ["builds more than 134,217,728 characters in all"]),
    "rebuild by +": ("{% set big = 'x' * 1000000 %}{% for i in range(100000) %}{% set t = big + big %}"
                     "{% endfor %}", InvalidArgument, ["builds more than 134,217,728 characters in all"]),
    "one ~ too big": ("{% set big = 'x' * 2000000 %}{{ big ~ big }}", InvalidArgument,
                      ["'~'", "would build"]),
    # size, refused before anything is allocated
    "repeat": ("{{ 'x' * 10**12 }}", InvalidArgument, ["repeats", "times"]),
    "repeat list": ("{{ ([1] * 100000) * 100000 }}", InvalidArgument, ["repeats"]),
    "power": ("{{ 7 ** 99999999 }}", InvalidArgument, ["65,536 bits"]),
    "percent width": ("{{ '%999999999s' % 'x' }}", InvalidArgument, ["'%'", "would build"]),
    "format width": ("{{ '{:>999999999}'.format('x') }}", InvalidArgument, ["'.format()'"]),
    "format filter": ("{{ '%999999999s'|format('x') }}", InvalidArgument, ["filter 'format'"]),
    "center filter": ("{{ 'x'|center(10**9) }}", InvalidArgument, ["capped at"]),
    "center method": ("{{ 'x'.center(10**9) }}", InvalidArgument, ["capped at"]),
    "join": ("{{ (range(100000)|list)|join('x' * 100000) }}", InvalidArgument, ["filter 'join'"]),
    "replace": ("{{ ('x' * 100000)|replace('x', 'x' * 100000) }}", InvalidArgument, ["filter 'replace'"]),
    "replace method": ("{{ ('x' * 100000).replace('x', 'y' * 1000) }}", InvalidArgument, ["'.replace()'"]),
    "expandtabs": ("{{ ('\\t' * 100000).expandtabs(100000) }}", InvalidArgument, ["'.expandtabs()'"]),
    "translate": ("{{ ('a' * 100000).translate(''.maketrans({'a': 'b' * 100000})) }}", InvalidArgument,
                  ["'.translate()'"]),
    "indent": ("{{ ('\\n' * 1000000)|indent(100000) }}", InvalidArgument, ["filter 'indent'"]),
    "sum of lists": ("{% set x = [1] * 1000000 %}{{ ([x] * 1000)|sum(start=[])|length }}", InvalidArgument,
                     ["filter 'sum'"]),
    "tojson indent": ("{{ (range(10)|list)|tojson(indent=100000) }}", InvalidArgument, ["filter 'tojson'"]),
    "doubling in a namespace": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
                                InvalidArgument, ["'~'", "would build"]),
    "output": ("{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}", InvalidArgument,
               ["output exceeds"]),
    "doubling by lines": ("{% set s = 'ab' %}" + "{% set s = s ~ s %}" * 45 + "{{ s|length }}",
                          InvalidArgument, ["'~'", "would build"]),
    # memory: 60 lists of 100,000 new ints (~3.6 MB each), every one within the size and work limits,
    # all kept
    "many big values": ("".join(f"{{% set a{i} = range(100000)|list %}}" for i in range(60))
                        + "{{ a0|length }}", ModelLoadError, ["MiB of memory"]),
    # errors of the template itself
    "raise_exception": ("{{ raise_exception('Conversation roles must alternate') }}", InvalidArgument,
                        ["rejects these messages", "Conversation roles must alternate"]),
    "undefined call": ("{{ foo.bar() }}", ModelLoadError, ["UndefinedError", "'foo' is undefined"]),
    "undefined attribute": ("{{ messages[0].nope.deeper }}", ModelLoadError, ["UndefinedError"]),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ModelLoadError, ["recurses"]),
    "division by zero": ("{{ 1 / 0 }}", ModelLoadError, ["ZeroDivisionError"]),
    "sandbox escape": ("{{ ''.__class__.__mro__ }}", ModelLoadError, ["SecurityError"]),
    "syntax": ("{% for %}", ModelLoadError, ["not valid Jinja2"]),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_stops_with_a_minicb_error(name):
    source, error, needles = HOSTILE[name]
    result = render(source)
    assert isinstance(result, error), (name, result)
    msg = str(result)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("name", ["repeat", "raise_exception", "undefined call"])
def test_errors_reach_the_tokenizer_caller_as_minicb_errors(name):
    source, error, needles = HOSTILE[name]
    tok = Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata(**{"tokenizer.chat_template": source}))
    result = finishes(lambda: tok.apply_chat_template("hi"))
    assert isinstance(result, error) and not isinstance(result, jinja2.TemplateError), result


def plain_render(source: str, **context) -> str:
    """What ``transformers`` does: the same sandbox and settings, no limits."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = ct._tojson
    return env.from_string(source).render(**context)


# Real templates' idioms: ChatML, a system default, loop.last, tojson of tools, namespace counters.
WELL_BEHAVED = [
    CHATML,
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set sys = 'You are helpful.' %}{% set rest = messages %}"
    "{% endif %}<<SYS>>{{ sys }}<</SYS>>{% for m in rest %}[{{ m['role'] | upper }}] "
    "{{ m['content'] | trim }}{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
    "{{ messages | map(attribute='content') | join(' | ') }}{{ ', '.join(messages | map(attribute='role')) }}"
    "{{ messages | map(attribute='content') | map('length') | sum }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m['content']|length %}"
    "{{ loop.index }}:{{ m['content'] | replace('\\n', ' ') | indent(2) }}{% endfor %}"
    "{{ ns.n }} {{ messages | map(attribute='role') | join(',') }} {{ messages[:1] | tojson(indent=2) }}",
]


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(WELL_BEHAVED),
       st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                       "content": st.text(max_size=200)}), min_size=1, max_size=6))
def test_a_well_behaved_template_renders_exactly_as_without_limits(source, messages):
    context = dict(messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                   pad_token=None)
    assert ct.render(source, **context) == plain_render(source, **context)


def test_the_memory_guard_sees_a_render_grow_below_the_process_s_old_peak():
    """The guard measures what the render adds to the resident memory *now*: after the process held
    and freed 512 MiB, a doubling string is stopped 64 MiB above where the render began, not 64 MiB
    above that old peak (a guard on the peak, ``ru_maxrss``, let it grow unseen to the old peak: after
    the suite's larger tests that was gigabytes, and once the machine's whole memory). So the process's
    peak does not move."""
    import resource

    held = b"x" * (512 * 2**20)           # every page written, so resident; freed at once (munmap)
    del held
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    source, error, needles = HOSTILE["many big values"]
    result = render(source)
    assert isinstance(result, error) and "MiB of memory" in str(result), result
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss == peak


@pytest.mark.timing
def test_a_long_conversation_is_not_mistaken_for_an_attack(monkeypatch):
    """The most messages a server accepts (``--max-messages``, 1,024), and one message of a million
    characters, render under the default limits, the step count included, however busy the machine
    (``python tests/under_hog.py`` runs this under a CPU hog: a 2 s wall-clock limit used to refuse
    this chat under load, issue 46)."""
    from minicb.entrypoints.serve.limits import ServeLimits

    monkeypatch.setattr(ct, "MAX_RENDER_MEMORY", DEFAULT_MEMORY)
    many = [{"role": "user", "content": "hello there " * 20}] * ServeLimits().max_messages
    long = [{"role": "user", "content": "word " * 200_000}]
    for messages in (many, long):
        result = finishes(lambda m=messages: ct.render(CHATML, messages=m, add_generation_prompt=True))
        assert result == plain_render(CHATML, messages=messages, add_generation_prompt=True)


def test_messages_the_template_cannot_use_are_refused_before_rendering():
    tok = Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata())
    for messages in ([{"role": "user", "content": 5}], [{"role": None, "content": "x"}],
                     [{"role": "user", "content": ["a", "list"]}]):
        with pytest.raises(InvalidArgument, match="messages must be"):
            tok.apply_chat_template(messages)
    with pytest.raises(InvalidArgument, match="add_generation_prompt must be a bool"):
        tok.apply_chat_template("hi", add_generation_prompt="yes")


def test_every_error_is_a_minicb_error_and_a_value_error():
    for source, _, _ in HOSTILE.values():
        result = render(source)
        assert isinstance(result, MinicbError) and isinstance(result, ValueError), result


def test_the_step_limit_is_a_count_of_template_lines(monkeypatch):
    """The same template and messages are accepted or refused by the count alone: a loop of ``n``
    empty iterations runs a fixed number of lines per iteration, so with the limit set just above
    what ``n`` iterations need it passes, and one more iteration makes it fail, on any machine."""
    loop = "{% for i in range(n) %}{% endfor %}"

    def steps(n: int) -> int:
        guards = []
        real = ct._Guard

        class Counting(real):
            def __init__(self):
                super().__init__()
                guards.append(self)

        monkeypatch.setattr(ct, "_Guard", Counting)
        ct.render(loop, n=n)
        monkeypatch.setattr(ct, "_Guard", real)
        return guards[0].lines

    per_iteration = steps(101) - steps(100)
    assert per_iteration >= 1 and steps(1000) - steps(100) == 900 * per_iteration
    monkeypatch.setattr(ct, "MAX_RENDER_STEPS", steps(1000))
    assert ct.render(loop, n=1000) == ""
    with pytest.raises(ModelLoadError, match=f"ran more than {steps(1000):,} steps"):
        ct.render(loop, n=1001)
