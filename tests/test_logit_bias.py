"""OpenAI's `logit_bias`: added to the target's logits before penalties and temperature,
the same in every strategy (exact sampling under it is tests/test_lossless.py's
`logit-bias` setting); through the daemon with the official client; bad maps are a 400
naming the field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from tokenizers import Tokenizer

from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings
from speculative.sampling import SamplingParams, probabilities
from tests.conftest import SHARED_MODELS

MODEL = "stories260k"


def test_the_bias_is_added_to_the_logits_first() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, logit_bias=((1, 2.0), (7, -100.0)))
    counts = torch.zeros(1, 10)
    got = probabilities(logits, params, (counts, counts > 0))
    biased = logits.clone()
    biased[:, 1] += 2.0
    biased[:, 7] -= 100.0
    assert torch.allclose(got, torch.softmax(biased / 0.7, -1), atol=1e-7)
    assert float(got[:, 7].max()) < 1e-40
    greedy = SamplingParams(temperature=0.0, logit_bias=((3, 100.0),))
    assert probabilities(logits, greedy, (counts, counts > 0)).argmax(-1).tolist() == [3, 3, 3]


@pytest.fixture(scope="module")
def client(stories_target: Path, stories_draft: Path) -> Iterator[openai.OpenAI]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "models.draft": (str(stories_draft), "test"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("strategy", ["autoregressive", "linear", "tree"])
def test_a_bias_steers_greedy_output_in_every_strategy(
    client: openai.OpenAI, strategy: str
) -> None:
    day = Tokenizer.from_file(str(SHARED_MODELS / "stories260k" / "tokenizer.json")).token_to_id(
        "▁day"
    )
    ask = dict(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=6, temperature=0, extra_body={"strategy": strategy},
    )  # fmt: skip
    plain = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    steered = client.chat.completions.create(**ask, logit_bias={str(day): 100})  # type: ignore[call-overload]
    assert plain.choices[0].message.content != steered.choices[0].message.content
    assert steered.choices[0].message.content.split() == ["day"] * 6
    # A ban: the token never appears, and greedy output is the same in every strategy.
    banned = client.chat.completions.create(**ask, logit_bias={str(day): -100, "1": 3})  # type: ignore[call-overload]
    reference = client.chat.completions.create(
        **{**ask, "extra_body": {"strategy": "autoregressive"}}, logit_bias={str(day): -100, "1": 3}
    )  # type: ignore[call-overload]
    assert banned.choices[0].message.content == reference.choices[0].message.content
    assert "day" not in banned.choices[0].message.content.split()


@pytest.mark.parametrize(
    "bias",
    [{"x": 1}, {"5": 101}, {"5": "up"}, [5], {"100000": 1}, {"²": 1}, {"05": 60, "5": 60}],
)
def test_a_bad_bias_is_a_400_naming_it(client: openai.OpenAI, bias: object) -> None:
    body = {"model": MODEL, "prompt": "Lily", "max_tokens": 2, "logit_bias": bias}
    request = urllib.request.Request(
        str(client.base_url) + "completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["param"] == "logit_bias"


def test_the_tree_drafts_under_the_bias_too(stories_target: Path, stories_draft: Path) -> None:
    """Greedy and walk-verified trees rank the draft's own logits: biased as the target's,
    so a strong bias is drafted and accepted (it was ranked unbiased and never accepted)."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.generation import Generation

    runtime = Runtime(
        RuntimeOptions(model=str(stories_target), draft=str(stories_draft), device="cpu", budget=8)
    )
    day = runtime.tokenizer.backend.token_to_id("▁day")
    tree = runtime.strategy("tree")
    # A prompt each: the second would otherwise walk the first's cached rows, no drafting.
    for temperature, prompt in ((0.0, "Once upon a time"), (1.0, "Lily and Tom")):
        params = SamplingParams(temperature=temperature, seed=1, logit_bias=((day, 100.0),))
        gen = Generation(
            tree, runtime.new_session(tree), runtime.tokenizer,
            runtime.tokenizer.encode(prompt), params, 24, ignore_eos=True,
        ).run()  # fmt: skip
        assert set(gen.token_ids) == {day}
        stats = gen.stats.to_dict()
        # 21 of 24 here (the last round drafts past max_tokens); 0 of 184 when unbiased.
        assert stats["accepted"] >= 0.75 * stats["drafted"] > 0, stats
