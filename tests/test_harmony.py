"""OpenAI's harmony format (gpt-oss): a turn's text read into its answer, its reasoning and
its tool calls however it streams, the tokenizer keeping the markers in decoded text and
ending a turn at `<|return|>` or `<|call|>`, the chat response's `reasoning_content`, and
a required call generated under the harmony call's grammar."""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from daemon.http.openai_responses import ResponseShape
from modeling.text.harmony import MARKERS
from modeling.text.tokenizer import Tokenizer
from speculative.harmony import MAX_HEADER, HarmonyReader, read_turn

TURN = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! <b>How</b> can I help?"
)


CALLS = (
    "<|channel|>analysis<|message|>Two cities: call twice.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz":"CET"}'
)


def _read_in_pieces(text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]]]:
    reader, events = HarmonyReader(), []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += reader.feed(text[a:b])
    events += reader.finish()
    calls = [[e[3], ""] for e in events if e[0] == "call"]
    for e in events:
        if e[0] == "arguments":
            calls[e[1]][1] += e[2]
    return (
        "".join(e[1] for e in events if e[0] == "content"),
        "".join(e[1] for e in events if e[0] == "reasoning"),
        [(name, arguments) for name, arguments in calls],
    )


def _whole(text: str) -> tuple[str, str, list[tuple[str, str]]]:
    answer, reasoning, calls = read_turn(text)
    return answer, reasoning, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text", [TURN, CALLS], ids=["answer", "calls"])
def test_a_turn_is_its_answer_reasoning_and_calls_however_it_streams(text: str) -> None:
    whole = _whole(text)
    for cut in range(len(text) + 1):  # every split in two, and one character at a time
        assert _read_in_pieces(text, [cut]) == whole, cut
    assert _read_in_pieces(text, list(range(1, len(text)))) == whole


def test_what_a_turn_holds() -> None:
    assert _whole(TURN) == ("Hello! <b>How</b> can I help?", "The user greets; answer briefly.", [])
    assert _whole(CALLS) == (
        "", "Two cities: call twice.",
        [("get_weather", '{"city":"Paris"}'), ("get_time", '{"tz":"CET"}')],
    )  # fmt: skip
    # no tools offered: a message to a function is no call, nor for the user
    assert read_turn(CALLS, allow_calls=False)[:2] == (
        "", 'Two cities: call twice.{"city":"Paris"}{"tz":"CET"}',
    )  # fmt: skip
    assert read_turn(CALLS, allow_calls=False)[2] == []
    ids = {c.id for c in read_turn(CALLS)[2]}
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids)
    # a message to a built-in tool (browser, python) is not for the user, nor a function
    builtin = "<|channel|>analysis to=browser.search<|message|>{}<|end|>"
    assert _whole(builtin + "<|start|>assistant<|channel|>final<|message|>ok") == ("ok", "{}", [])


def test_what_is_not_a_harmony_message_passes_through() -> None:
    assert _whole("plain words, <| not a marker") == ("plain words, <| not a marker", "", [])
    assert _whole("stray<|end|> marker<|") == ("stray marker<|", "", [])
    assert _whole("") == ("", "", [])
    # a header that never reaches its message is read as text once it is too long
    long = "<|channel|>" + "x" * (MAX_HEADER + 10)
    assert _whole(long) == ("x" * (MAX_HEADER + 10), "", [])  # (its marker dropped)
    # a preamble on the commentary channel is for the user; an unfinished header is not text
    assert _whole("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assist") == (
        "Let me check.", "", [],
    )  # fmt: skip


def test_a_body_holds_back_only_what_could_begin_a_marker() -> None:
    reader = HarmonyReader()
    assert reader.feed("<|channel|>final<|message|>a <") == [("content", "a ")]
    assert reader.feed("b") == [("content", "<b")]  # not a marker after all
    assert reader.feed("<|") == []
    assert reader.feed("end|>") == []
    assert reader.finish() == []


