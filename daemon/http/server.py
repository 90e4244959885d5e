"""Running the daemon: settings → engine + app → a listening socket, and an orderly stop.

`serve()` is what `specd serve` runs in the foreground. `BackgroundServer` runs the same
thing on a thread with its own event loop (tests and scripts/bench_server.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path

from aiohttp import web

from daemon.addresses import daemon_url, exposed_without_key, listening_on
from daemon.engine import Engine, EngineLimits
from daemon.http import webchat
from daemon.http.api import create_app
from daemon.http.connections import AppRunner
from daemon.http.edge import DRAINING, ApiConfig
from daemon.http.openai_fields import WireLimits
from daemon.metrics import Metrics
from daemon.options import RuntimeOptions
from daemon.pressure import thresholds_from
from daemon.runtime import Runtime
from daemon.service import ListenError
from daemon.settings import Settings, SettingsError
from daemon.small_files import MAX_KEY_BYTES, SmallFileError, read_small

log = logging.getLogger("specd.server")


def read_api_key(path: str | None) -> str | None:
    if path is None:
        return None
    file = Path(path).expanduser()
    try:
        key = read_small(file, MAX_KEY_BYTES).decode("utf-8").strip()
    except OSError as exc:
        raise SettingsError(f"server.api_key_file {file} cannot be read: {exc.strerror}") from None
    except (SmallFileError, UnicodeDecodeError) as exc:
        raise SettingsError(f"server.api_key_file: {exc}; put the API key in a text file") from None
    if not key:
        raise SettingsError(f"server.api_key_file {file} is empty: put the API key in it")
    return key


def api_config(settings: Settings) -> ApiConfig:
    return ApiConfig(
        model_name=settings.served_model_name,
        model_names=settings.served_model_names,
        limits=WireLimits(
            default_max_tokens=settings.limits.default_max_tokens,
            max_tokens=settings.limits.max_tokens,
            clamp_max_tokens=settings.limits.clamp_max_tokens,
            schemas=settings.limits.schemas(),
        ),
        max_body_bytes=settings.limits.max_body_bytes,
        keepalive_seconds=settings.server.keepalive_seconds,
        idle_timeout_seconds=settings.server.idle_timeout_seconds,
        request_timeout_seconds=settings.server.request_timeout_seconds,
        send_timeout_seconds=settings.server.send_timeout_seconds,
        min_body_bytes_per_second=settings.server.min_body_bytes_per_second,
        min_send_bytes_per_second=settings.server.min_send_bytes_per_second,
        max_connections=settings.server.max_connections,
        grammar_compile_seconds=settings.limits.grammar_compile_seconds,
        api_key=read_api_key(settings.server.api_key_file),
        cors_origins=tuple(settings.server.cors_origins),
        allowed_hosts=tuple(settings.server.allowed_hosts),
        public_paths=frozenset({"/health", *webchat.PAGE_PATHS}),
    )


def build_engine(settings: Settings, metrics: Metrics, runtime: Runtime | None = None) -> Engine:
    limits = EngineLimits(
        queue_size=settings.limits.queue_size,
        max_concurrent=settings.limits.max_concurrent,
        cached_sessions=settings.limits.cached_sessions,
        stream_interval=settings.server.stream_interval_ms / 1000.0,
        batch_passes=settings.limits.batch_passes,
        max_pass_tokens=settings.limits.max_pass_tokens,
    )

    def factory(options: RuntimeOptions) -> Runtime:
        return runtime if runtime is not None else Runtime(options)

    pressure = thresholds_from(settings.memory_pressure)
    return Engine(
        settings.runtime_options(), limits, metrics, runtime_factory=factory, pressure=pressure
    )


class Server:
    """One daemon: the engine, the aiohttp app and its listening site."""

    def __init__(self, settings: Settings, runtime: Runtime | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.engine = build_engine(settings, self.metrics, runtime)
        self.app = create_app(self.engine, self.metrics, api_config(settings))
        webchat.add_routes(self.app)
        self.runner: AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        self.runner = AppRunner(
            self.app,
            handle_signals=False,
            access_log=log if self.settings.logging.access_log else None,
            shutdown_timeout=10.0,
            # aiohttp closes a connection waiting this long for a request head (idle
            # between requests, or half of one sent): its own default is an hour.
            keepalive_timeout=self.settings.server.idle_timeout_seconds,
            max_connections=self.settings.server.max_connections,
            max_connections_per_client=self.settings.server.max_connections_per_client,
        )
        await self.runner.setup()
        host, port = self.settings.server.host, self.settings.server.port
        site = web.TCPSite(self.runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # the port is taken, the host is not this machine's, …
            await self.runner.cleanup()
            raise ListenError(host, port, exc) from None
        self.port = self.runner.addresses[0][1]
        log.info("%s", listening_on(host, self.port))
        exposed = exposed_without_key(self.settings.server)
        if exposed is not None:
            log.warning("%s", exposed)
        self.engine.start()  # models load on the engine thread; /health says 503 until then

    async def stop(self) -> None:
        """Stop accepting, end in-flight generations with an error event, close."""
        self.app[DRAINING].set()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        if self.runner is not None:
            await self.runner.cleanup()


async def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or until the models fail to load (exit 2)."""
    server = Server(settings)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def stopping(sig: int) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping, sig)
    await server.start()
    loaded: asyncio.Future[bool] = loop.run_in_executor(None, server.engine.loaded.wait)
    stopper: asyncio.Future[bool] = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loaded, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if loaded.done() and server.engine.load_error is not None:
        log.error("specd cannot serve: %s", server.engine.load_error)
        stopper.cancel()
        await server.stop()
        return 2
    if not stopper.done():
        log.info("ready: serving %s", settings.served_model_name)
        await stopper
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    # Another SIGTERM changes nothing, the stop is under way: ignored for good (the loop's
    # handlers go when it closes, and one during the interpreter's exit killed the process:
    # exit status -15 after a clean stop). Another Ctrl-C is a person's "quit now".
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    again = " (Ctrl-C again to quit at once)" if signal.SIGINT in received else ""
    log.info("stopping: ending in-flight requests%s", again)
    await server.stop()
    log.info("stopped")
    return 0


class BackgroundServer:
    """A `Server` on its own thread and event loop; `with BackgroundServer(s) as srv:`."""

    def __init__(self, settings: Settings, runtime: Runtime | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = Server(settings, runtime)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return daemon_url(self.server.settings.server.host, self.server.port)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=30)
        if not self.server.engine.loaded.wait(timeout=120):
            raise TimeoutError("the models did not load within 120 s")
        if self.server.engine.load_error is not None:
            raise self.server.engine.load_error
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
