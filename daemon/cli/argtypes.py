"""argparse value types shared by the subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from daemon.settings_checks import size_bytes

# modeling.weights.quant's QUANTIZE_GROUP, restated so that building the command line does not
# import torch; tests/test_cli_startup.py checks that the two agree.
QUANTIZE_GROUP = 128

# What --model and --draft accept, in every command that has them (they are opened by
# modeling/checkpoints/checkpoint.py's `resolve`).
MODEL_FORMS = (
    "a Hugging Face model folder or hub id (ORG/NAME), a .gguf file, ollama:NAME[:TAG] or "
    "lmstudio:PUBLISHER/REPO[/FILE]"
)
MODEL_HELP = f"the target: {MODEL_FORMS}"
DRAFT_HELP = (
    f"the draft: {MODEL_FORMS}; or 'ngram' (prompt lookup), 'substitute' (the target's "
    "own low-bit layers), 'auto' (the default: a small model with the target's tokenizer "
    "found on this machine, else the substitute on a GPU where it pays, else ngram) or "
    "'none' (plain decoding)"
)

# The temperatures specd accepts anywhere, the OpenAI API's range: the REST API refuses
# others (daemon/http/openai_fields.py), and so do `specd generate` and `specd chat`.
TEMPERATURE_RANGE = (0.0, 2.0)


def temperature(text: str) -> float:
    """A type for --temperature, with the API's range and the API's message."""
    lo, hi = TEMPERATURE_RANGE
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise argparse.ArgumentTypeError(
            f"temperature must be a number in [{lo}, {hi}], got {text}"
        )
    return value


def text(flag: str) -> Callable[[str], str]:
    """A type for free-text flags (`--prompt`, `--stop`): bytes of the command line that are
    not UTF-8 arrive as lone surrogates (Python's surrogateescape), which no tokenizer takes."""

    def parse(value: str) -> str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError(
                f"{flag} is not valid UTF-8 text (is the terminal's encoding UTF-8?)"
            ) from None
        return value

    return parse


MAX_THREADS = 1024  # models.threads' bound too (daemon/settings.py)


def count(flag: str, minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A type for flags like `--max-depth 8` or `--concurrency 4`: an integer >= `minimum`
    (and <= `maximum` where one is given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a whole number, got {text[:40]!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{flag} must be at most {maximum}, got {value}")
        return value

    return parse


def count_or_auto(
    flag: str, minimum: int, maximum: int | None = None
) -> Callable[[str], int | str]:
    """A type for flags like `--budget 64|auto`: an integer >= `minimum` (<= `maximum`),
    or 'auto'."""

    number = count(flag, minimum, maximum)

    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a whole number or 'auto', got {text[:40]!r}"
            ) from None
        return number(text)

    return parse


def size_or_off(flag: str) -> Callable[[str], str]:
    """A type for flags like `--prefix-cache 1GiB|0`: the text, checked."""

    def parse(text: str) -> str:
        try:
            size_bytes(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (or 0 for off)") from None
        return text

    return parse
