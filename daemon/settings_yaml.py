"""YAML as specd reads its configuration files and environment variables: PyYAML's safe
loader with YAML 1.2's numbers and no key written twice, and a parsed document bounded in
values and nesting before anything walks it (daemon/settings_loading.py reads the layers)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from daemon.settings import SettingsError

# A configuration is a few dozen keys (the packaged one, commented, is 13 KB): a file past
# these is not one (read as hostile; 256 KiB of one flat list parses in ~0.7 s).
MAX_CONFIG_BYTES = 256 << 10
MAX_VALUES = 10_000  # values a file or variable may hold, counted as written out: an
MAX_DEPTH = 32  # alias repeated 9 times 9 levels down is 387 million, in a 1 kB file


# libyaml's parser where PyYAML was built with it (5x faster than the pure-Python one, and
# bounded in nesting itself); the same safe constructor and resolver either way.
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class SafeLoader(_BASE_LOADER):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader with two YAML 1.1 surprises taken out: a key written twice is
    an error (PyYAML keeps the last one silently), and numbers are read as YAML 1.2 reads
    them: none in base 60 (`port: 1:20` was port 80), a leading zero is no octal
    (`_integer`), and `1e5` is a float."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (`<<:` may override a key)
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"found {key!r} twice (a key is written once)",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
SafeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBERS]
    for first, resolvers in _BASE_LOADER.yaml_implicit_resolvers.items()
}
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0o[0-7_]+|[-+]?[0-9][0-9_]*|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _integer(loader: SafeLoader, node: yaml.ScalarNode) -> int:
    """An integer as YAML 1.2 reads one: decimal even with leading zeros (`port: 08080` is
    8080; YAML 1.1 read 0755 as octal, 493), 0o octal, 0x hex, 0b binary; `_` between
    digits is allowed."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    prefixed = text.lstrip("+-")[:2].lower() in ("0b", "0o", "0x")
    return int(text, 0) if prefixed else int(text, 10)


SafeLoader.add_constructor("tag:yaml.org,2002:int", _integer)
SAFE_LOADER = SafeLoader


class NotYAML(SettingsError):
    """Text that is not YAML at all (an environment variable's is then taken as text)."""


def parse_yaml(text: str, where: str) -> Any:
    """`text` as YAML (safe: no tags that run code), or a SettingsError naming `where`: not
    valid YAML, nested past MAX_DEPTH, or holding more than MAX_VALUES values once its
    anchors are expanded (checked before anything walks it: an error line that shows it
    would be gigabytes)."""
    deep = f"{where}: nested past any configuration; fix the file"
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if "nesting depth" in problem:  # (libyaml's own bound)
            raise SettingsError(deep) from None
        raise NotYAML(f"{where}: {line}not valid YAML ({problem}); fix the syntax") from None
    except RecursionError:  # (the pure-Python parser's)
        raise SettingsError(deep) from None
    except ValueError as exc:  # (an integer of more digits than Python converts)
        raise SettingsError(f"{where}: {str(exc)[:200]}") from None
    seen = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        seen += 1 + (len(value) if isinstance(value, dict | list) else 0)
        if seen > MAX_VALUES or depth > MAX_DEPTH:  # (counted before its items are pushed)
            raise SettingsError(
                f"{where}: holds more than {MAX_VALUES:,} values or nests past {MAX_DEPTH} "
                "levels (its anchors expanded); a configuration is a few dozen keys"
            )
        if isinstance(value, dict):
            stack += [(v, depth + 1) for pair in value.items() for v in pair]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]
    return data
