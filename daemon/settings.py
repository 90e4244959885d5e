"""The daemon's settings: typed dataclasses, one per section of the YAML config, each key with
its built-in default and its check (daemon/settings_checks.py); the values every front end accepts for an option
(`DTYPE_CHOICES`, `STRATEGY_CHOICES`, …); `Settings.runtime_options`, what the runtime
is built from. The id the target is served under and the names a request may give it are
daemon/served_names.py. Where the values come from (files, environment,
flags) is daemon/settings_loading.py; the URL a client reaches a daemon at, and what is
told where it listens, daemon/addresses.py."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import platformdirs

from daemon.options import RuntimeOptions
from daemon.served_names import served_model_aliases, served_model_id
from daemon.settings_checks import (
    Check,
    choice,
    flag,
    host_list,
    host_name,
    integer,
    number,
    rate,
    rate_or_null,
    size_auto_or_zero,
    size_bytes,
    size_or_auto,
    size_or_zero,
    text,
    text_list,
)
from speculative.schema_limits import SchemaLimits

# The values of the options that every front end (flags, config file, REST API) accepts, named
# once. Restated from modules that import torch (modeling.checkpoints.checkpoint.DTYPE_CHOICES,
# modeling.weights.quant.QUANTIZE_CHOICES, daemon.runtime.STRATEGY_BUILDERS,
# speculative.acceptance.TREE_VERIFICATION_CHOICES) so that reading the
# settings or building the command line does not; tests/test_cli_startup.py checks they agree.
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
QUANTIZE_CHOICES = ("int8", "int4")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
STRATEGY_CHOICES = ("autoregressive", "linear", "tree")
TREE_VERIFICATION_CHOICES = ("auto", "walk", "rejection")  # speculative.acceptance
SUBSTITUTE_BITS_CHOICES = ("auto", 8, 4, 3, 2)  # modeling.substitute
COMPILE_CHOICES = ("auto", "off", "on")


NO_DRAFT = "none"  # models.draft / --draft: plain decoding (as null is in a file)


def no_draft(value: str | None) -> str | None:
    """A draft reference as RuntimeOptions takes it: "none" is None (no draft)."""
    return None if value is None or value.lower() == NO_DRAFT else value


def learned_cache_dir(value: str | None) -> str | None:
    """models.learned_cache as a folder: auto is the state directory's learned/."""
    if value == "auto":
        return str(Path(platformdirs.user_state_dir("specd")) / "learned")
    return None if value is None else str(Path(value).expanduser())


def substitute_cache_dir(value: str | None) -> str | None:
    """models.substitute_cache as a folder: auto is the state directory's substitutes/."""
    if value == "auto":
        return str(Path(platformdirs.user_state_dir("specd")) / "substitutes")
    return None if value is None else str(Path(value).expanduser())


class SettingsError(ValueError):
    """Configuration that cannot be used: one line per problem in `problems`, each saying
    where the value came from, the key, what is wrong and what is allowed."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def _key(default: Any, check: Check) -> Any:
    return field(default=default, metadata={"check": check})


# ---- the schema: one dataclass per section ----


@dataclass
class ModelsSettings:
    target: str | None = _key(None, text(nullable=True))
    # auto (the default: daemon/draft_choice.py), a model, ngram, substitute, or null /
    # "none" for no draft (plain decoding).
    draft: str | None = _key("auto", text(nullable=True))
    name: str | None = _key(None, text(nullable=True))
    dtype: str = _key("auto", choice(*DTYPE_CHOICES))
    # int8 | int4: quantize a full-precision checkpoint's projections as they load (null:
    # load as stored; GPTQ/AWQ/compressed-tensors checkpoints are always loaded as stored).
    quantize: str | None = _key(None, choice(None, *QUANTIZE_CHOICES))
    draft_quantize: str | None = _key(None, choice(None, *QUANTIZE_CHOICES))
    # draft: substitute: bits of the target's own HQQ layers, or auto (the most that fit).
    substitute_bits: int | str = _key("auto", choice(*SUBSTITUTE_BITS_CHOICES))
    # Where built substitutes are kept for the next start: auto (the state directory's
    # substitutes/), a folder, or null (build at every start).
    substitute_cache: str | None = _key("auto", text(nullable=True))
    # Where what trees learn about a model pair (acceptance, `auto`'s pass costs) is kept
    # for the next start: auto (the state directory's learned/), a folder, or null (every
    # start from the prior).
    learned_cache: str | None = _key("auto", text(nullable=True))
    device: str = _key("auto", choice(*DEVICE_CHOICES))
    threads: int | str = _key("auto", integer(1, 1024, auto=True))


def compile_choice(value: Any) -> Any:
    """auto | off | on. YAML reads a bare on/off as a boolean (in files and in SPECD_*
    variables alike): true means on, false off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in COMPILE_CHOICES:
        raise ValueError(f"one of {', '.join(COMPILE_CHOICES)}")
    return value


