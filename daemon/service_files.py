"""Service files that run `specd serve` at login: a systemd user unit (Linux) or a launchd
agent (macOS), writing to the log `specd start` writes, so `specd logs` reads either.
`specd service install` writes them (daemon/cli/service.py); the daemon's own start,
stop, pid and log files are daemon/service.py."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from daemon.service import (
    LAUNCHD_LABEL,
    SERVICE_NAME,
    ServiceError,
    ServicePaths,
    serve_command,
)


def render_systemd_unit(argv: list[str], working_dir: Path, log_file: Path) -> str:
    """The daemon's output goes to the same log file `specd start` writes, so `specd logs`
    reads it for a service install too (systemd 240+: `append:`)."""
    return f"""[Unit]
Description=specd: local OpenAI-compatible inference with lossless tree speculation
After=network.target

[Service]
Type=simple
WorkingDirectory={working_dir}
ExecStart={shlex.join(argv)}
StandardOutput=append:{log_file}
StandardError=append:{log_file}
Restart=on-failure
RestartSec=5
# specd serve exits 0 on SIGTERM after ending in-flight streams.
KillSignal=SIGTERM
TimeoutStopSec=30

[Install]
WantedBy=default.target
"""


def render_launchd_plist(argv: list[str], working_dir: Path, log_file: Path) -> str:
    args = "\n".join(f"        <string>{escape(a)}</string>" for a in argv)
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0">
<dict>
    <key>Label</key>
    <string>{LAUNCHD_LABEL}</string>
    <key>ProgramArguments</key>
    <array>
{args}
    </array>
    <key>WorkingDirectory</key>
    <string>{escape(str(working_dir))}</string>
    <key>RunAtLoad</key>
    <true/>
    <key>KeepAlive</key>
    <dict>
        <key>SuccessfulExit</key>
        <false/>
    </dict>
    <key>StandardOutPath</key>
    <string>{escape(str(log_file))}</string>
    <key>StandardErrorPath</key>
    <string>{escape(str(log_file))}</string>
</dict>
</plist>
"""


@dataclass
class ServiceFile:
    path: Path
    content: str
    enable_hint: str


def service_file(
    platform: str, flags: list[str], working_dir: Path, home: Path, paths: ServicePaths
) -> ServiceFile:
    argv = serve_command(flags)
    if platform == "darwin":
        path = home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        return ServiceFile(
            path,
            render_launchd_plist(argv, working_dir, paths.log_file),
            f"launchctl load -w {path}",
        )
    if platform.startswith("linux"):
        config_home = Path(os.environ.get("XDG_CONFIG_HOME", home / ".config"))
        path = config_home / "systemd" / "user" / f"{SERVICE_NAME}.service"
        return ServiceFile(
            path,
            render_systemd_unit(argv, working_dir, paths.log_file),
            "systemctl --user daemon-reload && systemctl --user enable --now specd\n"
            f"  (logs: specd logs -f, from {paths.log_file})",
        )
    raise ServiceError(
        f"service install supports Linux (systemd) and macOS (launchd), not {platform!r}; "
        "run `specd start` instead"
    )
