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

import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator


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


@contextlib.contextmanager
def rust_quiet() -> Iterator[None]:
    """A Rust library's panic hook kept off the process's stderr (fd 2) while a call runs
    that a file's content may make panic (building a tokenizer): the hook writes its
    message and a note there before the panic reaches Python, where it becomes one line
    naming the file. What else reaches fd 2 meanwhile (another thread's log lines, for the
    0.2-1.7 s a large tokenizer takes) is held and written after the call, less the hook's
    lines. RUST_BACKTRACE set (not 0) keeps the hook's output as it is."""
    if os.environ.get("RUST_BACKTRACE", "0") != "0":
        yield
        return
    with _QUIETING:  # (fd 2 is the process's: one window at a time, or one saved another's)
        yield from _held_stderr()


# Windows of `rust_quiet`, one at a time (re-entered by the thread that holds it).
_QUIETING = threading.RLock()


def _held_stderr() -> Iterator[None]:
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # (no fd 2 to save: nothing to quiet)
        yield
        return
    with tempfile.TemporaryFile() as held:
        try:
            os.dup2(held.fileno(), 2)
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            others = _without_panics(held.read())
            if others:
                with contextlib.suppress(OSError):
                    os.write(2, others)


def _without_panics(written: bytes) -> bytes:
    """`written` less the blocks a Rust panic hook writes: an empty line, its `thread '…'
    panicked at …` line, up to its `note: run with RUST_BACKTRACE…` line."""
    kept: list[bytes] = []
    inside = False
    for line in written.splitlines(keepends=True):
        if line.startswith(b"thread '") and b"panicked at" in line:
            inside = True
            if kept and kept[-1] == b"\n":  # (the hook begins with an empty line)
                kept.pop()
        elif inside and line.startswith(b"note: run with `RUST_BACKTRACE"):
            inside = False
        elif not inside:
            kept.append(line)
    return b"".join(kept)


class TokenizerFailure(RequestError):
    """The model's tokenizer (the `tokenizers` library, running the tokenizer.json's
    normalizer and pre-tokenizer) failed on a text: a regex that backtracks past the
    engine's limit panics in Rust, which reaches Python as a BaseException (pyo3's
    PanicException) that `except Exception` handlers would let through, closing the
    connection with no answer. Raised as the request's fault, the text's field named by
    the caller."""


def tokenizer_failure(err: BaseException, what: str) -> BaseException:
    """`err` as a TokenizerFailure where it is the library's panic; anything else
    (KeyboardInterrupt, SystemExit, an ordinary error) as it is."""
    if not rust_panic(err):
        return err
    reason = panic_said(err)
    return TokenizerFailure(
        f"the model's tokenizer could not {what} ({reason}): its tokenizer.json's "
        "normalizer or pre-tokenizer fails on it; send other text, or fix the model's "
        "tokenizer"
    )
