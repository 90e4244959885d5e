"""Reasoning models' think blocks (Qwen3, QwQ, DeepSeek-R1's distills): a turn's text read
into its reasoning and its answer however it streams; stop strings kept to the answer; the
grammars of tool calls and response formats letting a think block come first (a Qwen3
turn thinks, then calls: under `auto` the call was read as text, the block before it); the
tokenizer keeping its tags; and the chat response's `reasoning_content`, streamed and whole,
from a live daemon."""

from __future__ import annotations

import http.client
import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from modeling.text.detok import StopMatcher, StopsOutsideCalls
from modeling.text.thinking import Thinking, ThinkingStops, opened
from modeling.text.tokenizer import Tokenizer
from speculative.grammar import Grammar
from speculative.thinking import ThinkReader, read_thinking, thinking_first
from speculative.tool_calls import HERMES, Tool, read_answer, tool_grammar
from tests.templated import templated_copy
from tests.test_tool_schema_refs import accepts

MAY = Thinking(started=False)
INSIDE = Thinking(started=True)
CALL = '<tool_call>\n{"name":"f","arguments":{"n":1}}\n</tool_call>'

# (text, thinking, answer, reasoning)
TURNS = [
    ("<think>\nThe user greets.\nBe brief.\n</think>\n\nHello!", MAY, "Hello!",
     "The user greets.\nBe brief."),
    ("The user greets.\n</think>\n\nHello!", INSIDE, "Hello!", "The user greets."),
    ("Hello!", MAY, "Hello!", ""),
    ("  \n<think>x</think>y", MAY, "y", "x"),
    ("<think>\nhalf a thought", MAY, "", "half a thought"),
    ("still thinking\n\n", INSIDE, "", "still thinking"),
    ("<thi", MAY, "<thi", ""),
    ("\n\n", MAY, "\n\n", ""),
    ("<think></think>", MAY, "", ""),
    ("<think>a</think>\n\n    indented code", MAY, "    indented code", "a"),
    ("<think>a < b and </thinker> is no tag</think>ok", MAY, "ok",
     "a < b and </thinker> is no tag"),
    ("Answer <think>quoted</think> later", MAY, "Answer <think>quoted</think> later", ""),
    (f"<think>\ncall f\n</think>\n\n{CALL}", MAY, CALL, "call f"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "thinking", "answer", "reasoning"), TURNS)
def test_a_turn_is_its_reasoning_and_answer_however_it_streams(
    text: str, thinking: Thinking, answer: str, reasoning: str
) -> None:
    assert read_thinking(text, thinking) == (answer, reasoning)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        reader = ThinkReader(thinking)
        events = []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            events += reader.feed(text[a:b])
        events += reader.finish()
        assert all(piece for _, piece in events)
        assert "".join(t for k, t in events if k == "content") == answer
        assert "".join(t for k, t in events if k == "reasoning") == reasoning


def test_reasoning_is_shown_as_it_comes() -> None:
    """Only a possible tag (and newlines that may end the reasoning) is held."""
    reader = ThinkReader(MAY)
    assert reader.feed("<thi") == []
    assert reader.feed("nk>\nOne") == [("reasoning", "One")]
    assert reader.feed(" two\n</th") == [("reasoning", " two")]
    assert reader.feed("ink>\n\nAn") == [("content", "An")]
    assert reader.feed("swer") == [("content", "swer")]


def test_a_prompt_that_opens_a_block_begins_the_turn_inside_it() -> None:
    assert opened("<|im_start|>assistant\n<think>\n")
    assert not opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opened("<|im_start|>assistant\n")


def push_all(stops: Any, pieces: list[str]) -> str:
    out = "".join(stops.push(p) for p in pieces)
    return out + stops.flush()


