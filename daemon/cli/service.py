"""`specd start | stop | status | logs` and `specd service install`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from daemon import service, service_files
from daemon.addresses import daemon_url, exposed_without_key, listening_on
from daemon.cli.chat_client import KEY_HINT
from daemon.cli.serve import (
    add_address_args,
    add_settings_args,
    configured_api_key,
    flag_argv,
    names_address,
    settings_from_args,
)
from daemon.settings import ServerSettings, Settings, SettingsError


def _url(settings: Settings) -> str:
    return daemon_url(settings.server.host, settings.server.port)


def _configured_url(args: argparse.Namespace, quiet: bool = False) -> str:
    """The configured daemon's URL. A broken configuration does not stop `status` (it is
    how one looks at a daemon still running with the old one): the problems are shown and
    the flags over the built-in address are asked (`quiet`: that URL is not the one asked)."""
    try:
        return _url(settings_from_args(args))
    except SettingsError as exc:
        for problem in exc.problems:
            print(f"specd: warning: {problem}", file=sys.stderr)
        built_in = ServerSettings()
        host = args.host if args.host is not None else built_in.host
        port = args.port if args.port is not None else built_in.port
        url = daemon_url(host, port)
        if not quiet:
            print(f"specd: warning: configuration ignored; asking {url}", file=sys.stderr)
        return url


def cmd_start(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    settings.require_target()  # no model configured: say so before forking anything
    paths = service.default_paths()
    listen = (settings.server.host, settings.server.port)
    key = settings.server.api_key_file
    key_file = None if key is None else str(Path(key).expanduser().absolute())
    record = service.start(paths, flag_argv(args), _url(settings), args.wait, listen, key_file)
    # (Listening on every interface, it says so beside the loopback URL that opens it.)
    where = listening_on(settings.server.host, settings.server.port)
    print(f"specd is running (pid {record.pid}), {where}; logs: {paths.log_file}")
    exposed = exposed_without_key(settings.server)
    if exposed is not None:
        print(f"specd: warning: {exposed}", file=sys.stderr)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    paths = service.default_paths()
    if names_address(args):
        # An address names which daemon: the background one, if it is the one there.
        record = service.DaemonRecord.read(paths)
        wanted = _configured_url(args)
        if record is not None and service.alive(record) and not service.answers_at(record, wanted):
            print(
                f"specd: the background daemon listens at {record.url}, not {wanted}; "
                "left running (`specd stop` without an address stops it)",
                file=sys.stderr,
            )
            return 1
    pid = service.stop(paths, args.wait)
    print("specd was not running" if pid is None else f"specd (pid {pid}) stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    paths = service.default_paths()
    record = service.DaemonRecord.read(paths)
    # The daemon the command line names (--host, --port, --config), else the background one.
    if record is None or names_address(args):
        url = _configured_url(args)
    else:
        _configured_url(args, quiet=True)  # (shows a broken configuration's problems)
        url = record.url
    status, body = service.fetch_health(url)
    if record is not None and not service.answers_at(record, url, body):
        record = None  # the background daemon is another one
    running = record is not None and service.alive(record)
    pid = f"pid {record.pid}" if running and record is not None else "no pid file"
    if status == 200:
        print(f"specd: ready at {url} ({pid}), serving {body.get('model')}, "
              f"{body.get('active', 0)} active, {body.get('queued', 0)} queued")  # fmt: skip
        print(machine_report(url, args))
        return 0
    if status:
        print(f"specd: {body.get('status', 'unavailable')} at {url} ({pid})")
        return 1
    print(f"specd: not answering at {url} ({pid if running else 'not running'})")
    return 3


def machine_report(url: str, args: argparse.Namespace) -> str:
    """What `GET /v1/specd/status` says about the models and the memory plan (the web
    chat's machine panel), or why it could not be asked."""
    code, status = service.fetch_json(url + "/v1/specd/status", configured_api_key(args))
    if code != 200:
        reason = status.get("error", {}).get("message") if status else None
        hint = f"; {KEY_HINT}" if code == 401 else ""
        return (
            f"  (no machine details: /v1/specd/status answered {code or 'nothing'}: {reason}{hint})"
        )
    return format_machine(status)


def format_machine(status: dict) -> str:
    plan = status.get("plan") or {}
    stream = status.get("stream") or {}
    gbps = stream.get("gbps")
    seconds = plan.get("seconds_per_pass")
    lines = [
        f"  target {status.get('target')}, draft {status.get('draft') or 'none'}"
        + (f"\n  {status['draft_reason']}" if status.get("draft_reason") else ""),
        f"  {status.get('device')} {status.get('dtype')}, strategy {status.get('strategy')}, "
        f"context {status.get('context')} tokens",
        f"  plan: {plan.get('resident_layers')} resident / {plan.get('streamed_layers')} "
        f"streamed layers, {plan.get('slots')} slots, host tier {plan.get('host_tier') or '-'}, "
        + (
            f"{seconds:.3g} s of streaming a pass expected"
            if isinstance(seconds, float) and plan.get("streamed_layers")
            else "nothing streamed a pass"
            if plan and not plan.get("streamed_layers")
            else "no estimate"
        ),
        f"  streaming: {gbps:.2f} GB/s measured" if gbps else "  streaming: nothing streamed",
    ]
    pressure = status.get("memory_pressure") or {}
    if pressure.get("level", "off") != "off":
        gib = 2**30
        device = pressure.get("device_free_bytes")
        steps = ", ".join(pressure.get("steps") or []) or "none"
        lines.append(
            f"  memory pressure: {pressure['level']}, host {pressure['host_available_bytes'] / gib:.1f}"
            " GiB available"
            + (f", device {device / gib:.1f} GiB free" if isinstance(device, int) else "")
            + f"; relief steps in force: {steps}"
        )
    cache = status.get("prefix_cache")
    if cache:
        mib = 2**20
        lines.append(
            f"  prefix cache: {cache['allocated_bytes'] / mib:.1f} MiB allocated of "
            f"{cache['max_bytes'] / mib:.0f} MiB, {cache['rows']} rows"
        )
    return "\n".join(lines)


def cmd_logs(args: argparse.Namespace) -> int:
    log_file = service.default_paths().log_file
    if not log_file.is_file():
        print(f"no log yet at {log_file} (the daemon writes it once `specd start` runs)")
        return 0
    print(service.tail(log_file, args.lines))
    if args.follow:
        with open(log_file, errors="replace") as f:
            f.seek(0, 2)
            while True:
                line = f.readline(1 << 16)  # (a line without end is shown in pieces)
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)  # following a file: nothing to wait on but time
    return 0


