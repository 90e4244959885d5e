"""Prometheus text exposition of the daemon's counters (GET /metrics).

A handful of counters, gauges and one histogram, written by hand: the format is small, and
the engine thread and the event loop both update them, so each update takes one lock.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from speculative.generation import GenerationStats

# Keys the offload streamer may add to GenerationStats.extra: bytes moved host → device and
# the seconds spent moving them during the generation.
# (offload.stream.LayerStreamer.stats, via Runtime.offload_stats)
STREAM_BYTES_KEYS = ("streamed_bytes_total",)
STREAM_SECONDS_KEYS = ("stream_seconds",)


@dataclass
class Counter:
    name: str
    help: str
    value: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def inc(self, amount: float = 1.0) -> None:
        with self.lock:
            self.value += amount

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter",
                f"{self.name} {_num(self.value)}"]  # fmt: skip


@dataclass
class Gauge:
    name: str
    help: str
    value: float = 0.0

    def set(self, value: float) -> None:
        self.value = value

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge",
                f"{self.name} {_num(self.value)}"]  # fmt: skip


@dataclass
class Histogram:
    name: str
    help: str
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observations: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        with self.lock:
            i = bisect.bisect_left(self.buckets, value)
            if i < len(self.counts):
                self.counts[i] += 1
            self.total += value
            self.observations += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            running += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.observations}')
        lines.append(f"{self.name}_sum {_num(self.total)}")
        lines.append(f"{self.name}_count {self.observations}")
        return lines


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) → count
        self.prompt_tokens = Counter("specd_prompt_tokens_total", "Prompt tokens received.")
        self.cached_prompt_tokens = Counter(
            "specd_cached_prompt_tokens_total", "Prompt tokens reused from a KV cache."
        )
        self.completion_tokens = Counter(
            "specd_completion_tokens_total", "Tokens generated (including stop tokens)."
        )
        self.target_passes = Counter(
            "specd_target_passes_total", "Decode (verification) passes of the target model."
        )
        self.prefill_passes = Counter("specd_prefill_passes_total", "Prefill passes.")
        self.drafted = Counter("specd_draft_tokens_proposed_total", "Draft tokens proposed.")
        self.accepted = Counter(
            "specd_draft_tokens_accepted_total", "Draft tokens the target accepted."
        )
        self.prefix_cache_hits = Counter(
            "specd_prefix_cache_hits_total",
            "Tokens drawn from cached target logits of verified tree nodes (no target pass).",
        )
        self.prefix_cache_misses = Counter(
            "specd_prefix_cache_misses_total",
            "Prefix cache look-ups that found no cached target logits.",
        )
        self.cancelled = Counter(
            "specd_cancelled_total", "Generations dropped because the client went away."
        )
        self.failed = Counter("specd_failed_total", "Generations that ended in an error.")
        self.queue_depth = Gauge("specd_queue_depth", "Requests waiting for the engine.")
        self.stream_bytes = Counter(
            "specd_stream_bytes_total", "Target weight bytes streamed host to device."
        )
        self.stream_seconds = Counter(
            "specd_stream_seconds_total", "Seconds spent streaming target weights."
        )
        self.passes = Counter(
            "specd_passes_total",
            "Target passes the engine ran (one serves every generation batched into it).",
        )
        self.generations_per_pass = Histogram(
            "specd_generations_per_pass",
            "Generations whose work one target pass carried.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
        )
        self.tokens_per_pass = Histogram(
            "specd_tokens_per_pass",
            "Tokens one target pass carried, over all its generations.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
        )
        self.time_to_first_token = Histogram(
            "specd_time_to_first_token_seconds",
            "Seconds from a request entering the engine to its first generated token.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

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
        for key in STREAM_BYTES_KEYS:
            if isinstance(stats.extra.get(key), int | float):
                self.stream_bytes.inc(stats.extra[key])
        for key in STREAM_SECONDS_KEYS:
            if isinstance(stats.extra.get(key), int | float):
                self.stream_seconds.inc(stats.extra[key])

    def render(self) -> str:
        lines = [
            "# HELP specd_requests_total HTTP requests by endpoint and status.",
            "# TYPE specd_requests_total counter",
        ]
        with self._lock:
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'specd_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        for metric in (
            self.prompt_tokens,
            self.cached_prompt_tokens,
            self.completion_tokens,
            self.target_passes,
            self.prefill_passes,
            self.drafted,
            self.accepted,
            self.prefix_cache_hits,
            self.prefix_cache_misses,
            self.cancelled,
            self.failed,
            self.queue_depth,
            self.stream_bytes,
            self.stream_seconds,
            self.passes,
        ):
            lines += metric.render()
        per_pass = (
            self.completion_tokens.value / self.target_passes.value
            if self.target_passes.value
            else 0.0
        )
        lines += Gauge(
            "specd_tokens_per_target_pass",
            "Generated tokens per decode pass of the target, over all requests.",
            per_pass,
        ).render()
        bandwidth = (
            self.stream_bytes.value / self.stream_seconds.value
            if self.stream_seconds.value
            else 0.0
        )
        lines += Gauge(
            "specd_stream_bandwidth_bytes_per_second",
            "Average host-to-device bandwidth of target weight streaming.",
            bandwidth,
        ).render()
        lines += self.generations_per_pass.render()
        lines += self.tokens_per_pass.render()
        lines += self.time_to_first_token.render()
        return "\n".join(lines) + "\n"
