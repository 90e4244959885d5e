"""The checks of the settings' values: each returns the normalised value or raises
ValueError saying what is allowed, and daemon/settings.py gives every key of its schema
one. `size_bytes` reads a size that may be off (0), for the checks and the flags alike."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from daemon.hostname import allowed_host_names
from offload.units import parse_rate, parse_size


def size_bytes(value: int | str, what: str = "size") -> int:
    """Bytes of a size that may be off: 0 / '0', or a size such as 1GiB or 512MB."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} {value!r} is not a size")
    if value in (0, "0"):
        return 0
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{what} {value} must not be negative")
    return parse_size(value, what)


def _with_unit(value: Any) -> Any:
    """A size or rate as the configuration gives it: text with its unit. A bare number
    (`gpu_budget: 24`, `bandwidth: 25`) would be bytes, which nobody means: refused."""
    if not isinstance(value, str):
        raise TypeError(value)
    return value


Check = Callable[[Any], Any]


def choice(*allowed: Any) -> Check:
    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(
                "one of " + ", ".join("null" if a is None else str(a) for a in allowed)
            )
        return value

    return check


def integer(lo: int, hi: int, *, nullable: bool = False, auto: bool = False) -> Check:
    extras = (" or null" if nullable else "") + (" or 'auto'" if auto else "")

    def check(value: Any) -> Any:
        if value is None and nullable:
            return None
        if value == "auto" and auto:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"an integer from {lo} to {hi}{extras}")
        return value

    return check


def number(lo: float, hi: float) -> Check:
    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise ValueError(f"a number from {lo} to {hi}")
        return float(value)

    return check


def text(*, nullable: bool = False) -> Check:
    def check(value: Any) -> Any:
        if value is None and nullable:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError("a non-empty string" + (" or null" if nullable else ""))
        return value

    return check


HOST = re.compile(r"[A-Za-z0-9._%:-]{1,253}|\[[0-9A-Fa-f:.%]{2,60}\]")


def host_name(value: Any) -> Any:
    """server.host: a name or an address to bind (`0.0.0.0`, `::`, `myhost.lan`); no
    spaces or other characters a URL cannot hold (`specd status` builds one from it)."""
    if not isinstance(value, str) or not HOST.fullmatch(value):
        raise ValueError("a host name or address, e.g. 127.0.0.1, 0.0.0.0 or ::")
    return value


def text_list(value: Any) -> Any:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise ValueError("a list of strings, e.g. [http://localhost:3000]")
    return list(value)


def host_list(value: Any) -> Any:
    value = text_list(value)
    try:
        allowed_host_names(value)
    except ValueError as exc:
        raise ValueError(f"a list of host names, e.g. [myhost.lan]; {exc}") from None
    return value


def flag(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def size_or_auto(value: Any) -> Any:
    """A budget: 'auto' or a size with its unit (0 is no budget: refused)."""
    if value == "auto":
        return value
    try:
        parse_size(_with_unit(value))
    except (ValueError, TypeError):
        raise ValueError("'auto' or a size such as 24GB or 512MiB") from None
    return value


def size_auto_or_zero(value: Any) -> Any:
    """A threshold: 'auto', 0 (never) or a size with its unit."""
    if value == "auto":
        return value
    try:
        size_bytes(value if value == 0 else _with_unit(value))
    except (ValueError, TypeError):
        raise ValueError("'auto', 0 or a size such as 2GiB or 512MB") from None
    return value


def size_or_zero(value: Any) -> Any:
    try:
        size_bytes(value if value == 0 else _with_unit(value))
    except (ValueError, TypeError):
        raise ValueError("0 (off) or a size such as 1GiB or 512MB") from None
    return value


def rate_or_null(value: Any) -> Any:
    if value is None:
        return None
    try:
        parse_rate(_with_unit(value))
    except (ValueError, TypeError):
        raise ValueError("null (measured) or a rate such as 25GB/s") from None
    return value


def rate(value: Any) -> Any:
    try:
        parse_rate(_with_unit(value))
    except (ValueError, TypeError):
        raise ValueError("a rate such as 16MB/s") from None
    return value