def cmd_service_install(args: argparse.Namespace) -> int:
    # The flags must make a valid configuration, with a model: a unit without one would
    # fail and be restarted every few seconds.
    settings_from_args(args).require_target()
    paths = service.default_paths()
    spec = service_files.service_file(
        args.platform or sys.platform, flag_argv(args), Path.cwd(), Path.home(), paths
    )
    if args.print_only:
        sys.stdout.write(spec.content)
        return 0
    spec.path.parent.mkdir(parents=True, exist_ok=True)
    spec.path.write_text(spec.content)
    # The unit appends to the log file: systemd creates the file, not its folder.
    paths.log_file.parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {spec.path}\nenable and start it with:\n  {spec.enable_hint}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    start = sub.add_parser("start", help="start the daemon in the background")
    add_settings_args(start)
    start.add_argument("--wait", type=float, default=120.0, help="seconds to wait for ready")
    start.set_defaults(func=cmd_start)

    stop = sub.add_parser("stop", help="stop the background daemon")
    add_address_args(stop)
    stop.add_argument("--wait", type=float, default=30.0, help="seconds to wait for it to exit")
    stop.set_defaults(func=cmd_stop)

    status = sub.add_parser(
        "status", help="is the daemon running and ready (asks /health, then /v1/specd/status)"
    )
    add_address_args(status)
    status.set_defaults(func=cmd_status)

    logs = sub.add_parser("logs", help="show the background daemon's log")
    logs.add_argument("-n", "--lines", type=int, default=50)
    logs.add_argument("-f", "--follow", action="store_true")
    logs.set_defaults(func=cmd_logs)

    svc = sub.add_parser("service", help="install specd as a user service")
    svc_sub = svc.add_subparsers(dest="service_command", required=True)
    install = svc_sub.add_parser("install", help="write a systemd user unit or launchd agent")
    add_settings_args(install)
    install.add_argument("--print", dest="print_only", action="store_true", help="only print it")
    install.add_argument("--platform", choices=("linux", "darwin"), default=None)
    install.set_defaults(func=cmd_service_install)
