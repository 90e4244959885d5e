"""A chat template compiled as transformers compiles Hub templates, in a sandbox.

A template is code shipped by whoever published the model: it renders in Jinja's immutable
sandbox, and one that probes internals (`fn.__globals__`) is refused rather than quietly
given an empty string. Imported only when a template is compiled (speculative/tokenizer.py),
since Jinja costs tens of milliseconds of start-up.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateError", "compile_template"]


def _raise(message: str) -> None:
    raise TemplateError(message)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox answers an unsafe attribute (`fn.__globals__`) with an undefined value
    that prints as an empty string; a template that probes internals is refused outright."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's reply with
    it (for training masks); rendering it is rendering its body."""

    # jinja's Extension declares `tags` as a plain (instance-typed) attribute, so a ClassVar
    # override conflicts with it; the set is never mutated.
    tags: set[str] = {"generation"}  # noqa: RUF012

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain json.dumps (Jinja's own escapes HTML characters)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_template(source: str) -> Template:
    # The environment transformers renders Hub templates in: loop controls ({% break %})
    # and the generation block are in real templates, which otherwise fail to compile.
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(source)
