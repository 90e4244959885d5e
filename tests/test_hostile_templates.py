"""Hostile chat templates (issue 32). A chat template is code shipped in the model file, so
every render keeps to limits (modeling/text/chat_template.py): steps (loop iterations, calls,
filters), wall time, the size of any value it makes, what it writes, how deep it nests
values and calls. A template that passes one stops itself, quickly and without taking the
machine's memory, with an error naming the limit; the daemon answers the request with a 400
naming the model's chat template and goes on serving the others."""

from __future__ import annotations

import http.client
import json
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings
from modeling.checkpoints.gguf_file import read_gguf
from modeling.text.chat_template import (
    MAX_CALL_DEPTH,
    MAX_STEPS,
    MAX_VALUE_SIZE,
    TemplateLimitError,
    compile_template,
)
from modeling.text.model_template import FALLBACK_CHAT_TEMPLATE, ChatTemplateError
from modeling.text.tokenizer import Tokenizer
from tests.templated import templated_copy
from tests.test_tool_formats import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE

MESSAGES = [{"role": "user", "content": "hi"}]
STEPS = "steps"
TIME = "s in one render"
VALUE = "value of more than"
WRITTEN = "wrote more than"
BITS = "bits"
DEEP = "deep"
LOOKED_FOR = "characters to look for"
CODEC = "written in Python"
CUT = "would cut a word"
BIG = 2_000_000_000