def test_stop_strings_apply_to_the_answer_not_the_reasoning() -> None:
    text = "<think>\nFirst.\n\nSecond.\n</think>\n\nThe answer.\n\nMore."
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    cut = push_all(ThinkingStops(StopMatcher(["\n\n"]), MAY), pieces)
    assert cut == "<think>\nFirst.\n\nSecond.\n</think>\n\nThe answer."
    plain = push_all(StopMatcher(["\n\n"]), pieces)  # (what a stop did to the reasoning)
    assert plain == "<think>\nFirst."
    inside = push_all(ThinkingStops(StopMatcher(["."]), INSIDE), ["a.b</th", "ink>\nc.d"])
    assert inside == "a.b</think>\nc"
    # A turn that did not think: as the stops alone.
    assert push_all(ThinkingStops(StopMatcher(["."]), MAY), ["  Hi", ". Bye"]) == "  Hi"


def test_a_call_after_the_reasoning_is_never_cut_by_a_stop() -> None:
    text = f"<think>\ncall f}}\n</think>\n\n{CALL}"
    pieces = [text[i : i + 2] for i in range(0, len(text), 2)]
    out = push_all(ThinkingStops(StopsOutsideCalls(["}"], HERMES.lead), MAY), pieces)
    assert out == text


TOOLS = [Tool("f", "", {"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"]})]  # fmt: skip


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_call_may_come_after_a_think_block(choice: str) -> None:
    grammar = tool_grammar(HERMES, TOOLS, choice, False, "tools", {}, thinking=MAY)
    assert accepts(grammar, [f"<think>\nLet me call f.\n</think>\n\n{CALL}"])
    assert accepts(grammar, [CALL])
    assert not accepts(grammar, ["<think>\nunfinished"])
    # (text after a block may hold anything, a call's markup too: under auto it is text)
    assert accepts(grammar, [f"<think>a</think>b</think>{CALL}"]) == (choice == "auto")
    assert accepts(grammar, ["<think>a</think>b"]) == (choice == "auto")
    # Whitespace before the tag, as the readers take it: the block, and its call checked.
    assert accepts(grammar, [f"\n <think>\nx\n</think>\n\n{CALL}"])
    bad = '\n<think>x</think>\n\n<tool_call>\n{"name":"rm","arguments":{"n":[1,}}\n</tool_call>'
    assert not accepts(grammar, [bad])
    # Any other space before the tag (a form feed, U+00A0, U+3000) begins a text answer,
    # for the grammar and the readers alike: a call after it was read back unchecked
    # under `auto`, where the readers took every Unicode space as the block's lead.
    rm = '<tool_call>\n{"name":"rm","arguments":{"path":"/"}}\n</tool_call>'
    for lead in ("\x0c", "\x0b", "\x1c", "\xa0", "\u2028", "\u3000"):
        text = f"{lead}<think>x</think>\n\n{rm}"
        assert read_thinking(text, MAY) == (text, "")
        assert push_all(ThinkingStops(StopMatcher([]), MAY), [text[:2], text[2:]]) == text
        assert read_answer(text, HERMES, False)[1] == [], lead
        assert choice == "auto" or not accepts(grammar, [text]), lead
    inside = tool_grammar(HERMES, TOOLS, choice, False, "tools", {}, thinking=INSIDE)
    assert accepts(inside, [f"Let me call f.\n</think>\n\n{CALL}"])
    assert not accepts(inside, [CALL])  # (its reasoning ends first)
    # Without it, a required call could not be thought before, and under auto the block
    # began a text answer (the call after it text).
    plain = tool_grammar(HERMES, TOOLS, choice, False, "tools", {})
    assert accepts(plain, [f"<think>x</think>\n{CALL}"]) == (choice == "auto")


