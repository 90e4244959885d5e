"""A check the architecture tests share: speculation over a tiny checkpoint of a family
gives the target's own greedy output, whatever runs it (a streamed target alone, from RAM
or read from its files at every pass, an n-gram tree, a substitute built from the
architecture's own blocks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive

GREEDY = SamplingParams(temperature=0.0)
STREAMED = {"offload": "stream", "resident_layers": 0}
# (draft, strategy, runtime options): the runs every architecture's test makes
RUNS = [
    (None, "autoregressive", STREAMED),  # a slot takes on each layer's own options
    ("ngram", "tree", {}),
    ("substitute", "tree", {**STREAMED, "substitute_bits": 4}),
    ("substitute", "linear", {**STREAMED, "substitute_bits": 4}),
    (None, "autoregressive", {**STREAMED, "host_tier": "disk", "slots": 2}),  # read per pass
]
RUN_IDS = ["streamed", "ngram", "substitute", "substitute-linear", "disk"]


def speculation_runtime(
    path: Path, draft: str | None, strategy: str, extra: dict[str, Any], seed: int, new: int = 40
) -> Runtime:
    """The runtime of that run, after checking its greedy output of `new` tokens after a
    random 8-token prompt equals the plain target's."""
    target, tok, _ = load(path)
    vocab = target.config.vocab_size
    prompt = torch.randint(3, vocab, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    plain = Autoregressive(target)
    session = plain.new_session(96)
    reference = Generation(plain, session, tok, prompt, GREEDY, new, ignore_eos=True).run()
    rt = Runtime(
        RuntimeOptions(
            model=str(path), draft=draft, strategy=strategy, budget=16, device="cpu",
            context=96, **extra,
        )
    )  # fmt: skip
    gen = rt.generation(prompt, GREEDY, new, ignore_eos=True).run()
    assert gen.token_ids == reference.token_ids
    return rt
