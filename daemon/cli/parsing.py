"""The argparse parser every specd command is built with (`Parser`): long options spelled
out, and a subcommand's own usage for a word it does not know."""

from __future__ import annotations

import argparse
from typing import Any


class Subcommands(argparse._SubParsersAction):
    """argparse's subcommands, except that a word the chosen subcommand does not know is
    its error, shown with its usage: argparse leaves such words to the top-level parser,
    whose usage lists only the subcommands' names. (Everything after a subcommand's name
    is that subcommand's, so the words left over can be no other parser's.)"""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        super().__call__(parser, namespace, values, option_string)
        unknown = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if unknown:
            self.choices[values[0]].error(f"unrecognized arguments: {' '.join(unknown)}")


class Parser(argparse.ArgumentParser):
    """Every specd parser and subparser (subparsers take their parent's class): long options
    must be spelled out, so `--max-token 5` is an error rather than a guess, and a flag
    added later cannot change what an existing script means."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Subcommands)