@dataclass
class RuntimeSettings:
    compile: str = _key("auto", compile_choice)


@dataclass
class SpeculationSettings:
    strategy: str | None = _key(None, choice(None, *STRATEGY_CHOICES))
    budget: int | str = _key("auto", integer(1, 65536, auto=True))
    max_depth: int | None = _key(None, integer(1, 1024, nullable=True))
    tree_verification: str = _key("auto", choice(*TREE_VERIFICATION_CHOICES))
    spec_length: int = _key(4, integer(1, 64))
    prefix_cache: int | str = _key("1GiB", size_or_zero)


@dataclass
class OffloadSettings:
    mode: str = _key("auto", choice("auto", "none", "stream"))
    resident_layers: int | str = _key("auto", integer(0, 1024, auto=True))
    slots: int = _key(2, integer(2, 16))  # offload.plan.MIN_SLOTS, MAX_SLOTS (which import torch)
    gpu_budget: str = _key("auto", size_or_auto)
    host_tier: str = _key("auto", choice("auto", "ram", "disk"))
    experts: str = _key("auto", choice("auto", "device", "stream", "cpu"))
    expert_slots: int | None = _key(None, integer(1, 1 << 20, nullable=True))
    ram_budget: str = _key("auto", size_or_auto)
    bandwidth: str | None = _key(None, rate_or_null)
    cpu_rate: str | None = _key(None, rate_or_null)


@dataclass
class ContextSettings:
    # auto: the longest that fits (at least 4096); null is read as auto (it used to mean the
    # model's maximum, which auto picks whenever that fits).
    length: int | str | None = _key("auto", integer(16, 1 << 20, nullable=True, auto=True))


@dataclass
class ServerSettings:
    host: str = _key("127.0.0.1", host_name)
    port: int = _key(8716, integer(0, 65535))
    api_key_file: str | None = _key(None, text(nullable=True))
    cors_origins: list[str] = field(default_factory=list, metadata={"check": text_list})
    allowed_hosts: list[str] = field(default_factory=list, metadata={"check": host_list})
    keepalive_seconds: float = _key(5.0, number(0.05, 300.0))
    stream_interval_ms: int = _key(20, integer(0, 1000))
    # A connection without a whole request head for this long (idle between requests, or
    # one that sends half a request line or header) is closed.
    idle_timeout_seconds: float = _key(15.0, number(0.05, 3600.0))
    # A request's body must arrive within this long of its head, and at least
    # min_body_bytes_per_second after the first second: else 408 and the connection closes.
    request_timeout_seconds: float = _key(60.0, number(0.05, 3600.0))
    # An answer (streamed or whole) the client reads none of for this long closes its
    # connection.
    send_timeout_seconds: float = _key(60.0, number(0.05, 3600.0))
    min_body_bytes_per_second: int = _key(4096, integer(0, 1 << 30))
    # While an answer waits on a client with its buffers full, the client must take this
    # many bytes a second on average, counted from send_timeout_seconds on (0: no floor),
    # else its connection is dropped.
    min_send_bytes_per_second: int = _key(1024, integer(0, 1 << 30))
    # Open connections at most; one more is answered 503 (Retry-After) and closed.
    max_connections: int = _key(256, integer(1, 1 << 20))
    # Open connections from one client (an IPv4 address, an IPv6 /64) at most; one more
    # is answered 503 and closed.
    max_connections_per_client: int = _key(64, integer(1, 1 << 20))