# (template, what the error says). Each would hang a thread or take gigabytes unlimited.
HOSTILE = [
    # Loops that write nothing, and recursion.
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", STEPS),
    ("{% for i in range(100000) %}{% for m in messages * 100 %}{% endfor %}{% endfor %}", STEPS),
    ("{% for i in range(100000) %}{% for c in 'abcdefghij' %}{% endfor %}{% endfor %}", STEPS),
    ("{% for i in range(100000) %}{{ range(100000)|select('odd')|list|length }}{% endfor %}",
     f"{STEPS}|{TIME}"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", DEEP),
    ("{% for x in [[1]] recursive %}{{ loop([[1]]) }}{% endfor %}", DEEP),
    # Exponential work with no long loop at all: only the clock stops it.
    ("{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}"
     "{{ f(0) }}", TIME),
    # No loop, no call: comparing two big lists, in a long template.
    ("{% set a = range(100000)|list %}{% set b = range(100000)|list %}"
     + "{% if a == b %}{% endif %}" * 5000, TIME),
    # Huge values from small ones.
    (f"{{{{ 'x' * {BIG} }}}}", VALUE),
    (f"{{{{ {BIG} * ['x'] }}}}", VALUE),
    (f"{{{{ 'x'|center({BIG}) }}}}", VALUE),
    (f"{{{{ '%{BIG}s'|format(1) }}}}", VALUE),
    (f"{{{{ '%.{BIG}f' % 1.5 }}}}", VALUE),
    (f"{{{{ '%*d' % ({BIG}, 1) }}}}", VALUE),
    (f"{{{{ '{{:{BIG}}}'.format(1) }}}}", VALUE),
    (f"{{{{ '{{:{{w}}}}'.format(1, w={BIG}) }}}}", VALUE),
    ("{{ ('{0}' * 1000).format('x' * 100000) }}", VALUE),
    (f"{{{{ 'x'.ljust({BIG}) }}}}", VALUE),
    (f"{{{{ 'x'.zfill({BIG}) }}}}", VALUE),
    (f"{{{{ 'x\\t'.expandtabs({BIG}) }}}}", VALUE),
    ("{{ ('x' * 4000000).replace('', 'yyyyyyyy') }}", VALUE),
    ("{{ ('x' * 1000000)|replace('x', 'yyyyyyyy') }}", VALUE),
    ("{{ ('x' * 100).translate({120: 'y' * 1000000}) }}", VALUE),
    ("{{ range(100000)|join('x' * 1000000) }}", VALUE),
    ("{{ ('y' * 1000000).join(range(100000)|map('string')) }}", VALUE),
    (f"{{{{ 'x'|indent({BIG}, true) }}}}", VALUE),
    ("{{ ('a\n' * 1000000)|indent(100) }}", VALUE),
    ("{{ ('a ' * 1000000)|wordwrap(1, wrapstring='x' * 1000) }}", VALUE),
    ("{{ range(100000)|map('center', 4000000)|list|length }}", VALUE),
    ("{% for s in range(100000)|map('center', 4000000) %}{{ loop.length }}{% endfor %}", VALUE),
    ("{% set big = ['x'] * 500000 %}{{ ([[['y']]] * 100000)|map('sum', start=big)|list }}", VALUE),
    (f"{{{{ [1]|batch({BIG}, 'x')|list }}}}", VALUE),
    (f"{{{{ [1]|slice({BIG})|list }}}}", VALUE),
    (f"{{{{ range(100000)|tojson(indent={BIG}) }}}}", VALUE),
    (f"{{{{ (1).to_bytes({BIG}, 'big') }}}}", VALUE),
    ("{{ 10 ** (10 ** 10) }}", BITS),
    # Several pieces of one big string joined by `~`, a key in parentheses hiding a width.
    ("{% set s = 'x' * 4000000 %}{{ " + " ~ ".join(["s"] * 100) + " }}", VALUE),
    (f"{{{{ '%((a)){BIG}s' % {{'(a)': 1}} }}}}", VALUE),
    # A list of a string's characters (an object each), refused from the string's length.
    ("{{ ('\u4e00' * 4000000)|list }}", VALUE),
    ("{% set _ = ('ba' * 2000000)|sort %}", VALUE),
    ("{{ ('ab' * 2000000)|unique|list }}", VALUE),
    ("{{ ('\u4e00' * 4000000)|slice(2)|list }}", VALUE),
    (f"{{{{ ('a' * 4000000)|batch({BIG})|list }}}}", VALUE),
    ("{{ ('ab' * 2000000)|groupby(0) }}", VALUE),
    ("{{ ('\u4e00' * 4000000)|join }}", VALUE),
    ("{{ '-'.join('\u4e00' * 4000000) }}", VALUE),
    ("{{ ('x' * 1000000)|join(attribute='upper') }}", VALUE),
    ("{{ ('\u4e00 ' * 2000000).split() }}", VALUE),
    ("{{ ('\u4e00 ' * 2000000)|wordcount }}", VALUE),
    # Growth by a constant factor, or through a table that is a list.
    ("{{ ('\uffff' * 1000000)|urlencode }}", VALUE),
    ("{{ ('\u4e00' * 1000000).encode('ascii', 'namereplace') }}", VALUE),
    ("{% set t = range(97)|map('string')|list + ['x' * 4000000] %}{{ ('a' * 1000).translate(t) }}",
     VALUE),
    ("{{ strftime_now('%c' * 2000000) }}", VALUE),
    # One C call that would hold the GIL for minutes, where no step is counted nor the clock
    # read: the whole daemon would freeze (health, other requests, SIGTERM).
    ("{{ 1|round(-1000000000) }}", BITS),
    ("{{ 1|round(100000000, 'floor') }}", BITS),
    ("{{ 1|round(precision=-1000000000, method='ceil') }}", BITS),
    ("{% set c = 'b' * 2000000 ~ 'a' %}{{ ('a' * 2000000)|trim(c) }}", LOOKED_FOR),
    ("{% set c = 'b' * 2000000 ~ 'a' %}{{ ('a' * 2000000).rstrip(c) }}", LOOKED_FOR),
    ("{{ ('a' * 4000000).rfind('a' * 10000 ~ 'b' ~ 'a' * 10000) }}", LOOKED_FOR),
    ("{{ ('a' * 400000).rsplit('a' * 10000 ~ 'b' ~ 'a' * 10000) }}", LOOKED_FOR),
    ("{{ ('a' * 4000000).rpartition('a' * 10000 ~ 'b' ~ 'a' * 10000) }}", LOOKED_FOR),
    # Python code run for every character with no step counted.
    # textwrap copies what is left of a long word for each line it cuts (quadratic).
    ("{{ ('a' * 3980000)|wordwrap(40) }}", CUT),
    ("{{ ('a' * 400000)|wordwrap(1, wrapstring='') }}", CUT),
    ("{{ ('\u00e9' * 1000000).encode('punycode') }}", CODEC),
    ("{{ ('a.' * 200000).encode().decode('idna') }}", CODEC),
    ("{{ ('&a' * 2000000)|striptags }}", STEPS),
    ("{{ (('<>' * 2000000)|safe).striptags() }}", STEPS),
    ("{{ ('%%' * 2000000) % () }}", STEPS),
    ("{{ ('ab' * 600000)|unique|list }}", STEPS),
    ("{{ ('ba' * 600000)|max }}", STEPS),
    ("{{ ('a' * 1000000)|reject('string')|list }}", STEPS),
    # Doubling, in a namespace (the one value a template can change) or through a macro.
    ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
     "{% endfor %}", BITS),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", VALUE),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", VALUE),
    ("{% set ns = namespace(l=['x']) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
     "{% endfor %}", VALUE),
    # A list of two references to one list is small in memory and huge in text: printing
    # it, hashing it, comparing it is exponential.
    ("{% set ns = namespace(l=['x']) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}"
     "{% endfor %}{{ ns.l }}", VALUE),
    ("{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}"
     "{{ f('x', 64) }}", VALUE),
    # Hashing a tuple nested 100,000 deep overflows CPython's C stack (a segfault).
    ("{% set ns = namespace(t=()) %}{% for i in range(100000) %}{% set ns.t = (ns.t,) %}"
     "{% endfor %}{{ {ns.t: 1} }}", DEEP),
    # Output: fresh strings written, into the prompt or a captured block; a constant
    # repeated in a block (never written one by one).
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", WRITTEN),
    ("{% set b %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}", WRITTEN),
    ("{% set b %}{% for i in range(100000) %}" + "c" * 100 + "{% endfor %}{% endset %}", WRITTEN),
]  # fmt: skip


