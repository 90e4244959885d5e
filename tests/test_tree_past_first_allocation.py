"""Trees larger than the KV cache's first allocation (512 slots) on a model whose context
is longer than that: the cache grows inside the verify pass, which runs in inference mode,
and the commit after it compacts the cache in place outside inference mode. Tensors made
inside inference mode refuse that (`RuntimeError: Inplace update to inference tensor
outside InferenceMode`), so every request failed at the 24 GB profile's default budget of
1,024 (issue 11); `KVCache._grow` makes its storage as normal tensors."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.http.server import BackgroundServer
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.settings_loading import load_settings
from modeling.kv_cache import INITIAL_SLOTS
from speculative.generation import Generation
from speculative.sampling import SamplingParams

BUDGETS = (600, 1024)
CONTEXT = 4096


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Callable[..., Path]) -> tuple[Path, Path]:
    """A target and a one-layer draft with the same tokenizer, both with a 4,096 context."""
    target = tiny_checkpoint("llama", max_position_embeddings=CONTEXT, seed=3)
    draft = tiny_checkpoint("llama", max_position_embeddings=CONTEXT, seed=4, num_layers=1)
    return target, draft


@pytest.mark.parametrize("budget", BUDGETS)
def test_generation_with_a_tree_past_the_first_allocation(
    pair: tuple[Path, Path], budget: int
) -> None:
    target, draft = pair
    options = RuntimeOptions(model=str(target), draft=str(draft), device="cpu", budget=budget)
    runtime = Runtime(options)
    assert runtime.context > INITIAL_SLOTS
    strategy = runtime.strategy("tree")
    session = runtime.new_session(strategy)
    gen = Generation(
        strategy, session, runtime.tokenizer, [1, 5, 9, 11], SamplingParams(temperature=0),
        max_tokens=6, ignore_eos=True,
    )  # fmt: skip
    gen.run()
    assert len(gen.token_ids) == 6
    # The tree really went past the first allocation of the target's cache.
    assert session.target_cache.allocated > INITIAL_SLOTS
    # Greedy speculation is lossless: the same tokens as plain decoding.
    plain = runtime.strategy("autoregressive")
    reference = Generation(
        plain, runtime.new_session(plain), runtime.tokenizer, [1, 5, 9, 11],
        SamplingParams(temperature=0), max_tokens=6, ignore_eos=True,
    )  # fmt: skip
    reference.run()
    assert gen.token_ids == reference.token_ids


def test_requests_with_trees_past_the_first_allocation(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(target), "test"),
            "runtime.compile": ("off", "test"),
            "models.draft": (str(draft), "test"),
            "models.device": ("cpu", "test"),
            "server.port": (0, "test"),
            "speculation.budget": (max(BUDGETS), "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        assert srv.server.engine.runtime is not None
        assert srv.server.engine.runtime.context > INITIAL_SLOTS
        cases = [(budget, stream) for budget in (None, *BUDGETS) for stream in (False, True)]
        for i, (budget, stream) in enumerate(cases):
            # A prompt of its own each (the prefix cache would answer a repeated one without
            # any tree), long enough that prompt and tree pass the first allocation.
            prompt = [1, 5 + i] + [9, 11, 13] * 130
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "stream": stream}  # fmt: skip
            if budget is not None:
                body["budget"] = budget
            conn = http.client.HTTPConnection("127.0.0.1", srv.server.port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps(body))
            resp = conn.getresponse()
            text = resp.read().decode()
            conn.close()
            assert resp.status == 200, text
            if stream:
                assert '"error"' not in text and text.endswith("data: [DONE]\n\n")
            else:
                stats = json.loads(text)["specd"]
                assert stats["strategy"] == "tree"
                assert stats["budget"] == (budget or max(BUDGETS))
                assert stats["target_passes"] >= 1
                # (tree_nodes is the mean per pass: the largest tree was at least that)
                assert len(prompt) + stats["tree_nodes"] > INITIAL_SLOTS
