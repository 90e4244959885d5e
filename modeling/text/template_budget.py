"""What one render of a chat template may spend, and how what it spends is counted.

The limits (steps, time, the size of a value, what is written, nesting, calls, integers) and
the per-render `Budget` that holds them, reached through a ContextVar so that the sandbox's
hooks, the filters and the formatter all charge the render they run in. `Counted` makes every
item of a loop (or of a stream a filter returns) a step; `Budget.measure` gives a value's
size and depth without recursion. Kept apart from the sandbox (modeling/text/chat_template.py)
and from the checks that use it (modeling/text/template_checks.py): this is the accounting,
those are the places that charge it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import ItemsView, Iterable, Iterator, Mapping, MappingView
from contextvars import ContextVar
from typing import Any

from jinja2.exceptions import TemplateRuntimeError
from jinja2.runtime import LoopContext
from jinja2.utils import Cycler

# The limits of one render. Real templates render a conversation of hundreds of messages
# with tools in milliseconds, a few thousand steps and about the conversation's size in
# text: each limit is orders of magnitude above that, and still stops a hostile template
# within about a second and a few hundred megabytes.
MAX_STEPS = 1_000_000  # loop iterations, calls and filters
MAX_RENDER_SECONDS = 1.0  # wall time, read at every step
MAX_VALUE_SIZE = 4 << 20  # characters in any one value the template makes (a string, a list)
VALUE_SIZE_PER_INPUT = 4  # ... or this many times the size of what the render is given
MAX_OUTPUT_SIZE = 8 << 20  # characters written, captured blocks and macros' output included
OUTPUT_SIZE_PER_INPUT = 8  # ... or this many times the size of what the render is given
MAX_DEPTH = 100  # nesting of a value it makes, past its inputs' (hashing a tuple ~50,000
# deep overflows CPython's C stack)
MAX_CALL_DEPTH = 64  # macros (and calls) inside calls: a macro calling itself
MAX_INT_BITS = 1 << 16  # an integer it makes with * or ** (19,729 digits)


class TemplateLimitError(TemplateRuntimeError):
    """The template went past one of the limits of a render."""


BUDGET: ContextVar[Budget | None] = ContextVar("chat_template_budget", default=None)
_END = object()
OPAQUE = 64  # the size of what is not data (a macro, `loop`, a namespace): about its repr


def current_budget() -> Budget:
    budget = BUDGET.get()
    if budget is None:  # also at compile time, which keeps filters from being folded then
        raise TemplateRuntimeError("a chat template renders only through render()")
    return budget


def _leaf_size(value: Any) -> int | None:
    """The size of a value that holds no others; None for a container."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, range):
        return 8 * len(value)
    if isinstance(value, (Mapping, MappingView, list, tuple, set, frozenset)):
        return None
    return OPAQUE


def _parts(container: Any) -> Iterator[Any]:
    """A container's parts: a mapping's keys and values (not its items, tuples made afresh
    whose ids would be reused)."""
    if isinstance(container, Mapping):
        return itertools.chain.from_iterable(container.items())
    if isinstance(container, ItemsView):
        return itertools.chain.from_iterable(container)
    return iter(container)


def _flat_size(container: Any) -> tuple[int, int, Any] | None:
    """A memo entry for a list, tuple or set of strings alone, measured at C speed (`'x'|list`
    has a million parts); None for any other."""
    if isinstance(container, (list, tuple, set, frozenset)) and set(map(type, container)) <= {str}:
        return 2 + sum(map(len, container)) + 2 * len(container), 1, container
    return None


def _measure(
    root: Any,
    limit: float,
    depth_limit: float,
    known: dict[int, tuple[int, int, Any]],
    memo: dict[int, Any],
) -> tuple[int, int]:
    """(size, depth) of a value: a string's length, a container 2 plus each part's size plus
    2 (a part held twice counts twice: the length of the text it would print, within a small
    factor). Walked without recursion, each container once (`memo`, or `known`: the render's
    inputs), stopping as soon as the size passes `limit` or the depth `depth_limit`. Memo
    entries hold their container, so that no id is reused while they stand. Values cannot be
    cyclic: the sandbox's containers are immutable and a namespace (the one mutable value)
    counts as opaque."""
    leaf = _leaf_size(root)
    if leaf is not None:
        return leaf, 0
    flat = _flat_size(root)
    if flat is not None:
        return flat[0], flat[1]
    stack: list[list[Any]] = [[root, _parts(root), 2, 0]]  # [container, parts, size, depth]
    while True:
        top = stack[-1]
        part = next(top[1], _END)
        if part is _END:
            stack.pop()
            size, depth = top[2], top[3] + 1
            memo[id(top[0])] = (size, depth, top[0])
            if not stack:
                return size, depth
            top = stack[-1]
        else:
            found = _leaf_size(part)
            if found is None:
                seen = memo.get(id(part)) or known.get(id(part))
                if seen is None:
                    seen = memo[id(part)] = _flat_size(part)
                if seen is None:
                    stack.append([part, _parts(part), 2, 0])
                    if len(stack) > depth_limit:
                        return top[2], len(stack)
                    continue
                size, depth, _ = seen
            else:
                size, depth = found, 0
        top[2] += size + 2
        top[3] = max(top[3], depth)
        if top[2] > limit:
            return top[2], top[3]


