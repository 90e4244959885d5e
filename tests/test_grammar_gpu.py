"""Constrained decoding on CUDA (masks made on the host, applied to logits on the device):
greedy output equals the CPU's. Its own module: a bare GPU image has no openai client,
which tests/test_structured.py imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from speculative.generation import Generation
from speculative.grammar import Constraint, Grammar
from speculative.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "pet": {"enum": ["dog", "cat"]}},
    "required": ["name", "pet"],
    "additionalProperties": False,
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_constrained_tree_output_is_the_cpus(
    stories_target: Path, stories_draft: Path
) -> None:
    texts = []
    for device in ("cpu", "cuda"):
        rt = Runtime(
            RuntimeOptions(
                model=str(stories_target), draft=str(stories_draft), device=device, budget=16,
                dtype="fp32",
            )
        )  # fmt: skip
        grammar = Grammar.json_schema(SCHEMA, "response_format")
        grammar.check(rt.tokenizer)
        strategy = rt.strategy("tree")
        gen = Generation(
            strategy, rt.new_session(strategy), rt.tokenizer,
            rt.tokenizer.encode("Lily had a"), SamplingParams(temperature=0.0), 80,
            constraint=Constraint(grammar, rt.tokenizer, rt.target.vocab_width),
        ).run()  # fmt: skip
        texts.append(gen.text)
    assert texts[0] == texts[1]
    assert json.loads(texts[1])["pet"] in ("dog", "cat")
