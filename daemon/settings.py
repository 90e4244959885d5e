"""The daemon's configuration: YAML → typed dataclasses, with every value's origin kept.

Layers, lowest first: the packaged default (config/specd.yaml), the user config file
(platformdirs' config dir, or `--config FILE`), `SPECD_<SECTION>_<KEY>` environment
variables, and command-line flags. A later layer replaces single keys, never whole sections.
Unknown keys, wrong types and out-of-range values are `SettingsError`s that list every
problem at once, one line each: `WHERE: KEY: what is wrong; what is allowed`, where WHERE is
the file, `env VARIABLE` or the `--flag`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs
import yaml

from daemon.http.hostname import allowed_host_names
from offload.units import parse_rate, parse_size

if TYPE_CHECKING:  # daemon.runtime imports torch; commands that only read settings do not
    from daemon.runtime import RuntimeOptions

PACKAGED_DEFAULT = Path(__file__).resolve().parents[1] / "config" / "specd.yaml"
PROFILES_DIR = PACKAGED_DEFAULT.parent / "profiles"


def size_bytes(value: int | str, what: str = "size") -> int:
    """Bytes of a size that may be off: 0 / '0', or a size such as 1GiB or 512MB."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} {value!r} is not a size")
    if value in (0, "0"):
        return 0
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{what} {value} must not be negative")
    return parse_size(value, what)


ENV_PREFIX = "SPECD_"


class SettingsError(ValueError):
    """Configuration that cannot be used: one line per problem in `problems`, each saying
    where the value came from, the key, what is wrong and what is allowed."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


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
    # int8 | int4: quantize a full-precision checkpoint's projections as they load (null:
    # load as stored; GPTQ/AWQ/compressed-tensors checkpoints are always loaded as stored).
    quantize: str | None = _key(None, choice(None, "int8", "int4"))
    draft_quantize: str | None = _key(None, choice(None, "int8", "int4"))
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
            quantize=self.models.quantize,
            draft_quantize=self.models.draft_quantize,
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
        raise SettingsError(f"{path}: the file does not exist; give an existing file") from None
    except OSError as exc:
        raise SettingsError(f"{path}: cannot be read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SettingsError(f"{path}: {where}not valid YAML ({problem}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(
            f"{path}: the top level is {_kind(data)}; it must be a mapping of sections ({_names()})"
        )
    return data


def _names() -> str:
    return ", ".join(SECTIONS)


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def flatten(data: Mapping[str, Any], origin: str) -> tuple[dict[str, Any], list[str]]:
    """{"server": {"port": 1}} → {"server.port": 1}, and a line for each unknown section,
    unknown key or section that is not a mapping (the rest of the file is still read)."""
    flat: dict[str, Any] = {}
    problems: list[str] = []
    for alias, section in SECTION_ALIASES.items():
        if alias in data and section in data:
            problems.append(
                f"{origin}: {alias}: the section {section!r} spelled another way; keep one of "
                "the two"
            )
    for spelled, body in data.items():
        section = SECTION_ALIASES.get(spelled, spelled)
        if section not in SECTIONS:
            problems.append(f"{origin}: {spelled}: unknown section; sections are {_names()}")
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            problems.append(
                f"{origin}: {spelled}: {_kind(body)} is not a section; a section is a "
                "mapping of keys"
            )
            continue
        known = [f.name for f in fields(SECTIONS[section])]
        for key, value in body.items():
            if key not in known:
                problems.append(
                    f"{origin}: {spelled}.{key}: unknown key; {spelled} keys are {', '.join(known)}"
                )
                continue
            flat[f"{section}.{key}"] = value
    return flat, problems


def env_layer(environ: Mapping[str, str]) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """SPECD_SERVER_PORT=9000 → {"server.port": (9000, "env SPECD_SERVER_PORT")}, and a line
    for each variable that cannot be used. Values are parsed as YAML scalars/lists.
    Variables whose second part is not a section (such as SPECD_TORCH_SPEC, used by the
    set-up script) belong to other tools and are ignored."""
    layer: dict[str, tuple[Any, str]] = {}
    problems: list[str] = []
    for var, raw in sorted(environ.items()):
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
            problems.append(
                f"env {var}: {section}.{key}: unknown key; {section} keys are {', '.join(known)}"
            )
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        if f"{section}.{key}" in layer:
            other = layer[f"{section}.{key}"][1].removeprefix("env ")
            problems.append(
                f"env {var}: {section}.{key}: also set by {other}; unset one of the two"
            )
            continue
        layer[f"{section}.{key}"] = (value, f"env {var}")
    return layer, problems


def _file_layer(path: Path, values: dict[str, tuple[Any, str]], problems: list[str]) -> None:
    """Put `path`'s keys over `values`; its problems go to `problems`."""
    try:
        flat, found = flatten(read_yaml(path), str(path))
    except SettingsError as exc:  # the file as a whole: missing, not YAML, not a mapping
        problems += exc.problems
        return
    problems += found
    for key, value in flat.items():
        values[key] = (value, f"file {path}")


def _default_layer() -> dict[str, tuple[Any, str]]:
    flat, problems = flatten(read_yaml(PACKAGED_DEFAULT), str(PACKAGED_DEFAULT))
    if problems:
        raise SettingsError(problems)
    return {key: (value, "default") for key, value in flat.items()}


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, tuple[Any, str]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """The effective settings. `config_file` replaces the user config file as its layer;
    `overrides` maps "section.key" → (value, source), e.g. from command-line flags.
    Every problem in every layer is reported in one SettingsError."""
    values = _default_layer()
    problems: list[str] = []
    user = config_file if config_file is not None else user_config_file()
    if config_file is not None or user.is_file():
        _file_layer(user, values, problems)
    env, env_problems = env_layer(os.environ if environ is None else environ)
    values.update(env)
    problems += env_problems
    for key, (value, source) in (overrides or {}).items():
        if value is not None:
            values[key] = (value, source)
    return build(values, problems)


def _built_in(f: Field[Any]) -> Any:
    """A key's value when no layer sets it: its default, or a fresh one (lists)."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def build(values: Mapping[str, tuple[Any, str]], problems: Sequence[str] = ()) -> Settings:
    """Settings from "section.key" → (value, source); raises a SettingsError listing
    `problems` (found while reading the layers) and every value that is not allowed."""
    problems = list(problems)
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
                where = source.removeprefix("file ")
                problems.append(f"{where}: {key}: {raw!r} is not allowed; expected {exc}")
            sources[key] = source
        if not problems:
            sections[name] = cls(**kwargs)
    if problems:
        raise SettingsError(problems)
    return Settings(**sections, sources=sources)


def validate_file(path: Path) -> Settings:
    """Check one file on its own (on top of the packaged default, no env or flags); the
    SettingsError lists every problem in it."""
    values = _default_layer()
    problems: list[str] = []
    _file_layer(path, values, problems)
    return build(values, problems)


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
