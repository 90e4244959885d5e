"""JSON as JSON: Python's json reads NaN, Infinity and -Infinity, which JSON has not, and
reads a number past a float's range (`1e999`) as infinity; in a schema either became
`null` in the grammar, an answer that matches nothing the client wrote. Request bodies
(daemon/http/openai_wire.py) and `--json-schema` files (daemon/cli/commands.py) are read
through `loads`, which refuses them."""

from __future__ import annotations

import json
import math
from typing import Any


class NotJsonValue(ValueError):
    """A value JSON cannot hold, in text Python's json would read."""


def _no_constant(name: str) -> Any:
    raise NotJsonValue(f"{name} is not a JSON value")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise NotJsonValue(f"{literal[:40]} is past a float's range")
    return value


def loads(text: str | bytes, **options: Any) -> Any:
    """`json.loads(text, **options)`, NotJsonValue for NaN, the infinities and numbers past
    a float's range."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, **options)
