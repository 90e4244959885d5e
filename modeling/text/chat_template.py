"""A chat template compiled as transformers compiles Hub templates, in a sandbox with limits.

A template is code shipped by whoever published the model (GGUF `tokenizer.chat_template`,
tokenizer_config.json). It renders in Jinja's immutable sandbox, and one that probes internals
(`fn.__globals__`) is refused rather than quietly given an empty string. The sandbox keeps a
template away from Python; it does not keep it from looping for ever (`range(100000)` in
`range(100000)`), from building gigabytes (`'x' * 2000000000`, `'x'|center(2000000000)`) or
from crashing CPython (hashing a tuple nested 100,000 deep overflows the C stack). So every
render runs under limits, checked as it goes: a render that passes one stops itself with a
`TemplateLimitError` saying which, and no thread is ever killed.

- Steps and time: the code generator wraps every for-loop's iterable in `Counted`, which
  counts each item (so loops that write nothing count too), as do items drawn from the
  generators filters return; every call (macros, methods, `loop(...)`), filter, operator on
  big values, literal, comparison and slice is a step. The clock is read at each step, so
  that a render stops within one operation of its time (a template needs no loop to run for
  minutes: a hundred thousand comparisons of two big lists).
- Values: whatever the template makes (operators, literals, `~`, filters, calls) is measured
  as it is made (`Budget.measure`: about the length of its text, a part held twice counted
  twice, so doubling a list by nesting it is caught); what could make a huge value from small
  ones (`*`, `**`, `%`, `~` of many pieces, center, indent, join, replace, listing a string's
  characters, ...) is refused before it is allocated, and what one C call would spend minutes
  on while it holds the GIL (round's 10 ** precision, a long strip or search from the end) is
  refused before it is called: no step is counted, nor the clock read, inside it.
- Output: every piece written, into the prompt or into a captured block or macro, counts.

The value and output limits grow with what the render is given (the conversation), so a
long conversation is never refused for its length.

This module is the sandbox: the code generator, the formatter, the template and environment
that charge every render. The limits and the per-render budget (`Budget`, `Counted`, the
measuring) are in modeling/text/template_budget.py; the checks of operators, calls, string
formatting and filters that refuse a huge value before it is made are in
modeling/text/template_checks.py; what transformers gives a template beyond Jinja (tojson,
strftime_now, raise_exception, the generation block) is in modeling/text/template_globals.py.
Imported only when a template is compiled (modeling/text/tokenizer.py), since Jinja costs tens
of milliseconds of start-up. The sandbox stays one file: its code generator, formatter and
environment each override the others' hooks, and read apart they would hide which hook
charges what.
"""

from __future__ import annotations

import functools
import itertools
import re
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import SecurityError, TemplateRuntimeError
from jinja2.ext import loopcontrols
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace
from markupsafe import EscapeFormatter, Markup, soft_str

from modeling.text.template_budget import (
    BUDGET,
    MAX_CALL_DEPTH,
    MAX_DEPTH,
    MAX_INT_BITS,
    MAX_OUTPUT_SIZE,
    MAX_RENDER_SECONDS,
    MAX_STEPS,
    MAX_VALUE_SIZE,
    OUTPUT_SIZE_PER_INPUT,
    VALUE_SIZE_PER_INPUT,
    Budget,
    Counted,
    TemplateLimitError,
    current_budget,
)
from modeling.text.template_checks import (
    COMPARING_TESTS,
    check_call,
    check_percent,
    check_power,
    check_product,
    counted_test,
    limited_filter,
    sum_filter,
)
from modeling.text.template_globals import GenerationBlock, raise_exception, strftime_now, tojson

# The limits are re-exported, so that what a render may do and the error it raises past that
# are read from one module (the tests read them here).
__all__ = [
    "MAX_CALL_DEPTH", "MAX_DEPTH", "MAX_INT_BITS", "MAX_OUTPUT_SIZE", "MAX_RENDER_SECONDS",
    "MAX_STEPS", "MAX_VALUE_SIZE", "OUTPUT_SIZE_PER_INPUT", "VALUE_SIZE_PER_INPUT",
    "TemplateError", "TemplateLimitError", "compile_template",
]  # fmt: skip