@dataclass
class LimitsSettings:
    max_body_bytes: int = _key(1 << 20, integer(1024, 1 << 30))
    queue_size: int = _key(32, integer(1, 100_000))
    max_concurrent: int = _key(8, integer(1, 1024))
    cached_sessions: int = _key(4, integer(0, 1024))
    default_max_tokens: int = _key(512, integer(1, 1 << 20))
    max_tokens: int = _key(8192, integer(1, 1 << 20))
    # A request's max_tokens larger than the room its prompt leaves in the context: a 400
    # context_length_exceeded (false) or cut to the room, said in the response (true).
    clamp_max_tokens: bool = _key(False, flag)
    # One target pass per step for all active generations (false: interleaved rounds).
    batch_passes: bool = _key(True, flag)
    # Tokens one batched pass may carry; null: the memory plan's largest pass.
    max_pass_tokens: int | None = _key(None, integer(1, 1 << 20, nullable=True))
    # What a request's JSON Schema (response_format, a tool's parameters) may hold before
    # it reaches the grammar compiler (speculative/schema_limits.py), and how long one
    # compile may take (speculative/grammar_compiler.py).
    schema_max_depth: int = _key(64, integer(1, 1024))
    schema_max_ref_chain: int = _key(32, integer(0, 1024))
    schema_max_members: int = _key(2000, integer(1, 100_000))
    schema_max_bytes: int = _key(256 << 10, integer(64, 1 << 30))
    schema_max_pattern_properties: int = _key(64, integer(0, 100_000))
    schema_max_repetition: int = _key(200_000, integer(1, 1 << 30))
    grammar_compile_seconds: float = _key(5.0, number(0.1, 600.0))

    def schemas(self) -> SchemaLimits:
        return SchemaLimits(
            max_depth=self.schema_max_depth,
            max_ref_chain=self.schema_max_ref_chain,
            max_members=self.schema_max_members,
            max_bytes=self.schema_max_bytes,
            max_pattern_properties=self.schema_max_pattern_properties,
            max_repetition=self.schema_max_repetition,
        )


@dataclass
class MemoryPressureSettings:
    """memory.pressure: watching free memory while serving, and what is given up when it
    runs short (daemon/pressure.py)."""

    enabled: bool = _key(True, flag)
    period_seconds: float = _key(1.0, number(0.05, 60.0))
    # Host RAM available (psutil) below which the level is tight, critical; auto: 2 GiB or
    # half of what is available once the models are loaded, if less; critical half that.
    tight_host_free: int | str = _key("auto", size_auto_or_zero)
    critical_host_free: int | str = _key("auto", size_auto_or_zero)
    # Free device memory: auto is a tenth of the margin the memory plan left (at least
    # 256 MiB) for tight, half of that for critical.
    tight_device_free: int | str = _key("auto", size_auto_or_zero)
    critical_device_free: int | str = _key("auto", size_auto_or_zero)
    # Swapping faster than this (in and out together) is critical.
    critical_swap_rate: str = _key("16MB/s", rate)
    # How long memory must stay back above a line before its level is left, and between
    # two relief steps undone.
    recover_seconds: float = _key(10.0, number(0.0, 3600.0))


@dataclass
class LoggingSettings:
    level: str = _key("info", choice("debug", "info", "warning", "error"))
    access_log: bool = _key(False, flag)