def _ids(templates: list[str]) -> list[str]:
    return [f"{n}-{' '.join(t[:40].split())}" for n, t in enumerate(templates)]


@pytest.mark.parametrize(("template", "says"), HOSTILE, ids=_ids([t for t, _ in HOSTILE]))
def test_a_hostile_template_stops_itself_quickly(template: str, says: str) -> None:
    compiled = compile_template(template)  # compiling evaluates none of it
    # A million steps take well under the render's second, but on a loaded machine the
    # clock may stop a render first (a step-bound one, or one that builds for a while
    # before its value limit: seen with the suite beside two other jobs on 2 cores): either
    # limit is the render stopping itself. What a building one takes is held to its bound
    # below, clock or not.
    says = f"{says}|{TIME}"
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=says):
        compiled.render(messages=MESSAGES)
    assert time.monotonic() - start < 2.0


# Those that build something (tracemalloc slows the step-bound ones past their clock).
BUILDING = [t for t, says in HOSTILE if STEPS not in says and TIME not in says]


@pytest.mark.parametrize("template", BUILDING, ids=_ids(BUILDING))
def test_a_hostile_template_stops_before_it_takes_the_memory(template: str) -> None:
    compiled = compile_template(template)
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimitError):  # or its clock, slowed by tracemalloc
            compiled.render(messages=MESSAGES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB"


def test_the_errors_name_the_limit() -> None:
    def error(template: str) -> str:
        with pytest.raises(TemplateLimitError) as caught:
            compile_template(template).render(messages=MESSAGES)
        return str(caught.value)

    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    assert f"more than {MAX_STEPS:,} steps (loop iterations, calls, filters)" in error(nested)
    assert f"the operator * would make a value of more than {MAX_VALUE_SIZE:,}" in error(
        f"{{{{ 'x' * {BIG} }}}}"
    )
    assert f"the filter center would make a value of more than {MAX_VALUE_SIZE:,}" in error(
        f"{{{{ 'x'|center({BIG}) }}}}"
    )
    assert f"its macros and calls nested more than {MAX_CALL_DEPTH} deep" in error(
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"
    )
    assert "the filter round would make an integer of more than 65,536 bits" in error(
        "{{ 1|round(-1000000000) }}"
    )
    assert "rfind() was given 20,001 characters to look for, more than 64" in error(
        "{{ 'a'.rfind('a' * 10000 ~ 'b' ~ 'a' * 10000) }}"
    )


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{{ range(10 ** 9)|length }}", "Range too big"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ [1] + 'x' }}", "TypeError"),
        ("{% include 'other' %}", "no loader"),
        ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
    ],
)
def test_a_template_failing_in_python_is_a_template_error(template: str, error: str) -> None:
    """Whatever a template raises (the sandbox's OverflowError for a huge range, a TypeError)
    is the template failing, a TemplateError the request is answered with, not a 500."""
    with pytest.raises(TemplateError, match=error):
        compile_template(template).render(messages=MESSAGES)


