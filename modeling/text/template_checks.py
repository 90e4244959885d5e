"""The checks that refuse a huge value, or a call that would run for minutes, before it is made.

What could make a huge value from small ones (`'x' * 2000000000`, `2 ** 2000000000`,
`'%2000000000s' % ''`, `'x'|center(2000000000)`, `('x' * 4000000)|list`: an object a
character) is estimated from its arguments and refused by the render's budget
(modeling/text/template_budget.py) before it is made: measuring it afterwards would be too
late. So is one C call that would hold the GIL for minutes, where neither steps nor the clock
are counted (`1|round(-1000000000)`, a long strip or search from the end), and a codec written
in Python. Also the filters and tests wrapped so that each is a step (and those that work
through every item of a big value, a step per item), and a `sum` that joins lists in one
pass. The sandbox (modeling/text/chat_template.py) calls these from its hooks.
"""

from __future__ import annotations

import codecs
import functools
import itertools
import math
import operator
import re
from collections.abc import Callable, Iterator, Mapping, ValuesView
from typing import Any

from jinja2.filters import make_attrgetter, sync_do_sum
from jinja2.utils import pass_environment
from markupsafe import Markup

from modeling.text.template_budget import (
    MAX_INT_BITS,
    OPAQUE,
    Budget,
    TemplateLimitError,
    current_budget,
)

# CPython strips by looking every character stripped up among the characters to strip, and
# searches from the end (rfind, rindex, rpartition, rsplit) by comparing the substring at every
# place: 'a' * 2,000,000 stripped of 'b' * 2,000,000 ~ 'a', or an rfind of 20,001 characters in
# 4,000,000, holds the GIL for minutes. No template strips or searches back for this many.
MAX_SCANNED = 64
# round(x, -p) and round(x, p, 'floor') compute 10 ** p: bounded as ** is, to an integer of
# MAX_INT_BITS (a precision past that changes no float and no integer a template may make).
MAX_ROUND_DIGITS = int(MAX_INT_BITS * math.log10(2))
# Characters textwrap may copy cutting long words into lines (wordwrap): about 0.05 s.
_CUT_COPIES = 1 << 28
# Codecs written in Python, which work through the text with no step counted (punycode is
# quadratic in its distinct characters, idna runs it and a per-character nameprep).
_PYTHON_CODECS = frozenset({"idna", "punycode"})
# The most bytes an encoded character takes: 4 (UTF-8, -16, -32; a stateful codec's shifts
# around one, up to 6, are measured after), 10 escaped (`\U0010ffff`, `&#1114111;`), its name
# (`\N{...}`, up to 92).
_ENCODED_PER_CHAR = {"backslashreplace": 10, "xmlcharrefreplace": 10, "namereplace": 92}


def _listed_size(value: Any) -> int:
    """The size of the list of a string's characters, or of its parts split at any separator
    (at most one more than its characters), as `Budget.measure` counts it: each 2 more, and the
    list's 2. 0 for any other value, whose list holds the parts it has."""
    return 3 * len(value) + 4 if isinstance(value, (str, bytes, bytearray)) else 0


def _check_scanned(pattern: Any, what: str) -> None:
    if isinstance(pattern, (str, bytes, bytearray)) and len(pattern) > MAX_SCANNED:
        raise TemplateLimitError(
            f"{what} was given {len(pattern):,} characters to look for, more than {MAX_SCANNED} "
            "(the limit on a strip's characters and a substring searched for from the end)"
        )


def _markup_work(text: str) -> int:
    """Markup's striptags and unescape run Python code for every tag and entity."""
    return text.count("<") + text.count("&")


