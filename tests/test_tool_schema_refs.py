"""Local `$ref`s in a tool's parameters (speculative/tool_calls.py, speculative/harmony.py):
every call format's grammar reads `#`, `#/$defs/...` and `#/definitions/...` against the
function's parameters, as a response_format's grammar reads them against its schema.
They once resolved against the call object around the parameters: pydantic's nested
models (`#/$defs/Point`) were a 400 whose message quoted the grammar, and `"$ref": "#"`
meant the call object. The grammars are driven here through llguidance with a vocabulary
of one token per byte (and the formats' special tokens), so each test says exactly which
text a grammar takes; the 400 a bad schema gets through the daemon is tested last."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import llguidance
import openai
import pydantic
import pytest

from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings
from modeling.text.harmony import CALL, CHANNEL, CONSTRAIN, MARKERS, MESSAGE
from speculative.grammar import ENGINE_LIMITS, Grammar, GrammarError
from speculative.harmony import harmony_call_grammar
from speculative.tool_calls import HERMES, LLAMA3, MISTRAL, CallFormat, Tool, tool_grammar

EOS = 256
SPECIALS = [MISTRAL.token or "", *MARKERS]
SPECIAL_IDS = {name: EOS + 1 + i for i, name in enumerate(SPECIALS)}


class _ByteVocabulary:
    """One token per byte, an end of sequence, then the formats' special tokens: what
    llguidance's TokenizerWrapper reads."""

    def __init__(self) -> None:
        self.tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
        self.tokens += [name.encode() for name in SPECIALS]
        self.eos_token_id = EOS
        self.bos_token_id = None
        self.special_token_ids = [EOS, *SPECIAL_IDS.values()]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


VOCABULARY = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def accepts(grammar: Grammar, answer: Sequence[str]) -> bool:
    """Whether `grammar` takes `answer` whole: its pieces are special tokens (by name) or
    text (a token per byte)."""
    grammar.validate(VOCABULARY)
    matcher = llguidance.LLMatcher(VOCABULARY, grammar.text, log_level=0, limits=ENGINE_LIMITS)
    tokens = [t for p in answer for t in ([SPECIAL_IDS[p]] if p in SPECIAL_IDS else p.encode())]
    if matcher.validate_tokens(tokens) != len(tokens):
        return False
    assert matcher.consume_tokens(tokens)
    return matcher.is_accepting()


# ---- the call formats ------------------------------------------------------------------

HARMONY = "harmony"
FORMATS = [HERMES, LLAMA3, MISTRAL, HARMONY]


def grammar_for(fmt: CallFormat | str, tools: list[Tool], choice: str = "required") -> Grammar:
    if fmt == HARMONY:
        return harmony_call_grammar(tools, choice, SPECIAL_IDS, "tools")
    assert isinstance(fmt, CallFormat)
    return tool_grammar(fmt, tools, choice, False, "tools", SPECIAL_IDS)


def call(fmt: CallFormat | str, name: str, arguments: Any) -> list[str]:
    """One call to `name` as the format writes it (compact JSON)."""
    args = json.dumps(arguments, separators=(",", ":"))
    if fmt == HARMONY:
        return [CHANNEL, f"commentary to=functions.{name} ", CONSTRAIN, "json", MESSAGE,
                args, CALL]  # fmt: skip
    assert isinstance(fmt, CallFormat)
    text = f'{fmt.begin}{fmt.open}{{"name":"{name}","{fmt.arguments}":{args}}}{fmt.close}{fmt.end}'
    return [fmt.token, text] if fmt.token else [text]


def tool(name: str, parameters: dict[str, Any]) -> Tool:
    return Tool(name, "", parameters)


# ---- the schemas -------------------------------------------------------------------------


class Point(pydantic.BaseModel):
    x: int
    y: int


class Segment(pydantic.BaseModel):
    start: Point
    end: Point


class Node(pydantic.BaseModel):
    label: str
    children: list[Node] = []