def test_a_template_nested_past_pythons_recursion_does_not_compile() -> None:
    with pytest.raises(TemplateError):
        compile_template("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")


def test_rendering_only_through_render() -> None:
    """generate() and stream() would render outside the limits: refused."""
    compiled = compile_template("{% for i in range(3) %}{{ i }}{% endfor %}")
    assert compiled.render() == "012"
    with pytest.raises(TemplateError, match="only through render"):
        "".join(compiled.generate())


def test_what_templates_do_still_renders_as_jinja_renders_it() -> None:
    template = (
        "{% set ns = namespace(n=0, seen=[]) %}{% set c = cycler('a', 'b') %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% set ns.seen = ns.seen + [m.role] %}"
        "{{ c.next() }}{{ loop.index }}/{{ loop.length }}{{ loop.revindex }}"
        "{{ '%s:%03d' % (m.role, loop.index) }}{{ '{}-{:>3}'.format(m.role, 7) }}"
        "{% if not loop.last %},{% endif %}{% endfor %}|{{ ns.n }}{{ ns.seen|join('+') }}"
        "|{{ [3, 1, 2]|sort|join }}{{ {'b': 1, 'a': 2}|dictsort }}{{ range(5)|batch(2)|list }}"
        "{{ range(5)|slice(2)|list }}{{ [[1], [2]]|sum(start=[]) }}{{ 'a b c'|wordwrap(1) }}"
        "{{ ('ab' * 150)|wordwrap(7) }}{{ 'x'|center(5) }}{{ 'a\nb'|indent(2, true) }}{{ 'a-b'|replace('-', '+') }}"
        "{{ {'a': [1]}.get('a') }}{{ {'a': 1}.items()|list }}{{ 2 ** 10 }}{{ 'ab' * 3 }}"
        "{{ messages|map(attribute='role')|join(',') }}{{ messages|selectattr('role', 'eq', 'user')"
        "|list|length }}{{ (messages|tojson(indent=1))[:9] }}"
        "{{ 42.55|round(1, 'floor') }}{{ 1234|round(-2) }}{{ ' a '|trim }}{{ '<<a>>'.strip('<>') }}"
        "{{ 'a</think>b</think>c'.rsplit('</think>', 1) }}{{ 'a-b'.rfind('-') }}{{ 'cab'|sort|join }}"
        "{{ 'aab'|unique|list }}{{ 'abc'|list }}{{ 'ab'|join('-') }}{{ 'a b'.split() }}"
        "{{ 'a ' ~ 1 ~ ' ' ~ [2] ~ none }}{{ '%((a))3s|%(b)s' % {'(a)': 1, 'b': 2} }}"
        "{{ '<b>a &amp; b</b>'|striptags }}{{ 'a b'|urlencode }}{{ 'é'.encode('utf-8') }}"
        "{%- for x in tree recursive %}<{{ x.v }}{% if x.c %}{{ loop(x.c) }}{% endif %}>"
        "{%- endfor %}"
    )
    given = {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        "tree": [{"v": 1, "c": [{"v": 2, "c": [{"v": 3}]}]}],
    }
    reference = ImmutableSandboxedEnvironment(extensions=[loopcontrols])
    reference.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
    assert compile_template(template).render(**given) == (
        reference.from_string(template).render(**given)
    )


def _conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful. " * 20}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: the weather in city {i}? " * 3})
        if i % 5:
            messages.append({"role": "assistant", "content": f"Answer {i}: sunny. " * 8})
            continue
        call = {"name": "get_weather", "arguments": {"city": f"City{i}"}}
        messages.append(
            {"role": "assistant", "tool_calls": [{"id": f"c{i:08d}", "function": call}]}
        )
        messages.append({"role": "tool", "content": '{"temperature": 21}', "tool_call_id": ""})
    return messages


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
        },
    },
}


