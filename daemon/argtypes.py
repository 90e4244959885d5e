"""argparse value types shared by the subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def count_or_auto(flag: str, minimum: int) -> Callable[[str], int | str]:
    """A type for flags like `--budget 64|auto`: an integer >= `minimum`, or 'auto'."""

    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a number or 'auto', got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be at least {minimum}, got {value}")
        return value

    return parse