def parameters_of(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """What openai's `pydantic_function_tool` sends as the tool's parameters."""
    function = openai.pydantic_function_tool(model)["function"]
    return dict(function["parameters"])  # type: ignore[typeddict-item]


def point(*required: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in required},
        "required": list(required),
        "additionalProperties": False,
    }


def refers_to(ref: str, defs: dict[str, Any], key: str = "$defs") -> dict[str, Any]:
    return {
        key: defs,
        "type": "object",
        "properties": {"p": {"$ref": ref}},
        "required": ["p"],
        "additionalProperties": False,
    }


TREE = {  # a node whose children are nodes: the parameters' root, "#"
    "type": "object",
    "properties": {
        "label": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}},
    },
    "required": ["label"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", f))
def test_pydantic_nested_models_are_called_under_their_own_defs(fmt: CallFormat | str) -> None:
    grammar = grammar_for(fmt, [tool("Segment", parameters_of(Segment))])
    good = {"start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}}
    assert accepts(grammar, call(fmt, "Segment", good))
    assert not accepts(grammar, call(fmt, "Segment", {"start": {"x": 1}, "end": {"x": 3, "y": 4}}))
    assert not accepts(grammar, call(fmt, "Segment", {"start": {"x": "1", "y": 2}, "end": {}}))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", f))
def test_a_recursive_model_refers_to_itself(fmt: CallFormat | str) -> None:
    """`#/$defs/Node` inside Node (openai's strict shape) and pydantic's own shape, whose
    root is itself a `$ref`."""
    for parameters in (parameters_of(Node), Node.model_json_schema()):
        grammar = grammar_for(fmt, [tool("Node", parameters)])
        leaf = {"label": "c", "children": []}
        tree = {"label": "a", "children": [{"label": "b", "children": [leaf]}]}
        assert accepts(grammar, call(fmt, "Node", tree))
        bad = {"label": "a", "children": [{"label": 1, "children": []}]}
        assert not accepts(grammar, call(fmt, "Node", bad))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", f))
def test_a_ref_to_the_root_means_the_parameters(fmt: CallFormat | str) -> None:
    """`"$ref": "#"` is the parameters: a child node, not the call object around them."""
    grammar = grammar_for(fmt, [tool("t", TREE)])
    assert accepts(grammar, call(fmt, "t", {"label": "a", "children": [{"label": "b"}]}))
    key = getattr(fmt, "arguments", "arguments")  # the call object's, in this format
    wrapped = {"label": "a", "children": [{"name": "t", key: {"label": "b"}}]}
    assert not accepts(grammar, call(fmt, "t", wrapped))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", f))
def test_two_tools_each_with_its_own_point(fmt: CallFormat | str) -> None:
    """Two functions whose `$defs` share the name Point and differ: each call is under its
    own; a named function's grammar too."""
    tools = [tool("f", refers_to("#/$defs/Point", {"Point": point("x")})),
             tool("g", refers_to("#/$defs/Point", {"Point": point("y")}))]  # fmt: skip
    grammar = grammar_for(fmt, tools)
    assert accepts(grammar, call(fmt, "f", {"p": {"x": 1}}))
    assert accepts(grammar, call(fmt, "g", {"p": {"y": 1}}))
    assert not accepts(grammar, call(fmt, "f", {"p": {"y": 1}}))
    assert not accepts(grammar, call(fmt, "g", {"p": {"x": 1}}))
    named = grammar_for(fmt, tools, "g")
    assert accepts(named, call(fmt, "g", {"p": {"y": 1}}))
    assert not accepts(named, call(fmt, "g", {"p": {"x": 1}}))
    assert not accepts(named, call(fmt, "f", {"p": {"x": 1}}))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", f))
def test_definitions_and_escaped_pointers(fmt: CallFormat | str) -> None:
    """Draft-07's `definitions`, and a pointer's escapes (`~1` for "/", `~0` for "~")."""
    for parameters in (
        refers_to("#/definitions/Point", {"Point": point("x")}, "definitions"),
        refers_to("#/$defs/a~1b~0c", {"a/b~c": point("x")}),
    ):
        grammar = grammar_for(fmt, [tool("f", parameters)])
        assert accepts(grammar, call(fmt, "f", {"p": {"x": 1}}))
        assert not accepts(grammar, call(fmt, "f", {"p": {"x": "1"}}))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_auto_allows_text_or_a_call(fmt: CallFormat) -> None:
    """With `auto` the text may not begin as a call does, and a call may follow its
    opening. (Hermes' and Llama 3's calls could not: the engine's lexer took the longest
    text, up to `{"name"`, and did not go back to the opening's shorter literal.)"""
    grammar = tool_grammar(fmt, [tool("Segment", parameters_of(Segment))], "auto", True,
                           "tools", SPECIAL_IDS)  # fmt: skip
    assert accepts(grammar, ["Hello"])
    good = {"start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}}
    assert accepts(grammar, call(fmt, "Segment", good))
    assert not accepts(grammar, call(fmt, "Segment", {"start": {}, "end": {}}))
    assert not accepts(grammar, [fmt.lead + '"Segment","x":1}'])  # begins as a call, is none


# ---- a schema the engine refuses ----------------------------------------------------------

BAD = [  # what the engine refuses, and the words that say why
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}}, "Missing"),
    ({"type": "object", "properties": {"p": {"$ref": "http://x.example/p.json"}}}, "x.example"),
    ({"type": "object", "properties": {"p": {"type": "strin"}}}, "strin"),
]


