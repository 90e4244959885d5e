"""Log-probabilities of the emitted tokens: the target's own next-token distribution at each
emitted token (log-softmax of its logits), the same under every strategy, one entry per
token a client receives; in OpenAI's shapes, streamed and not (tests/test_server_errors.py
checks the non-streamed shapes and the 400s)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from daemon.http.server import BackgroundServer
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.settings_loading import load_settings
from speculative.generation import Generation
from speculative.sampling import SamplingParams, TokenLogprob, token_logprob

PROMPT = "Once upon a time, there was a little girl"


@pytest.fixture(scope="module")
def runtime(stories_target: Path, stories_draft: Path) -> Runtime:
    options = RuntimeOptions(
        model=str(stories_target), draft=str(stories_draft), device="cpu", budget=8,
        prefix_cache=0,
    )  # fmt: skip
    return Runtime(options)


def generate(runtime: Runtime, name: str, params: SamplingParams) -> tuple[list[int], list]:
    strategy = runtime.strategy(name)
    ids = runtime.tokenizer.encode(PROMPT)
    gen = Generation(strategy, runtime.new_session(strategy), runtime.tokenizer, ids, params, 24)
    chunks = list(gen)
    return gen.token_ids, [lp for c in chunks for lp in c.logprobs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_strategy_reports_the_targets_logprobs(runtime: Runtime, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=7, logprobs=3)
    runs = {name: generate(runtime, name, params) for name in ("autoregressive", "linear", "tree")}
    for name, (tokens, logprobs) in runs.items():
        assert [lp.token for lp in logprobs] == tokens, name  # one per token received
        assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in logprobs), name
        if temperature == 0.0:
            assert all(lp.top[0][0] == lp.token for lp in logprobs), name  # greedy: the top
    # Tree and autoregressive sample the same tokens (position-keyed noise), so all three
    # agree at T=0 and these two at T=1: the log-probabilities agree to rounding.
    pairs = itertools.combinations(runs, 2) if temperature == 0.0 else [("autoregressive", "tree")]
    for a, b in pairs:
        assert runs[a][0] == runs[b][0]
        for x, y in zip(runs[a][1], runs[b][1], strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("name", ["autoregressive", "tree"])
def test_logprobs_spell_the_text_a_stop_string_leaves(runtime: Runtime, name: str) -> None:
    """A stop string cuts the log-probabilities with the text: no entry for a token inside
    the stop string (" a great" made the text " is" and gave the tokens " is", " a",
    " great"), and none for a token whose text a stop's prefix holds before that text is
    given (a stream gave them ahead of their text)."""
    strategy = runtime.strategy(name)
    ids = runtime.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0.0, logprobs=0)

    def run(stop: list[str]) -> tuple[Generation, list]:
        session = runtime.new_session(strategy)
        gen = Generation(strategy, session, runtime.tokenizer, ids, greedy, 24, stop=stop)
        return gen, list(gen)

    whole = run([])[0]
    words = whole.token_ids
    # The answer's text up to each token (a decode alone drops a leading space).
    lead = len(whole.text) - len(runtime.tokenizer.decode(words))
    ends = [len(runtime.tokenizer.decode(words[: k + 1])) + lead for k in range(len(words))]
    pieces = [whole.text[:end] for end in ends]
    # The text of two tokens, from the third on, found nowhere before it.
    k = next(
        k for k in range(2, len(words) - 2)
        if pieces[k + 2].find(pieces[k + 2][len(pieces[k]) :]) == len(pieces[k])
        and pieces[k + 2].startswith(pieces[k]) and len(pieces[k + 2]) > len(pieces[k])
    )  # fmt: skip
    stop = pieces[k + 2][len(pieces[k]) :]
    gen, chunks = run([stop])
    assert gen.text == pieces[k] and gen.finish_reason == "stop"
    assert [lp.token for c in chunks for lp in c.logprobs] == words[: k + 1]
    text, given = "", 0
    for chunk in chunks:  # as it streams: never a token ahead of its text
        text += chunk.text
        given += len(chunk.logprobs)
        assert not given or len(pieces[given - 1]) <= len(text)


def test_a_token_a_stop_string_begins_inside_is_given_whole(runtime: Runtime) -> None:
    """The answer ends where the stop string begins, inside a token's text: that token's
    entry is given whole, as it was generated (docs/api.md), and none after it."""
    strategy = runtime.strategy("autoregressive")
    ids = runtime.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0.0, logprobs=0)

    def run(stop: list[str]) -> tuple[Generation, list]:
        gen = Generation(
            strategy, runtime.new_session(strategy), runtime.tokenizer, ids, greedy, 24, stop=stop
        )
        return gen, [lp for c in gen for lp in c.logprobs]

    whole = run([])[0]
    words = whole.token_ids
    lead = len(whole.text) - len(runtime.tokenizer.decode(words))
    ends = [len(runtime.tokenizer.decode(words[: k + 1])) + lead for k in range(len(words))]
    # A token of two characters or more whose end and the next token's text are found
    # nowhere before: the stop string begins after its first character.
    k = next(
        k for k in range(1, len(words) - 1)
        if ends[k] - ends[k - 1] >= 2
        and whole.text.find(whole.text[ends[k - 1] + 1 : ends[k + 1]]) == ends[k - 1] + 1
    )  # fmt: skip
    gen, logprobs = run([whole.text[ends[k - 1] + 1 : ends[k + 1]]])
    assert gen.text == whole.text[: ends[k - 1] + 1] and gen.finish_reason == "stop"
    assert [lp.token for lp in logprobs] == words[: k + 1]


def test_token_logprob_is_the_log_softmax_row() -> None:
    logits = torch.tensor([2.0, 0.5, -1.0, 3.0])
    lp = token_logprob(logits, 1, 2)
    expected = torch.log_softmax(logits, -1)
    assert lp == TokenLogprob(
        1, float(expected[1]), [(3, float(expected[3])), (0, float(expected[0]))]
    )
    assert token_logprob(logits, 1, 0).top == []


def test_streamed_chat_logprobs_equal_the_whole_answers(stories_target: Path) -> None:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "t"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "t"),
        },
    )
    import http.client

    def post(body: dict) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        return conn.getresponse().read().decode()

    request = {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip
    with BackgroundServer(settings) as server:
        whole = json.loads(post(request))
        streamed = post({**request, "stream": True})
        # An answer of no tokens (the end of sequence first, as a model may give): its empty
        # list of log-probabilities (it was a 500)
        empty = json.loads(post({**request, "logit_bias": {"2": 100}}))
        # A byte the answer is made of (<0xF0>, id 243: a character's first byte) reads
        # U+FFFD as text, and its bytes are its own
        lead = json.loads(post({**request, "logit_bias": {"243": 100}, "max_tokens": 3}))
    assert [x["bytes"] for x in lead["choices"][0]["logprobs"]["content"]] == [[0xF0]] * 3
    assert empty["choices"][0]["message"]["content"] == ""
    assert empty["choices"][0]["logprobs"] == {"content": []}
    content = whole["choices"][0]["logprobs"]["content"]
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    parts = [c["logprobs"]["content"] for e in events for c in e["choices"] if c.get("logprobs")]
    assert [x for p in parts for x in p] == content
    assert "".join(x["token"] for x in content) == whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize("kind", ["byte-fallback", "byte-level"])
def test_a_piece_of_a_character_gives_its_own_bytes(
    stories_target: Path, tiny_checkpoint, kind: str
) -> None:
    """A token that is part of a character reads U+FFFD as text (or nothing, where a
    byte-level decode puts one U+FFFD for a run of bytes), and its `bytes` are its own
    (they were U+FFFD's, or none), as OpenAI's field is meant for: joined, they are the
    answer's UTF-8."""
    from daemon.http.openai_responses import ResponseShape
    from modeling.checkpoints.checkpoint import open_checkpoint
    from modeling.text.tokenizer import Tokenizer

    folder = stories_target if kind == "byte-fallback" else tiny_checkpoint("llama", vocab_size=320)
    ckpt = open_checkpoint(folder)
    tok = Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)
    text = "a🌍é🌍日本"
    ids = tok.encode(text, add_special_tokens=False)
    assert sum(tok.piece(i) in ("\ufffd", "") for i in ids) >= 4  # spelled in bytes
    entries = [TokenLogprob(i, -0.5, [(i, -0.5)]) for i in ids]
    shape = ResponseShape(chat=True, model="m", piece=tok.piece, raw_bytes=tok.raw_bytes)
    body = shape.logprobs(entries, previous=ids[0])
    assert body is not None
    joined = b"".join(bytes(item["bytes"]) for item in body["content"])
    assert joined.decode().strip() == text
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in body["content"])


def test_a_whole_byte_after_bytes_that_are_not_utf8_gives_its_own_bytes(
    stories_target: Path,
) -> None:
    """Byte fallback reads a run all or nothing: a space spelled `<0x20>` after a stray
    byte reads U+FFFD in context, and its `bytes` were U+FFFD's; they are its own byte."""
    from daemon.http.openai_responses import ResponseShape
    from modeling.checkpoints.checkpoint import open_checkpoint
    from modeling.text.tokenizer import Tokenizer

    ckpt = open_checkpoint(stories_target)
    tok = Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)
    ids = [tok.backend.token_to_id(f"<0x{b:02X}>") for b in (0xAF, 0x20, 0xAF)]
    entries = [TokenLogprob(i, -0.5, []) for i in ids]
    shape = ResponseShape(chat=True, model="m", piece=tok.piece, raw_bytes=tok.raw_bytes)
    body = shape.logprobs(entries, previous=ids[0])
    assert body is not None
    assert [item["bytes"] for item in body["content"]] == [[0xAF], [0x20], [0xAF]]
