"""The daemon's configuration: YAML → typed dataclasses, with every value's origin kept.

Layers, lowest first: the packaged default (config/specd.yaml), the user config file
(platformdirs' config dir, or `--config FILE`), `SPECD_<SECTION>_<KEY>` environment
variables, and command-line flags. A later layer replaces single keys, never whole sections.
Unknown keys, wrong types and out-of-range values are `SettingsError`s naming the file (or
variable), the key and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs
import yaml

from daemon.argtypes import size_bytes
from daemon.hostname import allowed_host_names
from offload.units import parse_rate, parse_size

if TYPE_CHECKING:  # daemon.runtime imports torch; commands that only read settings do not
    from daemon.runtime import RuntimeOptions

PACKAGED_DEFAULT = Path(__file__).resolve().parents[1] / "config" / "specd.yaml"
PROFILES_DIR = PACKAGED_DEFAULT.parent / "profiles"
ENV_PREFIX = "SPECD_"


class SettingsError(ValueError):
    """A configuration value that cannot be used (says where it came from and the fix)."""


# ---- value checks: each returns the normalised value or raises ValueError(allowed) ----

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
    if value == "auto":
        return value
    try:
        parse_size(value)
    except (ValueError, TypeError):
        raise ValueError("'auto' or a size such as 24GB or 512MiB") from None
    return value


def size_or_zero(value: Any) -> Any:
    try:
        size_bytes(value)
    except (ValueError, TypeError):
        raise ValueError("0 (off) or a size such as 1GiB or 512MB") from None
    return value


def rate_or_null(value: Any) -> Any:
    if value is None:
        return None
    try:
        parse_rate(value)
    except (ValueError, TypeError):
        raise ValueError("null (measured) or a rate such as 25GB/s") from None
    return value


def _key(default: Any, check: Check) -> Any:
    return field(default=default, metadata={"check": check})


# ---- the schema: one dataclass per section ----


@dataclass
class ModelsSettings:
    target: str | None = _key(None, text(nullable=True))
    draft: str | None = _key(None, text(nullable=True))
    name: str | None = _key(None, text(nullable=True))
    dtype: str = _key("auto", choice("auto", "fp32", "bf16", "fp16"))
    device: str = _key("auto", choice("auto", "cpu", "cuda"))
    threads: int | str = _key("auto", integer(1, 1024, auto=True))


@dataclass
class SpeculationSettings:
    strategy: str | None = _key(None, choice(None, "autoregressive", "linear", "tree"))
    budget: int | str = _key("auto", integer(1, 65536, auto=True))
    max_depth: int | None = _key(None, integer(1, 1024, nullable=True))
    spec_length: int = _key(4, integer(1, 64))
    prefix_cache: int | str = _key("1GiB", size_or_zero)


@dataclass
class OffloadSettings:
    mode: str = _key("auto", choice("auto", "none", "stream"))
    resident_layers: int | str = _key("auto", integer(0, 1024, auto=True))
    slots: int = _key(2, integer(2, 16))
    gpu_budget: str = _key("auto", size_or_auto)
    host_tier: str = _key("auto", choice("auto", "ram", "disk"))
    ram_budget: str = _key("auto", size_or_auto)
    bandwidth: str | None = _key(None, rate_or_null)


@dataclass
class ContextSettings:
    # auto: the longest that fits (at least 4096); null is read as auto (it used to mean the
    # model's maximum, which auto picks whenever that fits).
    length: int | str | None = _key("auto", integer(16, 1 << 20, nullable=True, auto=True))


@dataclass
class ServerSettings:
    host: str = _key("127.0.0.1", text())
    port: int = _key(8716, integer(0, 65535))
    api_key_file: str | None = _key(None, text(nullable=True))
    cors_origins: list[str] = field(default_factory=list, metadata={"check": text_list})
    allowed_hosts: list[str] = field(default_factory=list, metadata={"check": host_list})
    keepalive_seconds: float = _key(5.0, number(0.05, 300.0))
    stream_interval_ms: int = _key(20, integer(0, 1000))


@dataclass
class LimitsSettings:
    max_body_bytes: int = _key(1 << 20, integer(1024, 1 << 30))
    queue_size: int = _key(32, integer(1, 100_000))
    max_concurrent: int = _key(8, integer(1, 1024))
    cached_sessions: int = _key(4, integer(0, 1024))
    default_max_tokens: int = _key(512, integer(1, 1 << 20))
    max_tokens: int = _key(8192, integer(1, 1 << 20))
    # One target pass per step for all active generations (false: interleaved rounds).
    batch_passes: bool = _key(True, flag)
    # Tokens one batched pass may carry; null: the memory plan's largest pass.
    max_pass_tokens: int | None = _key(None, integer(1, 1 << 20, nullable=True))


@dataclass
class LoggingSettings:
    level: str = _key("info", choice("debug", "info", "warning", "error"))
    access_log: bool = _key(False, flag)


SECTIONS: dict[str, type] = {
    "models": ModelsSettings,
    "speculation": SpeculationSettings,
    "offload": OffloadSettings,
    "context": ContextSettings,
    "server": ServerSettings,
    "limits": LimitsSettings,
    "logging": LoggingSettings,
}
# Other spellings of a section. "speculative" because the issue that added
# speculative.prefix_cache named it so; a file may use one spelling, not both.
SECTION_ALIASES = {"speculative": "speculation"}


@dataclass
class Settings:
    models: ModelsSettings
    speculation: SpeculationSettings
    offload: OffloadSettings
    context: ContextSettings
    server: ServerSettings
    limits: LimitsSettings
    logging: LoggingSettings
    sources: dict[str, str]  # "section.key" → where the effective value came from

    def runtime_options(self) -> RuntimeOptions:
        from daemon.runtime import RuntimeOptions

        return RuntimeOptions(
            model=self.require_target(),
            draft=self.models.draft,
            strategy=self.speculation.strategy,
            spec_length=self.speculation.spec_length,
            budget=self.speculation.budget,
            max_depth=self.speculation.max_depth,
            prefix_cache=size_bytes(self.speculation.prefix_cache),
            dtype=self.models.dtype,
            device=self.models.device,
            context="auto" if self.context.length is None else self.context.length,
            offload=self.offload.mode,
            resident_layers=self.offload.resident_layers,
            slots=self.offload.slots,
            gpu_budget=self.offload.gpu_budget,
            host_tier=self.offload.host_tier,
            ram_budget=self.offload.ram_budget,
            bandwidth=self.offload.bandwidth,
            threads=self.models.threads,
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
        """The id clients put in `model`: configured, or the target folder / hub id's last part."""
        if self.models.name:
            return self.models.name
        return Path((self.models.target or "model").rstrip("/")).name

    def effective(self) -> dict[str, dict[str, Any]]:
        return {
            name: {f.name: getattr(getattr(self, name), f.name) for f in fields(cls)}
            for name, cls in SECTIONS.items()
        }


