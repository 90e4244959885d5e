"""Where a daemon bound to an address is reached (`daemon_url`), what its user is told it
listens on (`listening_on`), and the warning where it answers other machines with no API
key (`exposed_without_key`)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.settings import ServerSettings


# Hosts that bind every interface of the machine (IPv4, IPv6, and the empty name).
ALL_INTERFACES = ("0.0.0.0", "::", "")


def daemon_url(host: str, port: int | None) -> str:
    """The base URL a client uses to reach a daemon bound to `host`: an address that listens
    everywhere is reached through loopback, and IPv6 literals are bracketed."""
    if host in ALL_INTERFACES:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def exposed_without_key(server: ServerSettings) -> str | None:
    """A warning where the daemon answers other machines (any address but loopback) with
    no API key: the Host check stops a browser's page, not a script that sends
    `Host: localhost` (README: set host, allowed_hosts and api_key_file together)."""
    host = server.host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: this machine's, which other machines may reach
        loopback = False
    if loopback or server.api_key_file is not None:
        return None
    return (
        f"server.host {server.host or '(every interface)'} answers other machines and "
        "server.api_key_file is not set: anyone who reaches this port can use the model "
        "(the Host check stops browsers only); set an API key (README: Security)"
    )


def listening_on(host: str, port: int | None) -> str:
    """Where a daemon bound to `host` listens, as told to its user: an address that listens
    everywhere is no URL to open, so it is named as such, with the loopback URL that opens
    it on this machine (other machines use this machine's name or address)."""
    url = daemon_url(host, port)
    if host not in ALL_INTERFACES:
        return f"listening on {url}"
    where = f"[{host}]:{port}" if ":" in host else f"{host or '*'}:{port}"
    return f"listening on {where} (all interfaces); open {url}"