def no_grammar_in(message: str) -> bool:
    """The message quotes none of the grammar's rules, nor where in it the error is."""
    quoted = re.search(r"^ *\d+ \| |\bat \d+\(\d+\)", message, re.MULTILINE)
    return quoted is None and not any(
        word in message for word in ("call_", "arguments_", "%json", "start:", "x-guidance")
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: getattr(f, "name", f))
@pytest.mark.parametrize("choice", ["required", "g"])
def test_a_refused_schema_names_its_tool_without_the_grammar(
    fmt: CallFormat | str, choice: str
) -> None:
    for schema, words in BAD:
        tools = [tool("f", {"type": "object"}), tool("g", schema)]
        with pytest.raises(GrammarError, match=words) as err:
            grammar_for(fmt, tools, choice).validate(VOCABULARY)
        assert err.value.param == "tools[1].function.parameters"
        assert no_grammar_in(str(err.value)), str(err.value)


# ---- through the daemon ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(stories_target: Path) -> Iterator[BackgroundServer]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "models.draft": ("ngram", "test"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield srv


def chat(server: BackgroundServer, tools: list[dict[str, Any]], choice: Any) -> tuple[int, Any]:
    body = {"model": "stories260k", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
            "temperature": 0, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": False}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    return resp.status, answer


def test_the_daemon_calls_a_tool_with_defs_and_names_a_bad_one(server: BackgroundServer) -> None:
    """The report's request (`$defs` and `$ref`, tool_choice required, auto and named) is
    answered; a tool whose schema the engine refuses is a 400 naming that tool's
    parameters, without a line of the grammar. (The stories model's 512 tokens of context
    hold the fallback's system message and a small tool, and a few tokens of answer.)"""
    parameters = refers_to("#/$defs/Point", {"Point": point("x")})
    f = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    for choice in ("required", "auto", {"type": "function", "function": {"name": "f"}}):
        status, answer = chat(server, [f], choice)
        assert status == 200, answer
        (given,) = answer["choices"]
        if given["finish_reason"] == "tool_calls":  # not cut by max_tokens
            (made,) = given["message"]["tool_calls"]
            assert set(json.loads(made["function"]["arguments"])["p"]) == {"x"}
    bad = {"type": "function", "function": {"name": "g", "parameters": BAD[0][0]}}
    status, answer = chat(server, [f, bad], "required")
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "tools[1].function.parameters" and "Missing" in error["message"]
    assert no_grammar_in(error["message"]) and "\n" not in error["message"], error["message"]
