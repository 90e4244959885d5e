"""Loading the daemon's settings (daemon/settings.py): YAML → typed dataclasses, with every
value's origin kept.

Layers, lowest first: the packaged default (config/specd.yaml), the user config file
(platformdirs' config dir, or `--config FILE`), `SPECD_<SECTION>_<KEY>` environment
variables, and command-line flags. A later layer replaces single keys, never whole sections.
Unknown keys, wrong types and out-of-range values are `SettingsError`s that list every
problem at once, one line each: `WHERE: KEY: what is wrong; what is allowed`, where WHERE is
the file, `env VARIABLE` or the `--flag`.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import yaml

from daemon.settings import (
    SECTION_ALIASES,
    SECTIONS,
    Settings,
    SettingsError,
    attribute,
    user_config_file,
)
from daemon.settings_yaml import MAX_CONFIG_BYTES, NotYAML, parse_yaml
from daemon.small_files import SmallFileError, read_small

PACKAGED_DEFAULT = Path(__file__).resolve().parents[1] / "config" / "specd.yaml"
PROFILES_DIR = PACKAGED_DEFAULT.parent / "profiles"
log = logging.getLogger("specd.settings")

ENV_PREFIX = "SPECD_"
# specd's variables that are no configuration key (its scripts' and tests'), one of them a
# section's name misspelt to the eye of `env_layer`.
SCRIPT_VARIABLES = frozenset({"SPECD_MODEL_CACHE"})


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = read_small(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise SettingsError(f"{path}: the file does not exist; give an existing file") from None
    except SmallFileError as exc:
        raise SettingsError(f"{exc}; give a configuration file") from None
    except OSError as exc:
        raise SettingsError(f"{path}: cannot be read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(
            f"{path}: the top level is {_kind(data)}; it must be a mapping of sections ({_names()})"
        )
    return data


def _shown(value: Any, most: int = 80) -> str:
    """A value as an error line shows it: its repr, cut to `most` characters."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


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
    for spelled, body in _sections(data):
        section = SECTION_ALIASES.get(spelled, spelled)
        if section not in SECTIONS:
            problems.append(
                f"{origin}: {spelled}: unknown section{_near(spelled, [*SECTIONS])}; sections "
                f"are {_names()}"
            )
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
                    f"{origin}: {spelled}.{key}: unknown key{_near(key, known)}; {spelled} keys "
                    f"are {', '.join(known)}"
                )
                continue
            flat[f"{section}.{key}"] = value
    return flat, problems


def _near(name: Any, known: list[str]) -> str:
    """ " (did you mean NAME?)" for the known name closest to a misspelt one, as the
    command line's flags say it; "" where none is close."""
    near = difflib.get_close_matches(str(name)[:100], known, 1, 0.6)
    return f" (did you mean {near[0]}?)" if near else ""


def _sections(data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The file's sections by their dotted names: `memory: {pressure: {...}}` is the
    section memory.pressure (a parent of sections holds nothing else)."""
    out: list[tuple[str, Any]] = []
    for spelled, body in data.items():
        nested = [n for n in SECTIONS if n.startswith(f"{spelled}.")]
        if nested and isinstance(body, dict):
            out += [(f"{spelled}.{sub}", inner) for sub, inner in body.items()]
        else:
            out.append((spelled, body))
    return out


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
        # The longest name first: memory_pressure_* is memory.pressure's, not memory's.
        names = sorted([*SECTIONS, *SECTION_ALIASES], key=len, reverse=True)
        spelled = next((s for s in names if rest.startswith(attribute(s) + "_")), None)
        if spelled is None:
            # Another tool's (SPECD_TORCH_SPEC), but one whose first word is a section's
            # misspelt is said (SPECD_SERVR_PORT was ignored without a word).
            first = rest.split("_", 1)[0]
            near = difflib.get_close_matches(first, [attribute(n) for n in names], 1, 0.75)
            if near and var not in SCRIPT_VARIABLES:
                log.warning(
                    "env %s: no section %r, so it is not read; did you mean %s%s_...?",
                    var, first, ENV_PREFIX, near[0].upper(),
                )  # fmt: skip
            continue
        section = SECTION_ALIASES.get(spelled, spelled)
        key = rest[len(attribute(spelled)) + 1 :]
        known = [f.name for f in fields(SECTIONS[section])]
        if key not in known:
            problems.append(
                f"env {var}: {section}.{key}: unknown key{_near(key, known)}; {section} keys "
                f"are {', '.join(known)}"
            )
            continue
        try:
            value = parse_yaml(raw, f"env {var}") if raw != "" else None
        except NotYAML:
            value = raw  # (taken as the text it is)
        except SettingsError as exc:  # (an alias bomb, a nesting past any configuration)
            problems += exc.problems
            continue
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
                problems.append(f"{where}: {key}: {_shown(raw)} is not allowed; expected {exc}")
            sources[key] = source
        if not problems:
            sections[name] = cls(**kwargs)
    if not problems:
        problems += _between_keys(sections, sources)
    if problems:
        raise SettingsError(problems)
    return Settings(**{attribute(n): v for n, v in sections.items()}, sources=sources)


def _between_keys(sections: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    """Values each allowed alone that contradict one another."""
    limits = sections["limits"]
    default, cap = limits.default_max_tokens, limits.max_tokens
    if default <= cap:
        return []
    # (a request that gave no max_tokens would run past the cap every other one has) The
    # one of the two a user set is named: a cap lowered below the packaged default.
    if sources["limits.default_max_tokens"] in ("default", "built-in"):
        where = sources["limits.max_tokens"].removeprefix("file ")
        return [
            f"{where}: limits.max_tokens: {cap} is not allowed; expected at least "
            f"limits.default_max_tokens ({default}), or lower that too"
        ]
    where = sources["limits.default_max_tokens"].removeprefix("file ")
    return [
        f"{where}: limits.default_max_tokens: {default} is not allowed; expected at most "
        f"limits.max_tokens ({cap})"
    ]


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
        parent, _, child = section.rpartition(".")
        if parent:  # a section inside a section: memory: / pressure:
            lines += [f"{parent}:", f"  {child}:"]
        else:
            lines.append(f"{section}:")
        indent = "    " if parent else "  "
        for key, value in body.items():
            shown = yaml.safe_dump(value, default_flow_style=True).strip()
            shown = shown.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"{indent}{key}: {shown}  # {settings.sources[f'{section}.{key}']}")
    return "\n".join(lines) + "\n"
