"""One choice's chunks through the daemon's own answer code, without a server: the whole
body (`_collect_choice`) and the SSE events (`_stream_choice`), for tests that hold the
two to each other."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

from daemon.http.openai_responses import ResponseShape
from daemon.http.streaming import _collect_choice, _stream_choice
from daemon.jobs import Finished
from modeling.text.thinking import Thinking
from speculative.generation import Chunk
from speculative.tool_calls import CallFormat


class _Job:
    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        pass


def serve_choice(
    chunks: list[Chunk],
    shape: ResponseShape,
    *,
    finish: str = "stop",
    previous: int = 0,
    calls: CallFormat | None = None,
    harmony: bool = False,
    thinking: Thinking | None = None,
    together: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the whole body, the stream's events) of `chunks` and a finish of `finish`: each
    chunk arriving on its own, written before the next comes (`together`: all in one
    batch, as when rounds outpace the client)."""
    # (stand-ins for the aiohttp request, the engine's jobs and the parsed request)
    request: Any = types.SimpleNamespace(transport=types.SimpleNamespace(is_closing=lambda: False))
    finished = Finished(finish, 3, len(chunks), {})

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        whole_job: Any = _Job()
        stream_job: Any = _Job()
        for event in [*chunks, finished]:
            whole_job.events.put_nowait(event)
        whole = await _collect_choice(
            request, whole_job, shape, previous, calls, False, harmony, harmony, thinking
        )
        sent: list[bytes] = []

        async def send(data: bytes | None) -> None:
            if data is not None:
                sent.append(data)

        req: Any = types.SimpleNamespace(tool_choice=None, include_usage=False)
        task = asyncio.ensure_future(
            _stream_choice(
                request, stream_job, shape, req, 5.0, previous, send, calls, harmony, harmony,
                thinking,
            )
        )  # fmt: skip
        for event in [*chunks, finished]:
            stream_job.events.put_nowait(event)
            for _ in range(0 if together else 5):
                await asyncio.sleep(0)  # (the stream writes it before the next arrives)
        await task
        return whole, [json.loads(s[6:]) for s in sent if s.startswith(b"data: {")]

    return asyncio.run(run())
