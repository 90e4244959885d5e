"""Host names as the Host header and request targets carry them, parsed for an exact
comparison against the names the daemon answers to (DNS rebinding protection)."""

from __future__ import annotations

import ipaddress
import re

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")

_PORT = re.compile(r"[0-9]{0,5}")
# A registered name or an IPv4 address (RFC 3986 reg-name, less percent-encoding and the
# sub-delims no DNS name uses): letters, digits, '-' and '_', dots between labels.
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")


def host_name(authority: str) -> str | None:
    """The host part of `host[:port]` normalised for comparison: lower case, one trailing
    dot dropped, an IPv6 literal as "[compressed form]". None when the value is not
    `host[:port]`: userinfo, an unbracketed IPv6 address, anything after "]" but a port, a
    port that is not digits, characters no host name has, an empty name."""
    if authority.startswith("["):  # [IPv6]:port
        end = authority.find("]")
        if end < 0:
            return None
        literal, rest = authority[1:end], authority[end + 1 :]
        if rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:])):
            return None
        try:
            return f"[{ipaddress.IPv6Address(literal).compressed}]"
        except ValueError:
            return None
    name, colon, port = authority.partition(":")
    if colon and not _PORT.fullmatch(port):
        return None
    name = name.lower()
    if name.endswith("."):
        name = name[:-1]
    return name if _NAME.fullmatch(name) else None


def allowed_host_names(extra: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The loopback names and `extra` (server.allowed_hosts), normalised; an IPv6 address
    may be written with or without brackets. ValueError names an entry that is no host."""
    names = set()
    for entry in (*LOOPBACK_HOSTS, *extra):
        name = host_name(entry) or host_name(f"[{entry}]")
        if name is None:
            raise ValueError(f"{entry!r} is not a host name (expected e.g. myhost.lan or ::1)")
        names.add(name)
    return frozenset(names)