def check_product(budget: Budget, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(
                f"the operator * would make an integer of more than {MAX_INT_BITS:,} bits"
            )
        return
    times, sequence = (left, right) if isinstance(left, int) else (right, left)
    if isinstance(times, int) and isinstance(sequence, (str, bytes, bytearray, list, tuple)):
        budget.allow(budget.size(sequence) * times, "the operator *")


def check_power(budget: Budget, base: Any, exponent: Any) -> None:
    numbers = isinstance(base, int) and isinstance(exponent, int)
    if numbers and exponent > 0 and abs(base) > 1 and base.bit_length() * exponent > MAX_INT_BITS:
        raise TemplateLimitError(
            f"the operator ** would make an integer of more than {MAX_INT_BITS:,} bits"
        )


# What follows a %-directive's mapping key: flags, width, .precision, length modifier, conversion.
_DIRECTIVE = re.compile(r"[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)
_PARENTHESIS = re.compile(r"[()]")


def _directives(text: str) -> Iterator[tuple[str | None, str | None, str | None, str]]:
    """`text`'s %-directives as CPython reads them: (key, width, precision, conversion). A key
    runs to the parenthesis that balances its first: `%((a))9s` is the key `(a)`, width 9."""
    at = text.find("%")
    while 0 <= at < len(text) - 1:
        at += 1
        key = None
        if text[at] == "(":
            depth = 0
            for parenthesis in _PARENTHESIS.finditer(text, at):
                depth += 1 if parenthesis.group() == "(" else -1
                if depth == 0:
                    key, at = text[at + 1 : parenthesis.start()], parenthesis.end()
                    break
            else:
                return  # an incomplete key: CPython refuses the template
        found = _DIRECTIVE.match(text, at)
        if found is None:
            return  # an incomplete directive, refused too
        width, precision, kind = found.groups()
        yield key, width, precision, kind
        at = text.find("%", found.end())


def check_percent(budget: Budget, template: Any, args: Any) -> None:
    """`template % args`: its length plus, for each directive, its width or its argument's
    text, whichever is longer."""
    if not isinstance(template, (str, bytes, bytearray)):
        return  # a remainder
    text = template if isinstance(template, str) else template.decode("latin-1")
    # A step for each directive and each parenthesis a key may hold, read here one by one
    # (`'%%' * 2000000` has 2,000,000).
    budget.step(text.count("%") + (text.count("(") if "%(" in text else 0))
    positional = list(args) if isinstance(args, tuple) else [args]
    estimate = len(text)
    for key, width, precision, kind in _directives(text):
        if kind == "%":
            continue
        widths = [0]
        for part in (width, precision):
            if part == "*":
                widths.append(operator.index(positional.pop(0) if positional else 0))
            elif part:
                widths.append(int(part))
        if key:
            arg = args.get(key) if isinstance(args, Mapping) else None
        else:
            arg = positional.pop(0) if positional else None
        estimate += max(*widths, budget.size(arg))
    budget.allow(estimate, "the operator %")


def _argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str, default: Any
) -> Any:
    return args[at] if len(args) > at else kwargs.get(name, default)


def check_call(
    budget: Budget, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Refuse a string method that would make a huge value or hold the GIL for long; the
    arguments to call it with (join's items, read once)."""
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, (str, bytes, bytearray, int)):
        return args
    name = getattr(method, "__name__", "")
    what = method  # described only when refused: "center()"
    if isinstance(owner, int) and name == "to_bytes":
        budget.allow(operator.index(_argument(args, kwargs, 0, "length", 1)), what)
    if not isinstance(owner, (str, bytes, bytearray)):
        return args
    n = len(owner)
    if name in ("center", "ljust", "rjust", "zfill"):
        budget.allow(max(n, operator.index(_argument(args, kwargs, 0, "width", 0))), what)
    elif name == "expandtabs":
        tab = "\t" if isinstance(owner, str) else b"\t"
        size = operator.index(_argument(args, kwargs, 0, "tabsize", 8))
        budget.allow(n + owner.count(tab) * size, what)  # type: ignore[arg-type]
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        count = operator.index(_argument(args, kwargs, 2, "count", -1))
        found = owner.count(old) if count < 0 else min(owner.count(old), count)
        budget.allow(n + found * (len(new) - len(old)), what)
    elif name == "join" and args:
        budget.allow(_listed_size(args[0]), what)  # join lists a string's characters first
        items = list(args[0])
        size = sum(len(i) if isinstance(i, (str, bytes)) else OPAQUE for i in items)
        budget.allow(size + n * max(len(items) - 1, 0), what)
        return (items, *args[1:])
    elif name == "translate" and args:
        # A table is anything indexed by a character's code: a list's items count as a dict's.
        table = args[0].values() if isinstance(args[0], Mapping) else args[0]
        values = table if isinstance(table, (list, tuple, ValuesView)) else ()
        longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
        budget.allow(n * max(longest, 1), what)
    elif name in ("strip", "lstrip", "rstrip"):
        _check_scanned(_argument(args, kwargs, 0, "chars", None), f"{name}()")
    elif name in ("rfind", "rindex", "rpartition"):
        _check_scanned(args[0] if args else None, f"{name}()")
    elif name == "encode":
        codec = _codec(_argument(args, kwargs, 0, "encoding", "utf-8"), f"{name}()")
        errors = _argument(args, kwargs, 1, "errors", "strict")
        per_char = _ENCODED_PER_CHAR.get(errors, 10 if "escape" in codec else 4)
        budget.allow(n * per_char + 4, what)
    elif name == "decode":
        _codec(_argument(args, kwargs, 0, "encoding", "utf-8"), f"{name}()")
    elif name in ("striptags", "unescape") and isinstance(owner, Markup):
        budget.step(_markup_work(owner))
    if name in ("split", "rsplit", "splitlines"):
        budget.allow(_listed_size(owner), what)
        if name == "rsplit":
            _check_scanned(_argument(args, kwargs, 0, "sep", None), f"{name}()")
    return args


def _codec(encoding: Any, what: str) -> str:
    """The codec's own name ('' for a non-string: the call refuses it), if not one of those
    written in Python."""
    codec = codecs.lookup(encoding).name if isinstance(encoding, str) else ""
    if codec in _PYTHON_CODECS:
        raise TemplateLimitError(
            f"{what} with the codec {codec!r}, written in Python, would run with no step "
            "counted (a template may use any codec but idna and punycode)"
        )
    return codec


# Filters that could make a huge value from small ones, refused before: (budget, the
# filter's own arguments) -> its value (join's items, read once).
def _center(b: Budget, value: Any, width: int = 80) -> Any:
    b.allow(max(b.text_size(value), operator.index(width)), "the filter center")
    return value


def _indent(b: Budget, s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> Any:
    unit = len(width) if isinstance(width, str) else operator.index(width)
    lines = s.count("\n") + 1 if isinstance(s, str) else 1
    b.allow(b.text_size(s) + lines * unit, "the filter indent")
    return s


def _format(b: Budget, value: Any, *args: Any, **kwargs: Any) -> Any:
    check_percent(b, value if isinstance(value, str) else str(value), kwargs or args)
    return value


def _join(b: Budget, value: Any, d: Any = "", attribute: Any = None) -> Any:
    floor = 0 if attribute is None else OPAQUE  # an attribute may be a method: its text
    sep = len(str(d))
    if isinstance(value, str):  # its characters (their list refused by `limited_filter`)
        b.allow(len(value) * max(floor, 1) + sep * max(len(value) - 1, 0), "the filter join")
        return value
    items = list(value)
    size = sum(max(len(i) if isinstance(i, str) else b.size(i), floor) for i in items)
    b.allow(size + sep * max(len(items) - 1, 0), "the filter join")
    return items


def _replace(b: Budget, s: Any, old: Any, new: Any, count: int | None = None) -> Any:
    text, old, new = str(s), str(old), str(new)
    found = text.count(old) if count is None or count < 0 else min(text.count(old), count)
    b.allow(len(text) + found * (len(new) - len(old)), "the filter replace")
    return s


def _wordwrap(b: Budget, s: Any, width: int = 79, *args: Any, **kwargs: Any) -> Any:
    wrapstring = _argument(args, kwargs, 1, "wrapstring", None) or "\n"
    text = str(s)
    width = max(operator.index(width), 1)
    lines = 2 * len(text) // width + text.count("\n") + 2
    b.allow(len(text) + lines * len(wrapstring), "the filter wordwrap")
    # textwrap cuts a word longer than a line by copying what is left of it for each line:
    # a word of L characters costs L²/2w characters copied, in one call that reads no clock
    # (('a' * 3980000)|wordwrap(40) ran 5.3 s). Words are measured only where one could be.
    if (
        _argument(args, kwargs, 0, "break_long_words", True)
        and len(text) ** 2 > _CUT_COPIES * 2 * width
    ):
        longest = max(map(len, text.split()), default=0)
        if longest**2 > _CUT_COPIES * 2 * width:
            raise TemplateLimitError(
                f"the filter wordwrap would cut a word of {longest:,} characters into lines of "
                f"{width}: about {longest**2 // (2 * width):,} characters copied, more than "
                f"{_CUT_COPIES:,}"
            )
    return s


def _batch(b: Budget, value: Any, linecount: int, fill_with: Any = None) -> Any:
    if fill_with is not None:
        b.allow(operator.index(linecount) * (b.size(fill_with) + 2), "the filter batch")
    return value


def _slice(b: Budget, value: Any, slices: int, fill_with: Any = None) -> Any:
    b.allow(operator.index(slices) * (b.size(fill_with) + 4), "the filter slice")
    return value


def _round(b: Budget, value: Any, precision: Any = 0, method: Any = "common") -> Any:
    if isinstance(precision, int) and abs(precision) > MAX_ROUND_DIGITS:
        raise TemplateLimitError(
            f"the filter round would make an integer of more than {MAX_INT_BITS:,} bits "
            f"(10 to the power of its precision, at most {MAX_ROUND_DIGITS:,})"
        )
    return value


def _striptags(b: Budget, value: Any) -> Any:
    b.step(_markup_work(str(value)))
    return value


def _trim(b: Budget, value: Any, chars: Any = None) -> Any:
    _check_scanned(chars, "the filter trim")
    return value


def _urlencode(b: Budget, value: Any) -> Any:
    if isinstance(value, str):  # a character is at most 4 UTF-8 bytes, each written %XX
        b.allow(12 * len(value), "the filter urlencode")
    return value


def _pprint(b: Budget, value: Any) -> Any:
    size, depth = b.measure(value)
    b.allow(size * (depth + 1), "the filter pprint")  # a line per part, indented by depth
    return value


def _urlize(b: Budget, value: Any, *args: Any, **kwargs: Any) -> Any:
    extra = sum(
        len(str(_argument(args, kwargs, i, k, "") or "")) for i, k in ((2, "target"), (3, "rel"))
    )
    text = str(value)
    b.allow(3 * len(text) + (len(text) // 4 + 1) * extra, "the filter urlize")
    return value


_FILTER_CHECKS: dict[str, Callable[..., Any]] = {
    "batch": _batch, "center": _center, "format": _format, "indent": _indent, "join": _join,
    "pprint": _pprint, "replace": _replace, "round": _round, "slice": _slice,
    "striptags": _striptags, "trim": _trim, "urlencode": _urlencode, "urlize": _urlize,
    "wordwrap": _wordwrap,
}  # fmt: skip
# Filters that do Python-level work for every item (every 4 characters) of their value are
# charged a step for each, so that one call on a huge value cannot run long past the clock; a
# string's items are its characters (`('ab' * 2000000)|unique` reads 4,000,000 to yield 2).
_ITEM_FILTERS = frozenset({
    "batch", "dictsort", "groupby", "max", "min", "pprint", "reject", "rejectattr", "select",
    "selectattr", "sort", "sum", "unique",
})  # fmt: skip
_ITEMS = (str, bytes, bytearray, list, tuple, dict, set, frozenset)
_TEXT_FILTERS = frozenset({"title", "urlencode", "urlize", "wordwrap"})
# Filters that make a list of their value's items (or words), which for a string is an object
# for each character: its size is refused before, from the string's length.
_LISTING_FILTERS = frozenset(
    {"batch", "groupby", "join", "list", "slice", "sort", "unique", "wordcount"}
)


def limited_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    at = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # the value's position
    check = _FILTER_CHECKS.get(name)
    per_item, per_char = name in _ITEM_FILTERS, name in _TEXT_FILTERS
    listing = name in _LISTING_FILTERS

    @functools.wraps(func)  # with jinja_pass_arg: called with what it asks for
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        value = args[at]
        if listing:
            budget.allow(_listed_size(value), f"the filter {name}")
        cost = 1
        if per_item and isinstance(value, _ITEMS):
            cost += len(value)
        elif per_char and isinstance(value, str):
            cost += len(value) // 4
        budget.step(cost)
        if check is not None:
            args = (*args[:at], check(budget, *args[at:], **kwargs), *args[at + 1 :])
        return budget.checked(func(*args, **kwargs), f"the filter {name}")

    return limited


# Tests that compare (or scan a string) like an operator: a step each, as a comparison is.
COMPARING_TESTS = (
    "!=", "<", "<=", "==", ">", ">=", "eq", "equalto", "ge", "greaterthan", "gt", "in", "le",
    "lessthan", "lower", "lt", "ne", "upper",
)  # fmt: skip


def counted_test(func: Any) -> Callable[..., Any]:  # Any: jinja's tests are typed `function`
    @functools.wraps(func)
    def counted(*args: Any, **kwargs: Any) -> Any:
        current_budget().step()
        return func(*args, **kwargs)

    return counted


@pass_environment
def sum_filter(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's sum, but lists and tuples are joined in one pass: Python's sum copies the
    growing list at every item, quadratic in a template's hands."""
    if not isinstance(start, (list, tuple)):
        return sync_do_sum(environment, iterable, attribute, start)
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    return type(start)(itertools.chain(start, *iterable))
