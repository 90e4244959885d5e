"""The checks that refuse a huge value before it is allocated.

What could make a huge value from small ones (`'x' * 2000000000`, `2 ** 2000000000`,
`'%2000000000s' % ''`, `'x'.center(2000000000)`, `'x'|center(2000000000)`) is estimated from
its arguments and refused by the render's budget (modeling/text/template_budget.py) before it
is made: measuring it afterwards would be too late. Also the filters and tests wrapped so that
each is a step (and those that work through every item of a big value, a step per item), and
a `sum` that joins lists in one pass. The sandbox (modeling/text/chat_template.py) calls these
from its operator, call and filter hooks.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

from jinja2.filters import make_attrgetter, sync_do_sum
from jinja2.utils import pass_environment

from modeling.text.template_budget import (
    MAX_INT_BITS,
    OPAQUE,
    Budget,
    TemplateLimitError,
    current_budget,
)


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


# One %-directive: (mapping key), flags, width, .precision, length modifier, conversion.
_DIRECTIVE = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def check_percent(budget: Budget, template: Any, args: Any) -> None:
    """`template % args`: its length plus, for each directive, its width or its argument's
    text, whichever is longer."""
    if not isinstance(template, (str, bytes, bytearray)):
        return  # a remainder
    text = template if isinstance(template, str) else template.decode("latin-1")
    positional = list(args) if isinstance(args, tuple) else [args]
    estimate = len(text)
    for key, width, precision, kind in _DIRECTIVE.findall(text):
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
    """Refuse a string method that would make a huge string; the arguments to call it with
    (join's items, read once)."""
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
        items = list(args[0])
        size = sum(len(i) if isinstance(i, (str, bytes)) else OPAQUE for i in items)
        budget.allow(size + n * max(len(items) - 1, 0), what)
        return (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        budget.allow(n * max(longest, 1), what)
    return args


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
    items = list(value)
    size = sum(len(i) if isinstance(i, str) else b.size(i) for i in items)
    b.allow(size + len(str(d)) * max(len(items) - 1, 0), "the filter join")
    return items


def _replace(b: Budget, s: Any, old: Any, new: Any, count: int | None = None) -> Any:
    text, old, new = str(s), str(old), str(new)
    found = text.count(old) if count is None or count < 0 else min(text.count(old), count)
    b.allow(len(text) + found * (len(new) - len(old)), "the filter replace")
    return s


def _wordwrap(b: Budget, s: Any, width: int = 79, *args: Any, **kwargs: Any) -> Any:
    wrapstring = _argument(args, kwargs, 1, "wrapstring", None) or "\n"
    text = str(s)
    lines = 2 * len(text) // max(operator.index(width), 1) + text.count("\n") + 2
    b.allow(len(text) + lines * len(wrapstring), "the filter wordwrap")
    return s


def _batch(b: Budget, value: Any, linecount: int, fill_with: Any = None) -> Any:
    if fill_with is not None:
        b.allow(operator.index(linecount) * (b.size(fill_with) + 2), "the filter batch")
    return value


def _slice(b: Budget, value: Any, slices: int, fill_with: Any = None) -> Any:
    b.allow(operator.index(slices) * (b.size(fill_with) + 4), "the filter slice")
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
    "pprint": _pprint, "replace": _replace, "slice": _slice, "urlize": _urlize,
    "wordwrap": _wordwrap,
}  # fmt: skip
# Filters that do Python-level work for every item (every 4 characters) of their value are
# charged a step for each, so that one call on a huge value cannot run long past the clock.
_ITEM_FILTERS = frozenset({"dictsort", "groupby", "max", "min", "pprint", "sort", "sum"})
_TEXT_FILTERS = frozenset({"title", "urlize", "wordwrap"})


def limited_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    at = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # the value's position
    check = _FILTER_CHECKS.get(name)
    per_item, per_char = name in _ITEM_FILTERS, name in _TEXT_FILTERS

    @functools.wraps(func)  # with jinja_pass_arg: called with what it asks for
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        value = args[at]
        cost = 1
        if per_item and isinstance(value, (list, tuple, dict, set, frozenset)):
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