def test_a_response_format_may_come_after_a_think_block() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = Grammar.json_schema(schema, "response_format.json_schema.schema", "x")
    first = thinking_first(grammar, MAY)
    assert first.description == "json_schema:x" and first.field == grammar.field
    assert accepts(first, ['<think>\nJSON please.\n</think>\n\n{"a":1}'])
    assert accepts(first, ['{"a":1}'])
    assert not accepts(first, ['<think>x</think>{"b":1}'])
    assert not accepts(grammar, ['<think>x</think>{"a":1}'])
    assert accepts(thinking_first(grammar, INSIDE), ['x</think>{"a":1}'])
    assert thinking_first(grammar, None) is grammar
    any_object = thinking_first(Grammar.json_object("response_format"), MAY)
    assert accepts(any_object, ['<think>x</think>{"z":[]}'])


# ---- the tokenizer and a live daemon ---------------------------------------------------

TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>\n"
    "Call as <tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if open_think is defined %}<think>\n{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def thinking_folder(base: Path, folder: Path, special: bool = False) -> Path:
    """`base` (a byte-level tiny checkpoint) with the tags as tokens and TEMPLATE."""
    templated_copy(base, folder, TEMPLATE)
    backend = HFTokenizer.from_file(str(base / "tokenizer.json"))
    backend.add_tokens([AddedToken(t, special=special) for t in TAGS])
    backend.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("special", [False, True])
def test_a_tokenizer_that_thinks_keeps_its_tags(
    tiny_checkpoint, tmp_path: Path, special: bool
) -> None:
    from modeling.checkpoints.checkpoint import load_tokenizer, open_checkpoint

    base = tiny_checkpoint("llama", vocab_size=320, tokenizer_size=300)
    tok: Tokenizer = load_tokenizer(open_checkpoint(thinking_folder(base, tmp_path / "m", special)))
    assert tok.thinks
    ids = [tok.vocabulary["<think>"], *tok.encode("hi", add_special_tokens=False),
           tok.vocabulary["</think>"]]  # fmt: skip
    assert tok.decode(ids) == "<think>hi</think>"
    plain = load_tokenizer(open_checkpoint(base))
    assert not plain.thinks


@pytest.fixture(scope="module")
def thinking_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.keyed_server import keyed_server

    base = tiny_checkpoint("llama", vocab_size=320, tokenizer_size=300)
    folder = thinking_folder(base, tmp_path_factory.mktemp("thinking-model") / "model")
    yield from keyed_server(folder, tmp_path_factory, "k", {"models.draft": "none"})


def chat(server: Any, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=60)
    headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in data.decode().splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        return resp.status, events
    return resp.status, json.loads(data or b"{}")


MESSAGES = [{"role": "user", "content": "hello"}]


def test_a_turn_begun_inside_a_block_is_reasoning_until_it_ends(thinking_server: Any) -> None:
    """The template opens the block (`open_think`): a turn that never closes it (a random
    model's 24 tokens) is all reasoning, streamed and whole alike; one whose template
    closed it (`enable_thinking: false`) is all answer."""
    body = {"model": "model", "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
            "chat_template_kwargs": {"open_think": True}}  # fmt: skip
    status, whole = chat(thinking_server, body)
    assert status == 200, whole
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
    status, events = chat(thinking_server, {**body, "stream": True})
    assert status == 200
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)
    body["chat_template_kwargs"] = {"enable_thinking": False}
    status, whole = chat(thinking_server, body)
    message = whole["choices"][0]["message"]
    assert status == 200 and "reasoning_content" not in message and message["content"]


