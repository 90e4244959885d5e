"""OpenAI's harmony format (gpt-oss): a turn's text read into its answer and its reasoning
however it streams, the tokenizer keeping the markers in decoded text and ending a turn at
`<|return|>` or `<|call|>`, the chat response's `reasoning_content`, and tools refused by
name for such a model (its calls are not read yet)."""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from daemon.http.openai_responses import ResponseShape
from modeling.text.harmony import MARKERS, MAX_HEADER, HarmonyReader, read_turn
from modeling.text.tokenizer import Tokenizer

TURN = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! <b>How</b> can I help?"
)


def _read_in_pieces(text: str, cuts: list[int]) -> tuple[str, str]:
    reader, events = HarmonyReader(), []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += reader.feed(text[a:b])
    events += reader.finish()
    return (
        "".join(t for kind, t in events if kind == "content"),
        "".join(t for kind, t in events if kind == "reasoning"),
    )


def test_a_turn_is_its_answer_and_its_reasoning_however_it_streams() -> None:
    whole = read_turn(TURN)
    assert whole == ("Hello! <b>How</b> can I help?", "The user greets; answer briefly.")
    for cut in range(len(TURN) + 1):  # every split in two, and one character at a time
        assert _read_in_pieces(TURN, [cut]) == whole, cut
    assert _read_in_pieces(TURN, list(range(1, len(TURN)))) == whole


def test_what_is_not_a_harmony_message_passes_through() -> None:
    assert read_turn("plain words, <| not a marker") == ("plain words, <| not a marker", "")
    assert read_turn("stray<|end|> marker<|") == ("stray marker<|", "")
    assert read_turn("") == ("", "")
    # a header that never reaches its message is read as text once it is too long
    long = "<|channel|>" + "x" * (MAX_HEADER + 10)
    assert read_turn(long) == ("x" * (MAX_HEADER + 10), "")  # (its marker dropped)
    # a preamble on the commentary channel is for the user; an unfinished header is not text
    assert read_turn("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assist") == (
        "Let me check.", "",
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

    base = tiny_checkpoint("llama", vocab_size=96, tokenizer_size=80)
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


def test_a_harmony_model_answers_and_refuses_tools_by_name(harmony_server) -> None:
    """A chat answer from a harmony model is a well-formed message (this random model writes
    no harmony structure: its text is the answer); tools are a 400 naming `tools` (its
    calls are not read yet), tool_choice none is served."""
    messages = [{"role": "user", "content": "hi"}]
    status, body = _chat(harmony_server, {"model": "model", "messages": messages, "max_tokens": 8})
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert "<|" not in (body["choices"][0]["message"]["content"] or "")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    status, body = _chat(
        harmony_server, {"model": "model", "messages": messages, "max_tokens": 8, "tools": [tool]}
    )
    assert status == 400 and body["error"]["param"] == "tools", body
    assert "harmony" in body["error"]["message"]
    none = {"model": "model", "messages": messages, "max_tokens": 8, "tools": [tool],
            "tool_choice": "none"}  # fmt: skip
    status, body = _chat(harmony_server, none)
    assert status == 200, body