_SMALL = 4096  # a string this short is joined by + with no step (nor a clock read)


class _LimitedCodeGenerator(CodeGenerator):
    """Jinja compiles a template to Python; this one counts every for-loop's items
    (`environment.counted(iterable)`) and checks every literal and `~` it builds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: set[int] = set()  # ids of the nodes (alive while compiling)

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self._loop_iterables.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        self.write("environment.counted(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def _checked(
        self, visit: Callable[..., None], node: nodes.Expr, frame: Frame, what: str
    ) -> None:
        self.write("environment.checked(")
        visit(node, frame)
        self.write(f", {what!r})")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._checked(super().visit_List, node, frame, "a list")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._checked(super().visit_Dict, node, frame, "a dict")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "load":  # not a target: `{% for a, b in ... %}`
            self._checked(super().visit_Tuple, node, frame, "a tuple")
        else:
            super().visit_Tuple(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # Jinja's, but each piece is counted as it is made text (`environment.pieces`), so
        # that `s ~ s ~ ...` over a big string is refused before it is joined.
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.checked({join}(environment.pieces((")
        for piece in node.nodes:
            self.visit(piece, frame)
            self.write(", ")
        self.write("))), 'the operator ~')")

    # Comparing or slicing two big values takes milliseconds, and needs no loop to be done
    # a hundred thousand times: each is a step, so that the clock is read.
    def _stepped(self, visit: Callable[..., None], node: nodes.Expr, frame: Frame) -> None:
        self.write("environment.stepped(")
        visit(node, frame)
        self.write(")")

    def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:
        # `message.role == 'user'`: comparing with a constant costs at most its length.
        constant = isinstance(node.expr, nodes.Const) or isinstance(node.ops[0].expr, nodes.Const)
        if len(node.ops) == 1 and node.ops[0].op not in ("in", "notin") and constant:
            super().visit_Compare(node, frame)
        else:
            self._stepped(super().visit_Compare, node, frame)

    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if isinstance(node.arg, nodes.Slice):
            self._stepped(super().visit_Getitem, node, frame)
        else:
            super().visit_Getitem(node, frame)


class _LimitedFormatter(SandboxedFormatter):
    """str.format: no field wider, and no result longer, than one value may be."""

    _written = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._written = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = current_budget()
        for number in re.findall(r"\d+", format_spec):  # width, precision
            budget.allow(int(number), "format()")
        text = super().format_field(value, format_spec)
        self._written += len(text)
        budget.allow(self._written, "format()")
        return text


class _LimitedEscapeFormatter(_LimitedFormatter, EscapeFormatter):
    pass


class _Namespace(Namespace):
    """A namespace is the one value a template can change, so the size of a list holding one
    is not fixed when the list is made (`[ns] * 1000`, then a big `ns.x`): its text does not
    show what it holds."""

    def __repr__(self) -> str:
        return "<Namespace>"


def _write(value: Any) -> Any:
    """`environment.finalize`: every value written, into the output or a captured block."""
    budget = BUDGET.get()
    if budget is None:  # a constant folded in at compile time
        return value
    text = value if type(value) is str else str(value)
    budget.write(len(text))
    return text


class _LimitedTemplate(Template):
    def render(self, *args: Any, **kwargs: Any) -> str:
        token = BUDGET.set(Budget(dict(*args, **kwargs)))
        try:
            return super().render(*args, **kwargs)
        except TemplateError:
            raise
        except RecursionError as exc:
            raise TemplateLimitError("it recursed deeper than Python allows") from exc
        except Exception as exc:  # a TypeError in the template's code is the template failing
            raise TemplateRuntimeError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            BUDGET.reset(token)

    def new_context(self, *args: Any, **kwargs: Any) -> Context:
        current_budget()  # generate(), stream() and the module would render without limits
        return super().new_context(*args, **kwargs)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox answers an unsafe attribute (`fn.__globals__`) with an undefined value
    that prints as an empty string; a template that probes internals is refused outright.
    And every render keeps to the limits (`Budget`)."""

    code_generator_class = _LimitedCodeGenerator
    template_class = _LimitedTemplate
    # Intercepted, an operator is also never folded at compile time ('x' * 2000000000).
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def counted(self, iterable: Iterable[Any]) -> Iterable[Any]:
        return iterable if isinstance(iterable, Counted) else Counted(iterable, current_budget())

    def checked(self, value: Any, what: str) -> Any:
        budget = current_budget()
        budget.step()
        return budget.checked(value, what)

    def pieces(self, pieces: tuple[Any, ...]) -> list[str]:
        budget = current_budget()
        texts: list[str] = []
        size = 0
        for piece in pieces:
            text = soft_str(piece)  # a Markup stays one, for markup_join
            size += len(text)
            budget.allow(size, "the operator ~")
            texts.append(text)
        return texts

    def stepped(self, value: Any) -> Any:
        budget = current_budget()
        budget.steps += 1
        if budget.steps > MAX_STEPS or time.monotonic() > budget.deadline:
            budget.step(0)  # says which
        return value

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Joins the output and every captured block: a block may repeat a constant a million
        times (constants are not written through `_write`), refused before the join."""
        budget = current_budget()
        parts: list[str] = []
        size = 0
        items = iter(pieces)
        while chunk := list(itertools.islice(items, 256)):
            parts += chunk
            size += sum(map(len, chunk))
            if size > MAX_OUTPUT_SIZE and size > budget.output_limit:
                raise TemplateLimitError(
                    f"it wrote more than {budget.output_limit:,} characters (the limit on one "
                    "render)"
                )
        return "".join(parts)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        strings = type(left) is str and type(right) is str
        if operator == "+" and strings and len(left) + len(right) <= _SMALL:
            return left + right  # most of them: too cheap to be a step
        budget = current_budget()
        budget.step()
        if operator == "*":
            check_product(budget, left, right)
        elif operator == "**":
            check_power(budget, left, right)
        elif operator == "%":
            check_percent(budget, left, right)
        return budget.checked(self.binop_table[operator](left, right), f"the operator {operator}")

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.step()
        if isinstance(obj, LoopContext) and args:  # `loop(children)` in a recursive loop
            args = (Counted(args[0], budget), *args[1:])
        else:
            args = check_call(budget, obj, args, kwargs)
        if budget.calls >= MAX_CALL_DEPTH:
            raise TemplateLimitError(f"its macros and calls nested more than {MAX_CALL_DEPTH} deep")
        budget.calls += 1
        try:
            result = super().call(context, obj, *args, **kwargs)
        finally:
            budget.calls -= 1
        if isinstance(getattr(obj, "__self__", None), (dict, list, tuple)) and (
            obj.__name__ != "fromkeys" and not isinstance(result, str)
        ):
            return result  # a part of a container, or a view or copy of it: not measured again
        return budget.checked(result, obj)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """Jinja's own, with a formatter that keeps to the value limit."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or (
            value.__name__ not in ("format", "format_map")
        ):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        formatter: _LimitedFormatter
        if isinstance(owner, Markup):
            formatter = _LimitedEscapeFormatter(self, escape=owner.escape)
        else:
            formatter = _LimitedFormatter(self)
        by_map = value.__name__ == "format_map"

        def format(*args: Any, **kwargs: Any) -> str:
            if by_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                return type(owner)(formatter.vformat(owner, (), args[0]))
            return type(owner)(formatter.vformat(owner, args, kwargs))

        return functools.update_wrapper(format, value)


def compile_template(source: str) -> Template:
    # The environment transformers renders Hub templates in: loop controls ({% break %})
    # and the generation block are in real templates, which otherwise fail to compile.
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, loopcontrols],
        finalize=_write,
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _Namespace
    del env.globals["lipsum"]  # paragraphs of lorem ipsum by the million; no template uses it
    env.filters["tojson"] = tojson
    env.filters["sum"] = sum_filter
    env.filters = {name: limited_filter(name, f) for name, f in env.filters.items()}
    env.tests.update({name: counted_test(env.tests[name]) for name in COMPARING_TESTS})
    try:
        return env.from_string(source)
    except TemplateError:
        raise
    except Exception as exc:  # nested past Python's recursion limit, a 5,000-digit literal
        raise TemplateError(f"{type(exc).__name__}: {exc}") from exc
