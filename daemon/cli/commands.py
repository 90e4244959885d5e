"""`specd` command line. Each subcommand's flags are a contract scripts rely on.

Nothing here imports torch at module level: `specd --help`, `status`, `stop`, `chat` and
`config` answer in a fraction of a second, and only the commands that load or plan a model
pay for it (see tests/test_cli_startup.py)."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from collections.abc import Sequence

from daemon.cli import chat, generate, models, plan, pull, serve, service
from daemon.cli.parsing import Parser
from daemon.cli.pull import PullError
from daemon.options import RuntimeSetupError
from daemon.service import ServiceError
from daemon.settings import SettingsError
from modeling.errors import ModelOutputError, RequestError

# Errors a user can cause: reported as one line on stderr, exit status 2. Anything else is
# a bug and keeps its traceback: a bare ValueError is not taken for the user's fault. The
# ones defined next to the models are named by module: an exception can only be of a class
# whose module is loaded, so `user_error_types` looks there and never imports torch to
# find out.
USER_ERRORS: tuple[type[BaseException], ...] = (
    RequestError,
    ModelOutputError,  # (a damaged file's NaN weights)
    SettingsError,
    FileNotFoundError,
    ServiceError,
    PullError,
    RuntimeSetupError,
)
MODEL_USER_ERRORS = {
    "modeling.checkpoints.checkpoint": ("ModelNotFoundError",),
    "modeling.checkpoints.folder_files": ("CheckpointError",),
    "modeling.config": ("UnsupportedModelError",),
    "modeling.weights.quant": ("UnsupportedQuantizationError",),
    "modeling.checkpoints.gguf_model": ("GGUFError",),
    "modeling.weights.gguf_blocks": ("UnsupportedGGMLTypeError",),
    "modeling.text.gguf_tokenizer": ("GGUFTokenizerError",),
    "offload.planning": ("PlanError",),
}


def user_error_types() -> tuple[type[BaseException], ...]:
    loaded = [
        getattr(sys.modules[module], name)
        for module, names in MODEL_USER_ERRORS.items()
        if module in sys.modules
        for name in names
    ]
    return (*USER_ERRORS, *loaded)


BENCH_HELP = "compare strategies on the configured model pair"


class Version(argparse.Action):
    """`specd --version`: the installed package's version, looked up only when asked (its
    metadata costs a start-up that never prints it)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"specd {version('specd')}")
        except PackageNotFoundError:
            print("specd (not installed: run from a checkout)")
        parser.exit()


def build_parser(command: str | None = "bench") -> argparse.ArgumentParser:
    """The whole command line. `specd bench`'s module imports torch when it is imported, so
    its flags are registered only when `command` is bench; otherwise a placeholder lists it."""
    parser = Parser(
        prog="specd",
        description="Local OpenAI-compatible inference with lossless tree speculation.",
    )
    parser.add_argument("--version", action=Version, nargs=0, help="print specd's version")
    sub = parser.add_subparsers(dest="command", required=True)
    for commands in (generate, serve, service, chat, pull, models):
        commands.register(sub)
    if command == "bench":
        from daemon.cli import bench

        bench.register(sub)
    else:
        sub.add_parser("bench", help=BENCH_HELP)
    plan.register(sub)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv: the top-level parser has no option that takes a value,
    so it is the first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        status = _main(argv)
        sys.stdout.flush()  # (a pipe's buffer: written here, not at the interpreter's exit)
        return status
    except BrokenPipeError:
        # Whoever read stdout has gone (`specd status | head -2`): what it wanted was
        # written. Later writes (the interpreter's own flush at exit) go nowhere, as the
        # shell's 128 + SIGPIPE says.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


# The longest error line printed: what a file or a flag makes a message hold (a list of
# 400,000 unexpected tensor names, a template's raise_exception of 100 KB) is cut.
MAX_ERROR_CHARS = 2000


def one_line(message: str) -> str:
    """`message` on one line, its middle cut where it runs past MAX_ERROR_CHARS, other
    control characters escaped (a terminal sequence quoted from a file's text)."""
    from daemon.http.openai_errors import loggable

    message = loggable(message.replace("\r", " ").replace("\n", " "))
    if len(message) <= MAX_ERROR_CHARS:
        return message
    cut = len(message) - MAX_ERROR_CHARS
    half = MAX_ERROR_CHARS // 2
    return f"{message[:half]} … ({cut:,} characters left out) … {message[-half:]}"


def _main(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
            # (a path given with a name past the file system's 255 bytes: Python's path
            # checks let this one error through, wherever the path is first looked at)
            name = str(exc.filename or "")
            shown = name if len(name) <= 80 else name[:60] + "…" + name[-12:]
            print(f"specd: error: {shown}: a name in this path is too long", file=sys.stderr)
            return 2
        if not isinstance(exc, user_error_types()):
            raise
        print(f"specd: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