def _real_templates() -> dict[str, str]:
    templates = {"llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
    templates["fallback"] = FALLBACK_CHAT_TEMPLATE
    shared = Path(__file__).resolve().parents[2] / "shared" / "models"
    for path in sorted(shared.glob("**/*.gguf")):
        found = read_gguf(path).metadata.get("tokenizer.chat_template")
        if found is not None and found not in templates.values():
            templates[path.name] = found
    return templates


@pytest.mark.parametrize("name", list(_real_templates()))
def test_the_limits_never_bite_on_real_templates(name: str) -> None:
    """The repo's templates and the shared GGUF files' render a long conversation with tools
    exactly as Jinja's plain sandbox does, far within every limit."""
    source = _real_templates()[name]
    conversation = _conversation(200)
    if "tool_call" not in source and "tools" not in source:  # a template that knows no tools
        conversation = [m for m in conversation if m["role"] != "tool" and "content" in m]
    given = {
        "messages": conversation,
        "tools": [TOOL] * 8,
        "add_generation_prompt": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    reference = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    reference.filters["tojson"] = json.dumps
    expected = reference.from_string(source).render(**given)
    start = time.monotonic()
    assert compile_template(source).render(**given) == expected
    assert time.monotonic() - start < 0.5


def test_a_long_conversation_is_never_refused_for_its_length() -> None:
    """The value and output limits grow with what the render is given: a message longer than
    the base limit on one value renders, and may even be doubled."""
    long = [{"role": "user", "content": "y" * (MAX_VALUE_SIZE + 100)}]
    template = (
        "{% for m in messages %}{{ '<|user|>' + m.content + '\n' }}{{ m.content * 2 }}"
        "{% endfor %}{{ messages|tojson|length }}"
    )
    text = compile_template(template).render(messages=long)
    assert len(text) > 3 * MAX_VALUE_SIZE
    with pytest.raises(TemplateLimitError, match=VALUE):
        compile_template("{{ messages[0].content * 100 }}").render(messages=long)


def test_the_tokenizer_says_the_models_template_was_stopped() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    backend = HFTokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    tok = Tokenizer(backend, chat_template=f"{{{{ 'x' * {BIG} }}}}")
    with pytest.raises(ChatTemplateError, match="the model's chat template was stopped: the op"):
        tok.render_chat(MESSAGES)


# The daemon over a model whose template is hostile when asked to be.
SERVED_TEMPLATE = (
    "{% if messages[0].content == 'loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0].content == 'fan out' %}"
    "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}"
    "{{ f(0) }}"
    "{% elif messages[0].content == 'grow' %}{{ 'x' * 2000000000 }}"
    "{% endif %}"
    "{{ bos_token }}{% for m in messages %}User: {{ m.content }}\n{% endfor %}Assistant:"
)


@pytest.fixture(scope="module")
def server(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    folder = templated_copy(
        stories_target, tmp_path_factory.mktemp("hostile") / "model", SERVED_TEMPLATE
    )
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(folder), "test"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield srv


def _call(
    server: BackgroundServer, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], float]:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    if body is None:
        conn.request("GET", path)
    else:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data, time.monotonic() - start


def _chat(content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4}


@pytest.mark.parametrize(("content", "says"), [("loop", STEPS), ("grow", VALUE), ("fan out", TIME)])
def test_the_daemon_answers_a_hostile_template_with_a_400_naming_it(
    server: BackgroundServer, content: str, says: str
) -> None:
    status, body, elapsed = _call(server, "/v1/chat/completions", _chat(content))
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the model's chat template was stopped: ")
    assert says in error["message"]
    assert elapsed < 2.5
    # The same template, not asked to be hostile, and everything else still answer.
    assert _call(server, "/v1/chat/completions", _chat("hello"))[0] == 200
    assert _call(server, "/v1/completions", COMPLETION)[0] == 200
    assert _call(server, "/health")[0] == 200


def test_hostile_renders_on_every_preparing_thread_hold_nothing_up(
    server: BackgroundServer,
) -> None:
    """Both preparing threads rendering a template that runs until its clock stops it: the
    renders stop themselves and a plain completion is answered right after."""
    results: list[tuple[int, dict[str, Any], float]] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(_call(server, "/v1/chat/completions", _chat("fan out")))
        )
        for _ in range(2)
    ]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    status, _, _ = _call(server, "/v1/completions", COMPLETION)
    for thread in threads:
        thread.join(timeout=30)
    assert status == 200
    assert sorted(r[0] for r in results) == [400, 400]
    assert time.monotonic() - start < 4.0
