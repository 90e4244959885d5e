"""`specd serve` (the daemon in the foreground) and `specd config show | validate`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from daemon import service
from daemon.cli.argtypes import DRAFT_HELP, MAX_THREADS, MODEL_HELP, count, count_or_auto
from daemon.cli.plan import (
    add_context_arg,
    add_offload_args,
    add_prefix_cache_arg,
    add_quantize_args,
    blame_config_file,
)
from daemon.settings import (
    COMPILE_CHOICES,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    STRATEGY_CHOICES,
    TREE_VERIFICATION_CHOICES,
    Settings,
    SettingsError,
    user_config_file,
)
from daemon.settings_loading import load_settings, render_effective, validate_file
from daemon.small_files import MAX_KEY_BYTES, read_small

# flag dest → settings key; a flag left at None does not override anything.
FLAG_KEYS = {
    "model": "models.target",
    "draft": "models.draft",
    "name": "models.name",
    "dtype": "models.dtype",
    "quantize": "models.quantize",
    "draft_quantize": "models.draft_quantize",
    "substitute_bits": "models.substitute_bits",
    "device": "models.device",
    "threads": "models.threads",
    "compile": "runtime.compile",
    "strategy": "speculation.strategy",
    "budget": "speculation.budget",
    "spec_length": "speculation.spec_length",
    "max_depth": "speculation.max_depth",
    "tree_verification": "speculation.tree_verification",
    "prefix_cache": "speculation.prefix_cache",
    "offload": "offload.mode",
    "resident_layers": "offload.resident_layers",
    "slots": "offload.slots",
    "gpu_budget": "offload.gpu_budget",
    "ram_budget": "offload.ram_budget",
    "host_tier": "offload.host_tier",
    "experts": "offload.experts",
    "expert_slots": "offload.expert_slots",
    "bandwidth": "offload.bandwidth",
    "cpu_rate": "offload.cpu_rate",
    "context": "context.length",
    "host": "server.host",
    "port": "server.port",
    "api_key_file": "server.api_key_file",
    "log_level": "logging.level",
}


def add_address_args(p: argparse.ArgumentParser) -> None:
    """Where the daemon listens: all that the commands which only talk to it need."""
    p.add_argument("--config", type=Path, default=None, help="config file (default: user config)")
    p.add_argument(
        "--host", default=None, help="the address the daemon listens on (default 127.0.0.1)"
    )
    p.add_argument("--port", type=int, default=None, help="default 8716")


def read_api_key(path: str | Path) -> str | None:
    """The key in an API key file (a small regular file; ValueError or OSError if not)."""
    return read_small(Path(path).expanduser(), MAX_KEY_BYTES).decode().strip() or None


def configured_api_key(args: argparse.Namespace) -> str | None:
    """The API key of the daemon a command talks to (`status`, `chat`), if one can be read:
    the background daemon's own (the key file `specd start` recorded, which a `--config`
    given to `start` alone may name) where the command names no daemon, else the
    configuration's (`server.api_key_file`). Best effort: those commands say what the
    daemon answered. Read here rather than with `daemon.http.server.read_api_key` so that
    they import neither aiohttp nor torch."""
    if not names_address(args):
        record = service.DaemonRecord.read(service.default_paths())
        if record is not None and record.key_file is not None and service.alive(record):
            try:
                return read_api_key(record.key_file)
            except (OSError, ValueError):
                pass  # (moved or emptied since: the configuration's, if any)
    try:
        path = settings_from_args(args).server.api_key_file
    except SettingsError:
        return None  # (`status` shows the problems; `chat` meets them with its address)
    if path is None:
        return None
    try:
        return read_api_key(path)
    except (OSError, ValueError):
        return None


def names_address(args: argparse.Namespace) -> bool:
    """Whether the command line names a daemon (--host, --port or --config): that one is
    asked, not the background daemon of the pid file."""
    return args.host is not None or args.port is not None or args.config is not None


def add_settings_args(p: argparse.ArgumentParser) -> None:
    """Flags that override the configuration (see config/specd.yaml for each key)."""
    add_address_args(p)
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--draft", default=None, help=DRAFT_HELP)
    p.add_argument("--name", default=None, help="model id served at /v1/models")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="default auto")
    add_quantize_args(p, default=None)
    p.add_argument("--device", choices=DEVICE_CHOICES, default=None)
    p.add_argument(
        "--threads",
        type=count_or_auto("--threads", 1, MAX_THREADS),
        default=None,
        help="CPU threads or auto",
    )
    p.add_argument(
        "--compile", choices=COMPILE_CHOICES, default=None, help="compiled passes (default auto)"
    )
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default=None)
    p.add_argument(
        "--budget",
        type=count_or_auto("--budget", 1),
        default=None,
        help="tree node budget or 'auto'",
    )
    p.add_argument(
        "--spec-length",
        type=count("--spec-length", 1),
        default=None,
        help="linear: tokens drafted per round",
    )
    p.add_argument(
        "--max-depth", type=count("--max-depth", 1), default=None, help="tree: depth limit"
    )
    add_tree_verification_arg(p, default=None)
    add_context_arg(p, default=None)
    add_prefix_cache_arg(p)
    p.add_argument("--api-key-file", default=None, help="require this file's key as Bearer")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    add_offload_args(p)


def add_tree_verification_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--tree-verification",
        choices=TREE_VERIFICATION_CHOICES,
        default=default,
        help="tree: how trees are verified at T > 0: walk (the target's draw moves down "
        "the tree), rejection (children sampled from the draft, recursive rejection "
        "sampling) or auto (each round, from measured acceptance; greedy rounds walk)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, tuple[Any, str]] = {}
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = (value, "--" + dest.replace("_", "-"))
    return load_settings(getattr(args, "config", None), overrides)


def flag_argv(args: argparse.Namespace) -> list[str]:
    """The settings flags of `args` as argv again (`specd start` hands them to `serve`)."""
    argv: list[str] = []
    if getattr(args, "config", None) is not None:
        argv += ["--config", str(Path(args.config).resolve())]
    for dest in FLAG_KEYS:
        value = getattr(args, dest, None)
        if value is not None:
            argv += ["--" + dest.replace("_", "-"), str(value)]
    return argv


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from daemon.startup import collector_paused

    with collector_paused():  # torch's and aiohttp's imports; the engine thread loads
        from daemon.http.server import read_api_key, serve

    settings = settings_from_args(args)
    check_local_models(settings)  # fail now, in one line, before listening
    read_api_key(settings.server.api_key_file)
    setup_logging(settings.logging.level)
    status = asyncio.run(serve(settings))
    exit_now_if_compiling(status)
    return status


def check_local_models(settings: Settings) -> None:
    """Read the metadata of each model that is on this machine (a folder, a GGUF file, a
    model store's, or a path, which no hub id is), as the engine thread will: a missing,
    malformed or hostile file is then one line on stderr and exit status 2 before the
    daemon listens, not a load failure in its log. A hub id is left to the engine:
    resolving it may download. A relative path a configuration file gave that is not
    there says so, and which folder it was taken from."""
    from modeling.checkpoints.checkpoint import ModelNotFoundError, on_this_machine, open_checkpoint

    options = settings.runtime_options()
    for key, ref, quantize in (
        ("models.target", options.model, options.quantize),
        ("models.draft", options.draft, options.draft_quantize),
    ):
        if ref is None or ref in ("ngram", "substitute", "auto"):
            continue
        if not on_this_machine(ref):  # (a path that is not there is on this machine)
            continue
        try:
            open_checkpoint(ref, quantize, compare_head=False)  # (the load compares)
        except ModelNotFoundError as exc:
            raise blame_config_file(exc, settings, key, ref) from None


def exit_now_if_compiling(status: int) -> None:
    """Everything is closed; a compile still running on its thread would be torn down by the
    interpreter's exit mid-way, which aborts the process (the compiler's native threads):
    leave without that teardown, the logs flushed."""
    from daemon.compiling import still_compiling, stop_compiling

    if still_compiling():
        logging.getLogger("specd.compile").info("stopped while compiling: the compile is dropped")
        stop_compiling()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def cmd_config_show(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    given = getattr(args, "config", None)
    if given is not None:  # (it replaces the user config file)
        print(f"# config file: {given}")
    else:
        user = user_config_file()
        print(f"# user config file: {user}" + ("" if user.is_file() else " (absent)"))
    sys.stdout.write(render_effective(settings))
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    """Every problem in the file, one line each (`FILE: KEY: what is wrong; what is
    allowed`), exit status 2; or `FILE: ok`."""
    try:
        validate_file(args.file)
    except SettingsError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 2
    print(f"{args.file}: ok")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the daemon in the foreground (logs to stderr)")
    add_settings_args(serve)
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser("config", help="show or validate the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="the effective config and where each value is from")
    add_settings_args(show)
    show.set_defaults(func=cmd_config_show)
    validate = config_sub.add_parser("validate", help="check a config file")
    validate.add_argument("file", type=Path)
    validate.set_defaults(func=cmd_config_validate)
