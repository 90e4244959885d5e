"""Sliding-window models run past their window, losslessly: speculation over a windowed
model (tree nodes share positions, the substitute draft writes into the target's cache)
gives the target's own greedy output, and the daemon's runtime plans them at their full
context. Logit parity with transformers past the window is tests/test_model_parity.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive

GREEDY = SamplingParams(temperature=0.0)
WINDOW = 6
NEW = 40


@pytest.fixture(scope="module")
def windowed(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("mistral", vocab_size=96, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def reference(windowed: Path, prompt: list[int]) -> list[int]:
    target, tok, _ = load(windowed)
    ar = Autoregressive(target)
    gen = Generation(ar, ar.new_session(128), tok, prompt, GREEDY, NEW, ignore_eos=True)
    return gen.run().token_ids


@pytest.mark.parametrize(
    ("draft", "strategy", "extra"),
    [
        ("ngram", "tree", {}),
        ("substitute", "tree", {"offload": "stream", "resident_layers": 0, "substitute_bits": 4}),
        ("substitute", "linear", {"offload": "stream", "resident_layers": 0, "substitute_bits": 4}),
    ],
    ids=["ngram-tree", "substitute-tree", "substitute-linear"],
)
def test_speculation_past_the_window_is_the_targets_greedy(
    windowed: Path, prompt: list[int], reference: list[int], draft: str, strategy: str, extra: dict
) -> None:
    rt = Runtime(
        RuntimeOptions(
            model=str(windowed), draft=draft, strategy=strategy, budget=16, device="cpu",
            context=128, **extra,
        )
    )  # fmt: skip
    assert rt.target.config.sliding_window == WINDOW and rt.target.windowed
    gen = rt.generation(prompt, GREEDY, NEW, ignore_eos=True).run()
    assert len(prompt) + NEW > 4 * WINDOW  # far past the window
    assert gen.token_ids == reference


def test_the_window_changes_the_output(windowed: Path, tiny_checkpoint, prompt, reference) -> None:  # type: ignore[no-untyped-def]
    """The same weights under full attention decode otherwise: the window is in force."""
    full, tok, _ = load(tiny_checkpoint("mistral", vocab_size=96, sliding_window=None))
    windowed_model, _, _ = load(windowed)
    assert torch.equal(full.embed_tokens.weight, windowed_model.embed_tokens.weight)
    ar = Autoregressive(full)
    gen = Generation(ar, ar.new_session(128), tok, prompt, GREEDY, NEW, ignore_eos=True)
    assert gen.run().token_ids != reference