def _harmony_tokenizer(tmp_path: Path, base: Path) -> Path:
    """`base`'s tokenizer.json with harmony's markers as special tokens."""
    backend = HFTokenizer.from_file(str(base / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(m, special=True) for m in MARKERS])
    out = tmp_path / "harmony-tokenizer.json"
    backend.save(str(out))
    return out


def test_a_harmony_tokenizer_shows_its_markers_and_stops_its_turns(
    tiny_checkpoint, tmp_path: Path
) -> None:
    base = tiny_checkpoint("llama", vocab_size=96, tokenizer_size=80)
    backend = HFTokenizer.from_file(str(_harmony_tokenizer(tmp_path, base)))
    tok = Tokenizer(backend, eos_token="</s>", eos_token_ids=[2])
    assert tok.harmony
    ids = {m: backend.token_to_id(m) for m in MARKERS}
    assert set(tok.eos_token_ids) == {2, ids["<|return|>"], ids["<|call|>"]}
    words = tok.encode("hello", add_special_tokens=False)
    text = tok.decode([ids["<|channel|>"], *words, ids["<|message|>"], *words, ids["<|end|>"]])
    plain = tok.decode(words)
    assert text == f"<|channel|>{plain}<|message|>{plain}<|end|>"
    other = Tokenizer(HFTokenizer.from_file(str(base / "tokenizer.json")), eos_token_ids=[2])
    assert not other.harmony and other.eos_token_ids == (2,)


def test_the_response_carries_the_reasoning_apart() -> None:
    shape = ResponseShape(chat=True, model="m")
    body = shape.full("Hello!", "stop", {}, {}, reasoning="think")
    assert body["choices"][0]["message"] == {
        "role": "assistant", "content": "Hello!", "reasoning_content": "think",
    }  # fmt: skip
    assert "reasoning_content" not in shape.full("Hi", "stop", {}, {})["choices"][0]["message"]
    delta = shape.chunk("", reasoning="th")["choices"][0]["delta"]
    assert delta == {"reasoning_content": "th"}


@pytest.fixture(scope="module")
def harmony_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.keyed_server import keyed_server

    # A byte-level tokenizer (300 entries, the markers after them): it spells any text
    base = tiny_checkpoint("llama", vocab_size=320, tokenizer_size=300)
    folder = tmp_path_factory.mktemp("harmony-model") / "model"
    shutil.copytree(base, folder)
    shutil.copy(_harmony_tokenizer(folder.parent, base), folder / "tokenizer.json")
    yield from keyed_server(folder, tmp_path_factory, "k", {"models.draft": "none"})


def _chat(server, body: dict) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=60)
    headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data


def test_a_harmony_model_answers_and_makes_a_required_call(harmony_server) -> None:
    """A chat answer from a harmony model is a well-formed message (this random model writes
    no harmony structure: its text is the answer, stray markers dropped), with tools offered
    too; a required call, or one named, is generated under the harmony call's grammar (the
    random model can write nothing else) and read back as the call, its arguments valid
    for the function's schema."""
    messages = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "count", "parameters": schema}},
    ]
    for extra in ({}, {"tools": tools}, {"tools": tools, "tool_choice": "none"}):
        body = {"model": "model", "messages": messages, "max_tokens": 8, **extra}
        status, answer = _chat(harmony_server, body)
        assert status == 200, answer
        message = answer["choices"][0]["message"]
        assert message["role"] == "assistant" and "<|" not in (message["content"] or "")
    named = {"type": "function", "function": {"name": "count"}}
    for choice, names in (("required", {"f", "count"}), (named, {"count"})):
        # (stop strings end no call: "}" cut a named call's arguments, a reviewer found)
        for stop in (None, ["}", '"']):
            body = {"model": "model", "messages": messages, "max_tokens": 96, "tools": tools,
                    "tool_choice": choice, "seed": 1, "stop": stop}  # fmt: skip
            status, answer = _chat(harmony_server, body)
            assert status == 200, answer
            choice0 = answer["choices"][0]
            (call,) = choice0["message"]["tool_calls"]
            assert choice0["finish_reason"] == "tool_calls" and call["function"]["name"] in names
            arguments = json.loads(call["function"]["arguments"])
            assert isinstance(arguments, dict)
            if call["function"]["name"] == "count":
                assert set(arguments) == {"n"} and isinstance(arguments["n"], int)