def test_a_call_after_a_think_block_is_a_call(thinking_server: Any) -> None:
    """A required call that the model thinks before (its tags favoured by logit_bias):
    the call is read after the block, streamed and whole, and no stop string cuts it."""
    think, close = 300, 301  # (the tags' ids: after the 300 entries of the tokenizer)
    tools = [{"type": "function", "function": {"name": "f", "parameters": TOOLS[0].parameters}}]
    body = {"model": "model", "messages": MESSAGES, "max_tokens": 48, "temperature": 0,
            "tools": tools, "tool_choice": "required", "stop": ["}", "\n"],
            "logit_bias": {str(think): 100, str(close): 100}}  # fmt: skip
    status, whole = chat(thinking_server, body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert "tool_calls" in choice["message"], whole
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "f"
    assert isinstance(json.loads(call["function"]["arguments"])["n"], int)
    assert not choice["message"].get("content")
    status, events = chat(thinking_server, {**body, "stream": True})
    parts = [
        d for e in events if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert (
        "".join(p["function"].get("arguments") or "" for p in parts)
        == call["function"]["arguments"]
    )
    assert not "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
    )
    # The think block's tokens keep their log-probabilities (the call's are not content),
    # streamed and whole alike; and its reasoning is sent before the call.
    status, whole = chat(thinking_server, {**body, "logprobs": True})
    given = [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert given and given[0] == "<think>" and "</think>" in given, given
    status, events = chat(thinking_server, {**body, "logprobs": True, "stream": True})
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert [
        e["token"] for d in deltas for e in (d.get("logprobs") or {}).get("content") or []
    ] == given
    kinds = [k for d in deltas for k in ("reasoning_content", "tool_calls") if d["delta"].get(k)]
    assert "reasoning_content" not in kinds[kinds.index("tool_calls") :], kinds


def test_an_earlier_turns_reasoning_reaches_the_template(thinking_server: Any) -> None:
    """`reasoning_content` of an assistant message is kept for the template (Qwen3's reads
    it back); not text, it is a 400 naming the field."""
    turns = [*MESSAGES, {"role": "assistant", "content": "Hi", "reasoning_content": "greet"},
             {"role": "user", "content": "more"}]  # fmt: skip
    status, _ = chat(thinking_server, {"model": "model", "messages": turns, "max_tokens": 2})
    assert status == 200
    turns[1] = {**turns[1], "reasoning_content": 5}
    status, answer = chat(thinking_server, {"model": "model", "messages": turns, "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == "messages[1].reasoning_content"


def test_grammars_allow_the_models_own_tag_tokens(tiny_checkpoint, tmp_path: Path) -> None:
    """The grammar engine reads every added token spelled `<...>` as a special token that
    no text matches, whatever tokenizer.json declares: a Hermes call's "<tool_call>" (and
    a think block's "<think>") had to be spelled from bytes, the model's own token masked.
    Read as declared, the tokens are allowed where their text is; one declared special
    is still not text."""
    from modeling.checkpoints.checkpoint import load_tokenizer, open_checkpoint
    from speculative.grammar import Constraint

    base = tiny_checkpoint("llama", vocab_size=320, tokenizer_size=300)
    for special in (False, True):
        folder = thinking_folder(base, tmp_path / f"m{special}", special)
        tok = load_tokenizer(open_checkpoint(folder))
        think, call = tok.vocabulary["<think>"], tok.vocabulary["<tool_call>"]
        grammar = tool_grammar(HERMES, TOOLS, "required", False, "tools", tok.vocabulary, MAY)
        words = Constraint(grammar, tok, 320).words()
        allowed = {i for i in range(320) if (int(words[i // 32]) >> (i % 32)) & 1}
        assert (think in allowed, call in allowed) == (not special, not special)
        assert tok.encode("<", add_special_tokens=False)[0] in allowed


def test_specd_chat_shows_the_reasoning_apart(thinking_server: Any) -> None:
    """`specd chat` streams the reasoning dim on a terminal and to stderr when piped, so
    that stdout holds the answer alone; the turn keeps it for the next request."""
    import io

    from daemon.cli.chat import ChatOptions, Conversation, Screen, ask

    out, aside = io.StringIO(), io.StringIO()
    request = {"max_tokens": 12, "temperature": 0, "chat_template_kwargs": {"open_think": True}}
    options = ChatOptions(thinking_server.url, "k", request)
    conversation = Conversation(None)
    answer = ask(options, conversation, "hello", Screen(out, aside))
    assert answer.reasoning and aside.getvalue() == answer.reasoning
    assert answer.reasoning not in out.getvalue()
    assert conversation.messages("next")[1]["reasoning_content"] == answer.reasoning
