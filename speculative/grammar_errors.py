"""What the grammar engine (llguidance) says when it refuses or stops a grammar, turned
into the request errors a client is shown: `GrammarError`, a 400 naming the field that
carried the grammar, whose message never quotes the grammar's text, the engine's position
in it or its backtrace (speculative/grammar.py compiles and runs the grammars)."""

from __future__ import annotations

import re

from modeling.errors import RequestError

# The most of an engine message a client is shown (a grammar error can quote the schema).
MAX_ENGINE_MESSAGE = 300
# A Lark grammar's compile error begins with where in the grammar it is, `at LINE(COLUMN): `,
# and ends quoting the lines around it, `   5 | call_0: ...`: neither is the client's.
AT_LINE = re.compile(r"at (\d+)\(\d+\): ")
QUOTED_LINE = re.compile(r"^ *\d+ \| ", re.MULTILINE)


class GrammarError(RequestError):
    """A grammar the engine cannot compile or the vocabulary cannot spell: a 400 naming
    the request field that carried it."""


# What the engine says when it gives up on a grammar for one of its own limits (the
# Earley items of one token's row, the lexer's fuel, the expressions its lexer may build:
# a pattern `^(a{1000}){1000}$` passes compiling and stops at the answer's first token),
# as opposed to a token it refuses (whose message quotes the token's text, which may hold
# any of these words).
LIMIT_PHRASES = ("items; max is", "fuel", "Too many items", "too many expressions")
REFUSED_TOKEN = "doesn't satisfy the grammar"


def engine_stopped(field: str, message: str) -> GrammarError:
    """The request error for a matcher the engine stopped: a grammar no text can extend
    (a schema matching no finite text, `{"$ref": "#"}`, says "NoExtensionBias") or one of
    its limits, reached on this grammar."""
    said = engine_message(message)
    if said.startswith("NoExtensionBias"):
        return GrammarError(
            f"{field}: no text matches this grammar (it cannot be continued or completed "
            "here: a schema that refers to itself with nothing else, say)",
            field,
            "unsupported_grammar",
        )
    return GrammarError(
        f"{field}: the grammar engine stopped: {said}", field, "unsupported_grammar"
    )


def engine_message(message: str) -> str:
    """What the engine said, as a client may be shown it: a panic (an internal limit of
    the engine, such as its 65,535 grammar symbols, which `allOf` over many `anyOf`
    multiplies out to) says so without the engine's backtrace, and no message is longer
    than MAX_ENGINE_MESSAGE characters."""
    if message.lstrip().startswith("panic"):
        return (
            "the grammar engine cannot build it (an internal limit: too many combinations, "
            "as allOf over several anyOf makes)"
        )
    # (`<non-verbose/>`: where the engine's verbose errors, off, would have said more)
    message = message.split("<backtrace>")[0].replace("<non-verbose/>", "").strip()
    quoted = QUOTED_LINE.search(message)
    if quoted is not None:
        message = message[: quoted.start()].strip()
    at = AT_LINE.match(message)
    if at is not None:
        message = message[at.end() :]
    if len(message) > MAX_ENGINE_MESSAGE:
        message = message[:MAX_ENGINE_MESSAGE] + " …"
    return message


def engine_line(message: str) -> int | None:
    """The grammar line an engine compile error is about (`at LINE(COLUMN): `), if any."""
    at = AT_LINE.match(message.lstrip())
    return int(at.group(1)) if at is not None else None
