"""The `specd` command line. `commands.py` builds the parser, holds `specd generate` and
`main` (the console script); each other module here is one subcommand (`serve`, `chat`,
`plan`, `pull`, `service`, `bench`) and its flags, with `argtypes.py` their value types.
Nothing outside this folder imports it."""

from daemon.cli.commands import main

__all__ = ["main"]