def test_a_harmony_model_reasons_at_low_medium_or_high(harmony_server) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's newer efforts (`none`, `minimal`) would reach gpt-oss's template, which
    writes the effort into its system message: a 400 naming the field; its own are taken."""
    base = {"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for effort in ("none", "minimal"):
        status, answer = _chat(harmony_server, {**base, "reasoning_effort": effort})
        assert status == 400 and answer["error"]["param"] == "reasoning_effort", answer
    status, answer = _chat(harmony_server, {**base, "reasoning_effort": "low"})
    assert status == 200, answer


def test_a_call_without_content_renders_in_a_harmony_conversation(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """gpt-oss's template tests `"..." in message.content` wherever a message has content:
    an assistant call sent with `content: null` (as OpenAI's client sends it) is rendered
    without the key, not refused."""
    from daemon.admission import _encode_conversation

    base = tiny_checkpoint("llama", vocab_size=96, tokenizer_size=80)
    backend = HFTokenizer.from_file(str(_harmony_tokenizer(tmp_path, base)))
    template = (
        "{% for m in messages %}{% if 'content' in m and '<|channel|>' in m.content %}"
        "{{ raise_exception('tags') }}{% endif %}{{ m.role }}:{{ m.content or '' }};{% endfor %}"
    )
    tok = Tokenizer(backend, eos_token_ids=[2], chat_template=template)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
    ]
    assert _encode_conversation(tok, messages, None)


def test_a_required_call_needs_every_harmony_marker() -> None:
    from modeling.errors import RequestError
    from speculative.harmony import harmony_call_grammar
    from speculative.tool_calls import Tool

    vocabulary = {m: 90 + i for i, m in enumerate(MARKERS) if m != "<|constrain|>"}
    with pytest.raises(RequestError, match="lacks harmony's <\\|constrain\\|>") as err:
        harmony_call_grammar([Tool("f", "", {"type": "object"})], "required", vocabulary, "tools")
    assert err.value.param == "tool_choice"


def test_an_earlier_turns_reasoning_is_the_harmony_templates_thinking(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """An assistant turn that called and said nothing has its `reasoning_content` (as specd
    answered it) reach gpt-oss's template as `thinking`, written back as the analysis
    before its calls. A turn that called with a preamble has that as its analysis, and the
    template refuses both (a reviewer found every such conversation's next request a 400);
    a turn that did not call keeps no reasoning, as the template keeps none."""
    from daemon.admission import _encode_conversation

    base = tiny_checkpoint("llama", vocab_size=96, tokenizer_size=80)
    backend = HFTokenizer.from_file(str(_harmony_tokenizer(tmp_path, base)))
    template = (  # (gpt-oss's own clause, then what it writes)
        "{% for m in messages %}{% if m.tool_calls and m.content and m.thinking %}"
        "{{ raise_exception('Cannot pass both content and thinking in an assistant message "
        "with tool calls!') }}{% endif %}{{ m.role }}:{% if m.thinking is defined %}"
        "[{{ m.thinking }}]{% endif %}{{ m.content or '' }};{% endfor %}"
    )
    tok = Tokenizer(backend, eos_token_ids=[2], chat_template=template)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "f"},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{**call, "id": "call_2"}],
         "reasoning_content": "again"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "answer"},
        {"role": "user", "content": "more"},
    ]  # fmt: skip
    rendered: list[str] = []
    render = tok.render_chat

    def encode_chat(messages: list[dict], **options: object) -> list[int]:
        rendered.append(render(messages, add_generation_prompt=False))
        return [1]

    tok.encode_chat = encode_chat  # type: ignore[method-assign]  # (80 tokens spell little)
    _encode_conversation(tok, messages, None)
    assert rendered == [
        "user:hi;assistant:[f];tool:1;assistant:Checking.;tool:2;assistant:Done.;user:more;"
    ]
