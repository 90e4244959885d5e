"""What a JSON Schema from a request may make the grammar compiler do, checked before it
sees the schema.

The grammar engine (llguidance, speculative/grammar.py) recurses once per level of the
grammar it builds: a chain of about 2,500 `$ref`s (an 88 KB body) overflows an 8 MiB
thread stack inside it, and the process dies with SIGSEGV, every stream cut. Its time
grows with the schema's members (6,000 optional properties: 4 s of compiling). So a
schema is measured here, in Python, iteratively (no recursion of ours either), and one
past a limit is refused naming the field that carried it and the `limits.*` key:

- depth: the longest path of nested schemas and data (a subschema, an array or object
  inside `const`/`enum`/`default`) from the root, each `$ref` followed as one more
  level; a reference back to a schema already on the path (a recursive schema, a
  tree of nodes) ends the path there, as the engine names such a rule instead of
  expanding it;
- the `$ref` chain: the most references followed along one such path;
- members: properties, alternatives (`anyOf`, `oneOf`, `allOf`, `prefixItems`) and
  `enum` values, counted over the whole document, and `patternProperties` apart (the
  engine's time grows about eight-fold with each doubling of them);
- bytes: the schema as compact JSON.

Each schema is visited once (the depth below a schema is remembered), so measuring costs
time in proportion to the schema's size, whatever its references.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from modeling.errors import RequestError

# Keywords whose value is a map of name → subschema, a list of subschemas, or one
# subschema (`items` may be either, in older drafts). Anything else is data.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_ONE = (
    "items", "additionalItems", "additionalProperties", "not", "contains", "if", "then",
    "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema",
)  # fmt: skip
MEMBER_MAPS = ("properties", "patternProperties")
# A child of a schema: (the subschema or None for data, 1 if reached by $ref else 0, the
# data's own nesting levels).
Child = tuple[dict | None, int, int]


@dataclass(frozen=True)
class SchemaLimits:
    """limits.schema_*: the defaults take every schema a real tool or response format
    uses (OpenAI's own structured outputs stop at 10 levels and 5,000 properties) with
    room to spare, and keep a compile within about a second."""

    max_depth: int = 64
    max_ref_chain: int = 32
    max_members: int = 2000
    max_bytes: int = 256 << 10
    # patternProperties' keys are the engine's costliest member: its time grows about
    # eight-fold for each doubling (64: 0.01 s, 128: 0.09 s, 320: 7 s, 640: minutes).
    max_pattern_properties: int = 64
    # The patterns' repetitions, multiplied along their nesting (`(a{1000}){1000}`: a
    # million) and summed over the schema: the engine builds about that many states, a
    # second and 160-200 MiB a million.
    max_repetition: int = 200_000


class SchemaTooComplex(RequestError):
    """A schema past one of the limits: a 400 naming the field and the limit."""


def check_schema(schema: Any, field: str, limits: SchemaLimits) -> None:
    """Raise SchemaTooComplex (naming `field` and the `limits.*` key) unless `schema` is
    within `limits`."""
    size = _SchemaSize(schema, field, limits)
    size.measure()
    # Nesting is bounded now, so the encoder's own recursion is too.
    try:
        encoded = len(json.dumps(schema, separators=(",", ":")))
    except (TypeError, ValueError):  # an integer past Python's 4,300 digits, kept as its size
        raise SchemaTooComplex(
            f"{field} holds a number too long to read (more than 4,300 digits)",
            field,
            "schema_too_complex",
        ) from None
    if encoded > limits.max_bytes:
        size.refuse(f"is {encoded} bytes as JSON", "limits.schema_max_bytes", limits.max_bytes)


class _SchemaSize:
    def __init__(self, root: Any, field: str, limits: SchemaLimits) -> None:
        self.root = root
        self.field = field
        self.limits = limits
        self.members = 0
        self.patterns = 0
        self.repetitions = 0  # the patterns' repetitions so far (`repetition`), summed
        # id(schema) → (levels below it, references followed below it), once measured.
        self.below: dict[int, tuple[int, int]] = {}

    def refuse(self, what: str, key: str, limit: int) -> None:
        raise SchemaTooComplex(
            f"{self.field} {what}, past {key} ({limit}): simplify the schema",
            self.field,
            "schema_too_complex",
        )

    def measure(self) -> None:
        """Depth-first over the schemas, iteratively. A frame is a schema on the path, its
        children still to visit, the deepest (levels, references) found below it so far,
        and whether it was reached through a `$ref`."""
        if not isinstance(self.root, dict):
            return
        on_path: set[int] = {id(self.root)}
        stack: list[tuple[dict, Iterator[Child], list[int], int]] = [
            (self.root, iter(self.children(self.root)), [0, 0], 0)
        ]
        path_refs = 0  # references followed to reach the top frame
        while stack:
            node, children, best, hop = stack[-1]
            child = next(children, None)
            if child is None:  # every child measured: what is below this schema is known
                stack.pop()
                on_path.discard(id(node))
                path_refs -= hop
                self.below[id(node)] = (best[0], best[1])
                if stack:
                    parent = stack[-1][2]
                    parent[0] = max(parent[0], best[0] + 1)
                    parent[1] = max(parent[1], best[1] + hop)
                continue
            kid, kid_hop, data_levels = child
            if kid is None:  # data nested below this schema
                best[0] = max(best[0], data_levels)
                self.check_depth(len(stack) + data_levels)
                continue
            if id(kid) in on_path:
                continue  # a recursive reference: the engine names the rule, ends here
            known = self.below.get(id(kid))
            if known is not None:
                best[0] = max(best[0], known[0] + 1)
                best[1] = max(best[1], known[1] + kid_hop)
                self.check_depth(len(stack) + known[0] + 1)
                self.check_refs(path_refs + known[1] + kid_hop)
                continue
            self.check_depth(len(stack) + 1)
            self.check_refs(path_refs + kid_hop)
            on_path.add(id(kid))
            path_refs += kid_hop
            stack.append((kid, iter(self.children(kid)), [0, 0], kid_hop))

    def check_depth(self, levels: int) -> None:
        if levels > self.limits.max_depth:
            self.refuse(
                "nests deeper (subschemas, arrays and objects in data, and each $ref "
                "followed, counted as levels)",
                "limits.schema_max_depth",
                self.limits.max_depth,
            )

    def check_refs(self, refs: int) -> None:
        if refs > self.limits.max_ref_chain:
            self.refuse(
                "follows a longer chain of $ref",
                "limits.schema_max_ref_chain",
                self.limits.max_ref_chain,
            )

    def count(self, n: int) -> None:
        self.members += n
        if self.members > self.limits.max_members:
            self.refuse(
                "has more properties, alternatives and enum values in all",
                "limits.schema_max_members",
                self.limits.max_members,
            )

    def count_patterns(self, n: int) -> None:
        self.patterns += n
        if self.patterns > self.limits.max_pattern_properties:
            self.refuse(
                "has more patternProperties in all",
                "limits.schema_max_pattern_properties",
                self.limits.max_pattern_properties,
            )

    def check_pattern(self, pattern: str) -> None:
        # (summed over the schema's patterns: the engine's cost is theirs together, and
        # 150 patterns of a{99999} each took 8 s and 2.9 GB, a reviewer found)
        bound = self.limits.max_repetition
        self.repetitions += repetition(pattern, bound - self.repetitions)
        if self.repetitions > bound:
            self.refuse(
                f"has patterns whose repetitions, multiplied along their nesting, add up to "
                f"{self.repetitions:,} or more",
                "limits.schema_max_repetition",
                bound,
            )

    def children(self, node: dict) -> list[Child]:
        """A schema's subschemas `(schema, 0, 0)`, the schemas its `$ref` names
        `(schema, 1, 0)`, and its data values `(None, 0, levels)`. Its members are counted
        here (each schema is expanded once)."""
        out: list[Child] = []
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                if key in MEMBER_MAPS:
                    self.count(len(value))
                if key == "patternProperties":
                    self.count_patterns(len(value))
                    for pattern in value:
                        self.check_pattern(pattern)
                out += [(v, 0, 0) for v in value.values() if isinstance(v, dict)]
            elif key in SCHEMA_LISTS and isinstance(value, list):
                self.count(len(value))
                out += [(v, 0, 0) for v in value if isinstance(v, dict)]
            elif key in SCHEMA_ONE and isinstance(value, dict | list):
                values = value if isinstance(value, list) else [value]
                out += [(v, 0, 0) for v in values if isinstance(v, dict)]
            elif key == "$ref" and isinstance(value, str):
                target = self.resolve(value)
                if isinstance(target, dict):
                    out.append((target, 1, 0))
            else:
                if key == "enum" and isinstance(value, list):
                    self.count(len(value))
                if key == "pattern" and isinstance(value, str):
                    self.check_pattern(value)
                levels = self.data_levels(value)
                if levels:
                    out.append((None, 0, levels))
        return out

    def data_levels(self, value: Any) -> int:
        """How deep arrays and objects nest in `value`; refused past the depth limit."""
        levels = nesting(value, self.limits.max_depth)
        self.check_depth(levels)
        return levels

    def resolve(self, ref: str) -> Any:
        """The schema a local reference (`#`, `#/$defs/name`, any JSON pointer) names, or
        None (a remote one, or one that names nothing: the engine refuses it)."""
        if not ref.startswith("#"):
            return None
        node = self.root
        pointer = unquote(ref[1:])
        if not pointer:
            return node
        if not pointer.startswith("/"):
            return None
        for part in pointer[1:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node


def nesting(value: Any, limit: int) -> int:
    """How deep arrays and objects nest in `value` (0 for a scalar), walked without
    recursion; stops counting once past `limit`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            inner = item.values() if isinstance(item, dict) else item
            stack.extend((v, level + 1) for v in inner if isinstance(v, dict | list))
    return deepest


# A count, with the spaces the `x` flag lets in.
_COUNT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


def repetition(pattern: str, limit: int) -> int:
    """The most times one piece of a regular expression is repeated: the product of the
    counts (`{n}`, `{n,m}`: m; `{n,}`: n; spaces inside allowed, as the `x` flag allows)
    of the repetitions it nests in; counting stops past `limit`. One pass, no recursion: a
    group's deepest product is kept on a stack."""
    stack = [1]  # per open group: the deepest product inside it so far
    last = 1  # the product of the piece just read (what a count after it multiplies)
    i, size = 0, len(pattern)
    while i < size and stack[0] <= limit:
        c = pattern[i]
        if c == "\\":
            i, last = i + 2, 1
            if pattern[i - 1 : i] in ("x", "u", "p", "P") and pattern[i : i + 1] == "{":
                i = pattern.find("}", i) + 1 or size  # (\x{10000}: a code point, no count)
        elif c == "[":  # a class: one piece, whatever it holds
            i += 2 if pattern[i + 1 : i + 2] == "^" else 1
            i += 1 if pattern[i : i + 1] == "]" else 0  # (a first `]` is a member)
            while i < size and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i, last = i + 1, 1
        elif c == "(":
            stack.append(1)
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            i += 1
        elif c == "{" and (count := _COUNT.match(pattern, i)):
            most = count.group(3) or count.group(1)
            # (a count of over 18 digits is past any limit: not converted, 4,300 digits
            # would raise)
            last *= limit + 1 if len(most) > 18 else max(int(most), 1)
            i = count.end()
        else:
            last = 1 if c not in "*+?|" else last
            i += 1
        stack[-1] = max(stack[-1], last)
    return max(stack)
