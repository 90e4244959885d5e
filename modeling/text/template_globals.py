"""What a chat template is given beyond Jinja's own: the globals and filters transformers
renders Hub templates with (`raise_exception`, `strftime_now`, a `tojson` that is plain
json.dumps) and its `{% generation %}` block, each charging the render's budget
(modeling/text/template_budget.py) where what it makes could be huge. The sandbox that
renders them is modeling/text/chat_template.py.
"""

from __future__ import annotations

import itertools
import json
import operator
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser

from modeling.text.template_budget import current_budget


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain json.dumps (Jinja's own escapes HTML characters). An indent
    or separators of the template's own repeat on every item: encoded piece by piece then,
    so that a huge result is refused before it is whole."""
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    extra = 0 if separators is None else len(separators[0] + separators[1])
    if indent is None and extra <= 4:
        return encoder.encode(value)
    budget = current_budget()
    unit = len(indent) if isinstance(indent, str) else operator.index(indent or 0)
    budget.allow(unit, "the filter tojson")
    # A piece is one part of the value or one line's indent (`unit` times the depth): with
    # short ones, checking every 256 pieces keeps as close to the limit as every one.
    pieces = encoder.iterencode(value)
    parts: list[str] = []
    written = 0
    while chunk := list(itertools.islice(pieces, 256 if unit <= 16 and extra <= 16 else 1)):
        parts += chunk
        written += sum(map(len, chunk))
        budget.allow(written, "the filter tojson")
    return "".join(parts)


class GenerationBlock(Extension):
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


def strftime_now(fmt: Any) -> str:
    """transformers' strftime_now; a directive of two characters may write 30 (`%c`), and
    strftime writes the whole format again each time it doubles its buffer."""
    if isinstance(fmt, str):
        current_budget().allow(16 * len(fmt), "strftime_now()")
    return datetime.now().strftime(fmt)
