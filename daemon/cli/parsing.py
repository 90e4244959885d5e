"""The argparse parser every specd command is built with (`Parser`): long options spelled
out, and a subcommand's own usage for a word it does not know, kept short, with the flag
meant where a misspelt one is close to one."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn

USAGE_LINES = 4  # a usage longer than this is shown as its first line and `--help`


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

    def error(self, message: str) -> NoReturn:
        """argparse's error (usage, then `PROG: error: MESSAGE`, exit status 2), with a
        usage of many lines (`specd start` has 40 flags) cut to its first and a pointer to
        `--help`, and for a misspelt flag the one it is closest to."""
        lines = self.format_usage().rstrip("\n").splitlines()
        if len(lines) > USAGE_LINES:
            lines = [f"{lines[0].rstrip()} ...", f"  (`{self.prog} --help` lists every option)"]
        known = [o for o in self._option_string_actions if o.startswith("--")]
        guesses = []
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                if flag.startswith("--") and close:
                    guesses.append(f"{flag}: did you mean {close[0]}?")
        said = "; ".join(guesses)
        self.exit(
            2,
            "\n".join(lines)
            + f"\n{self.prog}: error: {message}"
            + (f" ({said})" if said else "")
            + "\n",
        )