class Budget:
    """What one render may use and has used. The value, output and depth limits grow with the
    render's inputs, which are measured only when a base limit would be passed (a real
    conversation never is): a real render pays for none of it."""

    def __init__(self, given: Mapping[str, Any]) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.steps = 0
        self.calls = 0  # calls open now
        self.written = 0
        self._given = given
        self._inputs: tuple[int, int] | None = None  # their size and depth, once measured
        self.known: dict[int, tuple[int, int, Any]] = {}  # their containers, once measured

    def _measure_inputs(self) -> tuple[int, int]:
        if self._inputs is None:
            measured = [
                _measure(v, math.inf, math.inf, {}, self.known) for v in self._given.values()
            ]
            self._inputs = (sum(s for s, _ in measured), max((d for _, d in measured), default=0))
        return self._inputs

    @property
    def value_limit(self) -> int:
        return max(MAX_VALUE_SIZE, VALUE_SIZE_PER_INPUT * self._measure_inputs()[0])

    @property
    def output_limit(self) -> int:
        return max(MAX_OUTPUT_SIZE, OUTPUT_SIZE_PER_INPUT * self._measure_inputs()[0])

    @property
    def depth_limit(self) -> int:
        return MAX_DEPTH + self._measure_inputs()[1]

    def step(self, count: int = 1) -> None:
        self.steps += count
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(
                f"it took more than {MAX_STEPS:,} steps (loop iterations, calls, filters) "
                "in one render"
            )
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"it ran for more than {MAX_RENDER_SECONDS:g} s in one render")

    def allow(self, size: float, what: object) -> None:
        """Refuse a value of `size` before it is made."""
        if size > MAX_VALUE_SIZE and size > self.value_limit:
            raise TemplateLimitError(
                f"{_describe(what)} would make a value of more than {self.value_limit:,} "
                "characters (the limit on one value)"
            )

    def measure(self, value: Any) -> tuple[int, int]:
        size, depth = _measure(value, MAX_VALUE_SIZE, MAX_DEPTH, self.known, {})
        if size > MAX_VALUE_SIZE or depth > MAX_DEPTH:
            size, depth = _measure(value, self.value_limit, self.depth_limit, self.known, {})
        return size, depth

    def size(self, value: Any) -> int:
        return self.measure(value)[0]

    def text_size(self, value: Any) -> int:
        return len(value) if isinstance(value, str) else self.size(value)

    def checked(self, value: Any, what: object) -> Any:
        """`value`, which the template has just made, if it is within the limits; a stream
        comes back counted."""
        if isinstance(value, str):
            self.allow(len(value), what)
        elif isinstance(value, int):
            if value.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(
                    f"{_describe(what)} would make an integer of more than {MAX_INT_BITS:,} bits"
                )
        elif isinstance(value, Iterator):
            # The loop and a cycler are objects the template holds, not streams.
            if not isinstance(value, (Counted, LoopContext, Cycler)):
                return Counted(value, self)
        else:
            size, depth = self.measure(value)
            self.allow(size, what)
            if depth > MAX_DEPTH and depth > self.depth_limit:
                raise TemplateLimitError(
                    f"{_describe(what)} would nest values more than {self.depth_limit} deep"
                )
        return value

    def write(self, size: int) -> None:
        self.written += size
        if self.written > MAX_OUTPUT_SIZE and self.written > self.output_limit:
            raise TemplateLimitError(
                f"it wrote more than {self.output_limit:,} characters (the limit on one render)"
            )


def _describe(what: object) -> str:
    if isinstance(what, str):
        return what
    return f"{getattr(what, '__name__', None) or type(what).__name__}()"


class Counted(Iterator[Any]):
    """An iterable whose every item is a step of the render. A stream (what a filter's
    generator yields: `range(100000)|map('center', 4000000)`) makes its items afresh, and
    whoever collects them (`|list`, `loop.length`) holds them all: together they may be no
    bigger than one value (counting a container's own parts, which it holds afresh)."""

    def __init__(self, iterable: Iterable[Any], budget: Budget) -> None:
        self._iterable = iterable
        self._items = iter(iterable)
        self._budget = budget
        self._stream = isinstance(iterable, Iterator)
        self._made = 0

    def __next__(self) -> Any:
        budget = self._budget
        budget.steps += 1
        if budget.steps > MAX_STEPS or time.monotonic() > budget.deadline:
            budget.step(0)  # says which
        item = next(self._items)
        if self._stream:
            self._made += len(item) + 2 if isinstance(item, _SIZED) else OPAQUE
            if self._made > MAX_VALUE_SIZE:
                budget.allow(self._made, "the items of a stream")
        return item

    def __len__(self) -> int:  # `loop.length`; a TypeError for a stream, as len() of it gives
        return len(self._iterable)  # type: ignore[arg-type]


_SIZED = (str, bytes, bytearray, list, tuple, dict, set, frozenset)
