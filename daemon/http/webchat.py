"""The built-in web chat (`GET /`, static files shipped in daemon/http/static/) and the machine
status it shows (`GET /v1/specd/status`).

The page is plain HTML, CSS and JavaScript: no build step, nothing fetched from the
internet. It talks to the same OpenAI endpoint as any client, so it passes the same edge
checks (Host, Origin, API key); only its own static files are public, since they hold no
data and the page has to load before it can ask for the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web

from daemon.engine import Engine
from daemon.http.edge import CONFIG, DRAINING, ENGINE, METRICS, expect_handler
from daemon.http.openai_fields import DEFAULT_TEMPERATURE

STATIC = Path(__file__).with_name("static")
# path → (file, content type). Exact paths only: nothing else under static/ is served.
PAGE_FILES = {
    "/": ("index.html", "text/html"),
    # app.js is the entry module (<script type="module">); it imports the other six.
    "/static/app.js": ("app.js", "text/javascript"),
    "/static/api.js": ("api.js", "text/javascript"),
    "/static/chat.js": ("chat.js", "text/javascript"),
    "/static/machine.js": ("machine.js", "text/javascript"),
    "/static/page.js": ("page.js", "text/javascript"),
    "/static/stats.js": ("stats.js", "text/javascript"),
    "/static/tree.js": ("tree.js", "text/javascript"),
    "/static/style.css": ("style.css", "text/css"),
}
PAGE_PATHS = frozenset(PAGE_FILES)

# The page loads nothing from elsewhere and may not be framed (clickjacking).
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def page_file(request: web.Request) -> web.Response:
    name, content_type = PAGE_FILES[request.path]
    return web.Response(
        body=(STATIC / name).read_bytes(),
        content_type=content_type,
        charset="utf-8",
        headers=PAGE_HEADERS,
    )


async def specd_status(request: web.Request) -> web.Response:
    """What the daemon runs with: models, engine state, the memory plan, measured streaming."""
    app = request.app
    engine, metrics = app[ENGINE], app[METRICS]
    state = "stopping" if app[DRAINING].is_set() else engine.state
    body: dict[str, Any] = {
        "status": state,
        "model": app[CONFIG].model_name,
        "active": engine.active_count,
        "queued": engine.queued,
        "in_flight": engine.in_flight,  # places taken of the limit, being prepared included
        "target": engine.options.model,
        "draft": engine.options.draft,
        # The tree budget configured: a node count, or "auto" (chosen each round, up to
        # max_tree_budget nodes). Each answer's `specd` figures say what its rounds used.
        "budget": engine.options.budget,
        # What a request that names no temperature samples at (the page's empty box).
        "default_temperature": DEFAULT_TEMPERATURE,
    }
    runtime = engine.runtime
    if runtime is None and engine.loading_note:
        body["loading"] = engine.loading_note
    if runtime is not None:
        body.update(
            device=str(runtime.device),
            dtype=runtime.dtype,
            context=runtime.context,
            strategy=runtime.default_strategy,
            **runtime.draft_stats(),
            draft=runtime.options.draft,  # what `auto` settled on (draft_reason: why)
            max_tree_budget=runtime.max_tree_budget,
            plan=runtime.plan.to_dict(),
            # Per model: off, warming (passes run eager until ready), ready or failed.
            compile=runtime.compilation.to_dict() if runtime.compilation is not None else {},
            # Products on packed blocks on the CPU (modeling/weights/cpu_kernels.py).
            cpu_kernels=runtime.cpu_kernels_status(),
            # A mixture of experts: where its routed experts live, what routing moved.
            experts=runtime.expert_status(),
            # What tree verification accepted, per verification and temperature regime.
            tree_acceptance=runtime.acceptance.to_dict(),
            # The cache of verified target logits: it allocates its slots as rows need
            # them and keeps them, so host memory grows towards max_bytes by design.
            prefix_cache={
                "max_bytes": runtime.prefix_cache.max_bytes,
                "allocated_bytes": runtime.prefix_cache.allocated_bytes,
                "bytes": runtime.prefix_cache.bytes,
                "rows": runtime.prefix_cache.rows,
            },
        )
    body["memory_pressure"] = memory_pressure(engine)
    stream_seconds = metrics.stream_seconds.value
    body["stream"] = {
        # Measured over every generation so far (the figures /metrics exports).
        "bytes": int(metrics.stream_bytes.value),
        "seconds": stream_seconds,
        "gbps": metrics.stream_bytes.value / stream_seconds / 1e9 if stream_seconds else None,
    }
    passes = metrics.target_passes.value
    body["totals"] = {
        "completion_tokens": int(metrics.completion_tokens.value),
        "target_passes": int(passes),
        "tokens_per_target_pass": metrics.completion_tokens.value / passes if passes else None,
        "prefix_cache_hits": int(metrics.prefix_cache_hits.value),
        "cancelled": int(metrics.cancelled.value),
    }
    # (The plan holds a few non-JSON values, paths and enums: they go as strings.)
    return web.json_response(body, dumps=lambda obj: json.dumps(obj, default=str))


def memory_pressure(engine: Engine) -> dict[str, Any]:
    """The memory monitor's level, last sample and the relief steps in force."""
    monitor = engine.pressure
    if monitor is None:
        return {"level": "off", "steps": []}
    sample = monitor.sample
    return {
        "level": monitor.level,
        "host_available_bytes": sample.host_available if sample else None,
        "device_free_bytes": sample.device_free if sample else None,
        "rss_bytes": sample.rss if sample else None,
        "swap_bytes_per_second": sample.swap_rate if sample else None,
        "steps": engine.relief.in_force,
    }


def add_routes(app: web.Application) -> None:
    for path in PAGE_FILES:
        app.router.add_get(path, page_file, expect_handler=expect_handler)
    app.router.add_get("/v1/specd/status", specd_status, expect_handler=expect_handler)
