"""The OpenAI error shape, {"error": {"message", "type", "param", "code"}}: `ApiError`,
raised anywhere in the HTTP layer and written by the edge (daemon/http/edge.py), and
`bad_request`, the 400 that names the field at fault."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# The longest error message answered (characters; longer ones lose their middle).
MAX_MESSAGE = 2000


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE:
            # A message may quote what the request sent (a 1 MiB `model` made a 2.9 MB
            # answer): its middle is cut, the start and the advice at its end are kept.
            cut = len(message) - MAX_MESSAGE
            head = MAX_MESSAGE * 2 // 3
            message = f"{message[:head]}[… {cut:,} characters …]{message[head + cut :]}"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status == 400:
            # The OpenAI client retries some statuses; a bad request will not get better.
            self.headers.setdefault("x-should-retry", "false")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def loggable(text: str) -> str:
    """`text` from a client as one log line: control characters (CR, LF, NUL, the escape
    that starts a terminal sequence, the Unicode line separators) written as `\\xNN`, so
    that no client can end a line of the log and forge the next one (a percent-encoded
    CR LF in a refused request's path did)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