SECTIONS: dict[str, type] = {
    "models": ModelsSettings,
    "runtime": RuntimeSettings,
    "speculation": SpeculationSettings,
    "offload": OffloadSettings,
    "context": ContextSettings,
    "server": ServerSettings,
    "limits": LimitsSettings,
    "logging": LoggingSettings,
    # A section inside a section: `memory: {pressure: {...}}` in YAML, memory.pressure.KEY
    # in messages, SPECD_MEMORY_PRESSURE_KEY in the environment.
    "memory.pressure": MemoryPressureSettings,
}
# Other spellings of a section. "speculative" because the issue that added
# speculative.prefix_cache named it so; a file may use one spelling, not both.
SECTION_ALIASES = {"speculative": "speculation"}


@dataclass
class Settings:
    models: ModelsSettings
    runtime: RuntimeSettings
    speculation: SpeculationSettings
    offload: OffloadSettings
    context: ContextSettings
    server: ServerSettings
    limits: LimitsSettings
    logging: LoggingSettings
    memory_pressure: MemoryPressureSettings
    sources: dict[str, str]  # "section.key" → where the effective value came from

    def runtime_options(self) -> RuntimeOptions:
        return RuntimeOptions(
            model=self.require_target(),
            draft=no_draft(self.models.draft),
            strategy=self.speculation.strategy,
            spec_length=self.speculation.spec_length,
            budget=self.speculation.budget,
            max_depth=self.speculation.max_depth,
            tree_verification=self.speculation.tree_verification,
            prefix_cache=size_bytes(self.speculation.prefix_cache),
            dtype=self.models.dtype,
            quantize=self.models.quantize,
            draft_quantize=self.models.draft_quantize,
            substitute_bits=self.models.substitute_bits,
            substitute_cache=substitute_cache_dir(self.models.substitute_cache),
            learned_cache=learned_cache_dir(self.models.learned_cache),
            device=self.models.device,
            context="auto" if self.context.length is None else self.context.length,
            offload=self.offload.mode,
            resident_layers=self.offload.resident_layers,
            slots=self.offload.slots,
            gpu_budget=self.offload.gpu_budget,
            host_tier=self.offload.host_tier,
            experts=self.offload.experts,
            expert_slots=self.offload.expert_slots,
            ram_budget=self.offload.ram_budget,
            bandwidth=self.offload.bandwidth,
            cpu_rate=self.offload.cpu_rate,
            threads=self.models.threads,
            compile=self.runtime.compile,
            sequences=self.limits.max_concurrent + self.limits.cached_sessions,
        )

    def require_target(self) -> str:
        """The target model, or a SettingsError that says how to configure one."""
        if not self.models.target:
            raise SettingsError(
                "no target model configured: pass --model MODEL, set SPECD_MODELS_TARGET, or "
                f"set models.target in {user_config_file()}"
            )
        return self.models.target

    @property
    def served_model_name(self) -> str:
        """The id clients put in `model`: configured, or the target's (`served_model_id`)."""
        if self.models.name:
            return self.models.name
        return served_model_id(self.models.target or "model")

    @property
    def served_model_names(self) -> frozenset[str]:
        """Every `model` a request may name: the id, and where no name is configured the
        target's other spellings (`served_model_aliases`)."""
        if self.models.name or not self.models.target:
            return frozenset({self.served_model_name})
        return frozenset({self.served_model_name, *served_model_aliases(self.models.target)})

    def effective(self) -> dict[str, dict[str, Any]]:
        return {
            name: {f.name: getattr(self.section(name), f.name) for f in fields(cls)}
            for name, cls in SECTIONS.items()
        }

    def section(self, name: str) -> Any:
        """A section's settings by its name ("server", "memory.pressure")."""
        return getattr(self, attribute(name))


def attribute(section: str) -> str:
    """The Settings attribute of a section: "memory.pressure" → memory_pressure."""
    return section.replace(".", "_")


def user_config_file() -> Path:
    return Path(platformdirs.user_config_dir("specd")) / "specd.yaml"
