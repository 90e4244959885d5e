"""Sizes and rates as people write them: 24GB, 512MiB, 1.5G, 25GB/s."""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from '24GB', '24 GB', '512MiB', '1.5G'; an int is a byte count. Decimal units
    (KB, MB, GB, G) are powers of 1000, binary ones (KiB, MiB, GiB) of 1024. Text needs its
    unit ('B' for bytes): `--gpu-budget 24` meaning 24 GB must not plan with 24 bytes."""
    if isinstance(text, int):
        return text
    said = f"{what} {text!r}" if what else repr(text)
    match = _SIZE.match(text.lower())
    if not match or match.group(2) not in _UNITS:  # (no unit: "" is not one)
        raise ValueError(
            f"{said} is not a size: write a number with a unit, e.g. 24GB, 512MiB, 1.5G"
        )
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value < 1:
        raise ValueError(f"{said} must be at least one byte")
    return int(value)


def parse_rate(text: str | float, what: str = "bandwidth") -> float:
    """Bytes per second from '25GB/s', '25GB', '12.5 GiB/s' (text needs its unit, as a size
    does); a number is bytes per second."""
    if isinstance(text, (int, float)):
        return float(text)
    cleaned = text.strip()
    if cleaned.lower().endswith("/s"):
        cleaned = cleaned[:-2]
    try:
        return float(parse_size(cleaned, what))
    except ValueError:
        said = f"{what} {text!r}" if what else repr(text)
        raise ValueError(
            f"{said} is not a rate: write a number with a unit, e.g. 25GB/s, 800MB/s"
        ) from None


def format_size(n: float) -> str:
    """Binary units, three significant digits: 1.50 GiB, 512 MiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"
