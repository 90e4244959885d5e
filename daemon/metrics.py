"""The daemon's counters, gauges and histograms, exposed at GET /metrics by
`prometheus_client` (the exposition format, its escaping and the histogram semantics are
the library's, as in every Python exporter).

Each figure is one small object: the engine thread and the event loop both update them,
and readers in the daemon (the web chat's status, tests) read `value`, `total` and
`observations` from it rather than from the library's private fields.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import prometheus_client as prom

from daemon.pressure import LEVELS, PressureMonitor
from daemon.relief import Relief
from speculative.rounds import GenerationStats

# Keys the offload streamer may add to GenerationStats.extra: bytes moved host → device and
# the seconds spent moving them during the generation.
# (offload.stream.LayerStreamer.stats, via Runtime.offload_stats)
STREAM_BYTES_KEYS = ("streamed_bytes_total",)
STREAM_SECONDS_KEYS = ("stream_seconds",)


class Counter:
    """A counter named as exposed (`..._total`)."""

    def __init__(self, name: str, help: str, registry: prom.CollectorRegistry) -> None:
        self.name, self.value = name, 0.0
        self._lock = threading.Lock()
        self._metric = prom.Counter(name.removesuffix("_total"), help, registry=registry)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount
            self._metric.inc(amount)


class Gauge:
    def __init__(self, name: str, help: str, registry: prom.CollectorRegistry) -> None:
        self.name, self.value = name, 0.0
        self._metric = prom.Gauge(name, help, registry=registry)

    def set(self, value: float) -> None:
        self.value = value
        self._metric.set(value)


class Histogram:
    def __init__(
        self, name: str, help: str, buckets: Sequence[float], registry: prom.CollectorRegistry
    ) -> None:
        self.name, self.total, self.observations = name, 0.0, 0
        self._lock = threading.Lock()
        self._metric = prom.Histogram(name, help, buckets=tuple(buckets), registry=registry)

    def observe(self, value: float) -> None:
        with self._lock:
            self.total += value
            self.observations += 1
            self._metric.observe(value)


class Metrics:
    def __init__(self) -> None:
        # One registry per daemon (tests run several): nothing in the library's global one.
        self.registry = prom.CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = prom.Counter(
            "specd_requests", "HTTP requests by endpoint and status.",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "specd_prompt_tokens_total", "Prompt tokens received.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "specd_cached_prompt_tokens_total", "Prompt tokens reused from a KV cache.", registry=r
        )
        self.completion_tokens = Counter(
            "specd_completion_tokens_total", "Tokens generated (including stop tokens).", registry=r
        )
        self.target_passes = Counter(
            "specd_target_passes_total",
            "Decode (verification) passes of the target model.",
            registry=r,
        )
        self.prefill_passes = Counter("specd_prefill_passes_total", "Prefill passes.", registry=r)
        self.drafted = Counter(
            "specd_draft_tokens_proposed_total", "Draft tokens proposed.", registry=r
        )
        self.accepted = Counter(
            "specd_draft_tokens_accepted_total", "Draft tokens the target accepted.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "specd_prefix_cache_hits_total",
            "Tokens drawn from cached target logits of verified tree nodes (no target pass).",
            registry=r,
        )
        self.forced_tokens = Counter(
            "specd_forced_tokens_total",
            "Tokens emitted without a pass: a response_format's grammar allowed only them.",
            registry=r,
        )
        self.prefix_cache_misses = Counter(
            "specd_prefix_cache_misses_total",
            "Prefix cache look-ups that found no cached target logits.",
            registry=r,
        )
        self.cancelled = Counter(
            "specd_cancelled_total", "Generations dropped because the client went away.", registry=r
        )
        self.failed = Counter(
            "specd_failed_total", "Generations that ended in an error.", registry=r
        )
        self.queue_depth = Gauge(
            "specd_queue_depth", "Requests waiting for the engine.", registry=r
        )
        self.stream_bytes = Counter(
            "specd_stream_bytes_total", "Target weight bytes streamed host to device.", registry=r
        )
        self.stream_seconds = Counter(
            "specd_stream_seconds_total", "Seconds spent streaming target weights.", registry=r
        )
        self.passes = Counter(
            "specd_passes_total",
            "Target passes the engine ran (one serves every generation batched into it).",
            registry=r,
        )
        self.generations_per_pass = Histogram(
            "specd_generations_per_pass",
            "Generations whose work one target pass carried.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.tokens_per_pass = Histogram(
            "specd_tokens_per_pass",
            "Tokens one target pass carried, over all its generations.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "specd_time_to_first_token_seconds",
            "Seconds from a request entering the engine to its first generated token.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.tokens_per_target_pass = Gauge(
            "specd_tokens_per_target_pass",
            "Generated tokens per decode pass of the target, over all requests.",
            r,
        )
        self.draft = prom.Gauge(
            "specd_draft_info",
            "What the daemon drafts with: 1 for its kind (model, substitute, ngram, none) "
            "and the substitute's bits (none for another draft).",
            ["kind", "substitute_bits"], registry=r,
        )  # fmt: skip
        self.expert_bytes = Counter(
            "specd_expert_bytes_total",
            "Bytes of routed experts copied to the device's expert cache (--experts stream).",
            registry=r,
        )
        self.experts_woken = Gauge(
            "specd_experts_woken_per_layer_pass",
            "Distinct experts a layer pass woke, over the latest generation (mixtures of experts).",
            r,
        )
        self.expert_hit_rate = Gauge(
            "specd_expert_cache_hit_rate",
            "Share of routed experts found in the device's expert cache, latest generation.",
            r,
        )
        self.stream_bandwidth = Gauge(
            "specd_stream_bandwidth_bytes_per_second",
            "Average host-to-device bandwidth of target weight streaming.",
            r,
        )
        self.pressure_level = Gauge(
            "specd_memory_pressure_level", "Memory pressure: 0 ok, 1 tight, 2 critical.", r
        )
        self.host_available = Gauge(
            "specd_host_available_bytes", "Host RAM available, at the last sample.", r
        )
        self.device_free = Gauge(
            "specd_device_free_bytes", "Free device memory at the last sample (-1: none).", r
        )
        self.relief_in_force = Gauge(
            "specd_memory_relief_steps", "Relief steps in force (memory pressure).", r
        )
        self._relief_taken = prom.Counter(
            "specd_memory_relief_steps_taken",
            "Times each relief step was taken (memory pressure).",
            ["step"], registry=r,
        )  # fmt: skip
        self._relief_seen: dict[str, int] = {}

    def record_pressure(self, monitor: PressureMonitor, relief: Relief) -> None:
        """The memory monitor's last sample and the relief steps in force (the engine
        calls this between passes)."""
        sample = monitor.sample
        self.pressure_level.set(LEVELS.index(monitor.level))
        if sample is not None:
            self.host_available.set(sample.host_available)
            self.device_free.set(sample.device_free if sample.device_free is not None else -1)
        self.relief_in_force.set(relief.taken)
        for name, count in relief.counts.items():
            new = count - self._relief_seen.get(name, 0)
            if new:
                self._relief_taken.labels(step=name).inc(new)
                self._relief_seen[name] = count

    def set_draft(self, kind: str | None, bits: int | None) -> None:
        """Label what the loaded runtime drafts with (once the models are loaded)."""
        self.draft.labels(kind=kind or "none", substitute_bits=str(bits or "none")).set(1)

    def count_request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint=endpoint, status=str(status)).inc()

    def record_pass(self, generations: int, tokens: int) -> None:
        self.passes.inc()
        self.generations_per_pass.observe(generations)
        self.tokens_per_pass.observe(tokens)

    def record_generation(self, stats: GenerationStats, completion_tokens: int) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.target_passes.inc(stats.decode_passes)
        self.prefill_passes.inc(stats.prefill_passes)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.prefix_cache_misses.inc(stats.prefix_cache_misses)
        self.forced_tokens.inc(stats.forced_tokens)
        for key in STREAM_BYTES_KEYS:
            if isinstance(stats.extra.get(key), int | float):
                self.stream_bytes.inc(stats.extra[key])
        for key in STREAM_SECONDS_KEYS:
            if isinstance(stats.extra.get(key), int | float):
                self.stream_seconds.inc(stats.extra[key])
        moved = stats.extra.get("expert_bytes_copied")
        if isinstance(moved, int | float):
            self.expert_bytes.inc(moved)
            self.experts_woken.set(float(stats.extra.get("experts_woken_per_layer_pass", 0)))
            self.expert_hit_rate.set(float(stats.extra.get("expert_hit_rate", 0)))

    def render(self) -> str:
        """The Prometheus text exposition; the two derived gauges are brought up to date
        first."""
        passes = self.target_passes.value
        self.tokens_per_target_pass.set(self.completion_tokens.value / passes if passes else 0.0)
        seconds = self.stream_seconds.value
        self.stream_bandwidth.set(self.stream_bytes.value / seconds if seconds else 0.0)
        return prom.generate_latest(self.registry).decode()