def user_config_file() -> Path:
    return Path(platformdirs.user_config_dir("specd")) / "specd.yaml"


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: the top level must be a mapping of sections ({_names()})")
    return data


def _names() -> str:
    return ", ".join(SECTIONS)


def flatten(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """{"server": {"port": 1}} → {"server.port": 1}, rejecting unknown sections and keys."""
    flat: dict[str, Any] = {}
    for alias, section in SECTION_ALIASES.items():
        if alias in data and section in data:
            raise SettingsError(
                f"{origin}: sections {section!r} and {alias!r} are one section spelled two "
                "ways; keep one of them"
            )
    for spelled, body in data.items():
        section = SECTION_ALIASES.get(spelled, spelled)
        if section not in SECTIONS:
            raise SettingsError(f"{origin}: unknown section {spelled!r}; sections are {_names()}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise SettingsError(f"{origin}: section {spelled!r} must be a mapping of keys")
        known = [f.name for f in fields(SECTIONS[section])]
        for key, value in body.items():
            if key not in known:
                raise SettingsError(
                    f"{origin}: unknown key {spelled}.{key}; {spelled} keys are {', '.join(known)}"
                )
            flat[f"{section}.{key}"] = value
    return flat


def env_layer(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """SPECD_SERVER_PORT=9000 → {"server.port": (9000, "env SPECD_SERVER_PORT")}. Values are
    parsed as YAML scalars/lists. Variables whose second part is not a section (such as
    SPECD_TORCH_SPEC, used by the set-up script) belong to other tools and are ignored."""
    layer: dict[str, tuple[Any, str]] = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :].lower()
        spelled = next((s for s in [*SECTIONS, *SECTION_ALIASES] if rest.startswith(s + "_")), None)
        if spelled is None:
            continue
        section = SECTION_ALIASES.get(spelled, spelled)
        key = rest[len(spelled) + 1 :]
        known = [f.name for f in fields(SECTIONS[section])]
        if key not in known:
            raise SettingsError(
                f"environment variable {var}: unknown key {section}.{key}; "
                f"{section} keys are {', '.join(known)}"
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        if f"{section}.{key}" in layer:
            raise SettingsError(
                f"environment variables {layer[f'{section}.{key}'][1].removeprefix('env ')} "
                f"and {var} set the same key {section}.{key}; unset one of them"
            )
        layer[f"{section}.{key}"] = (value, f"env {var}")
    return layer


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, tuple[Any, str]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """The effective settings. `config_file` replaces the user config file as its layer;
    `overrides` maps "section.key" → (value, source), e.g. from command-line flags."""
    values: dict[str, tuple[Any, str]] = {}
    for key, value in flatten(read_yaml(PACKAGED_DEFAULT), str(PACKAGED_DEFAULT)).items():
        values[key] = (value, "default")
    user = config_file if config_file is not None else user_config_file()
    if config_file is not None or user.is_file():
        for key, value in flatten(read_yaml(user), str(user)).items():
            values[key] = (value, f"file {user}")
    values.update(env_layer(os.environ if environ is None else environ))
    for key, (value, source) in (overrides or {}).items():
        if value is not None:
            values[key] = (value, source)
    return build(values)


def _built_in(f: Field[Any]) -> Any:
    """A key's value when no layer sets it: its default, or a fresh one (lists)."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def build(values: Mapping[str, tuple[Any, str]]) -> Settings:
    sections: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, cls in SECTIONS.items():
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            key = f"{name}.{f.name}"
            raw, source = values.get(key, (_built_in(f), "built-in"))
            try:
                kwargs[f.name] = f.metadata["check"](raw)
            except ValueError as exc:
                raise SettingsError(
                    f"{source}: {key} = {raw!r} is not allowed; expected {exc}"
                ) from None
            sources[key] = source
        sections[name] = cls(**kwargs)
    return Settings(**sections, sources=sources)


def validate_file(path: Path) -> Settings:
    """Check one file on its own (on top of the packaged default, no env or flags)."""
    values = {k: (v, "default") for k, v in flatten(read_yaml(PACKAGED_DEFAULT), "").items()}
    for key, value in flatten(read_yaml(path), str(path)).items():
        values[key] = (value, f"file {path}")
    return build(values)


def render_effective(settings: Settings) -> str:
    """YAML of the effective config, each value followed by where it came from."""
    lines: list[str] = []
    for section, body in settings.effective().items():
        lines.append(f"{section}:")
        for key, value in body.items():
            shown = yaml.safe_dump(value, default_flow_style=True).strip()
            shown = shown.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"  {key}: {shown}  # {settings.sources[f'{section}.{key}']}")
    return "\n".join(lines) + "\n"


def daemon_url(host: str, port: int | None) -> str:
    """The base URL a client uses to reach a daemon bound to `host`: an address that listens
    everywhere is reached through loopback, and IPv6 literals are bracketed."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"
