"""The one exception family for the caller's mistakes.

A `RequestError` says that what was asked for cannot be served as asked, and that asking
differently would help: a prompt longer than the context, a tree budget above the plan,
sampling values out of range, a command-line value out of range. The HTTP layer answers
it with a 400 in the OpenAI error shape, the command line with one line and a non-zero
exit. Anything else that escapes is a bug of ours: a 500 (or a traceback) with the
traceback in the log, never "your fault". One more is neither: `ModelOutputError`, a
model file whose weights compute NaN (a 500 that says so, one line from the command line).
"""

from __future__ import annotations


class RequestError(ValueError):
    """The request's fault. `param` names the offending field when one is to blame (the
    OpenAI error shape's `param`), `code` is a stable machine-readable reason."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelOutputError(RuntimeError):
    """The model computed NaN or infinite logits: its weights hold NaN or inf (a damaged
    file), or its config's values overflow. Every token drawn from such logits would be
    token 0 or garbage, so the generation stops with this instead (a 500 that says so; the
    daemon keeps serving)."""


def rust_panic(exc: BaseException) -> bool:
    """Whether `exc` is a panic of a Rust library (tokenizers, llguidance): pyo3 raises
    it as a BaseException, which `except Exception` handlers let through (a request's
    connection closed unanswered, an engine thread ended). It is one library call's
    failure: handled as an Exception is."""
    return type(exc).__name__ == "PanicException"


def panic_said(exc: BaseException) -> str:
    """What a Rust library's panic says, its first line cut to 200 characters (the rest is
    a backtrace, and a regex's or a file's text may be quoted in it)."""
    return (str(exc).splitlines() or ["a panic"])[0][:200]
