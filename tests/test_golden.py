"""Greedy output of the real checkpoints equals the stored golden ids (made with
transformers) — the llama2.c-style test that catches what unit tests miss."""

from __future__ import annotations

import torch

from modeling.checkpoints.checkpoint import load
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive


def test_stories260k_greedy_matches_reference(stories_target, stories_reference):
    model, tok, _ = load(stories_target)
    strategy = Autoregressive(model)
    for item in stories_reference["items"]:
        ids = tok.encode(item["prompt"])
        assert ids == item["prompt_ids"]
        gen = Generation(
            strategy,
            strategy.new_session(512),
            tok,
            ids,
            SamplingParams(temperature=0.0),
            max_tokens=len(item["new_token_ids"]),
            ignore_eos=True,
        ).run()
        assert gen.token_ids == item["new_token_ids"], item["prompt"]
        assert gen.finish_reason == "length"


def test_stories260k_first_logits_match_reference(stories_target, stories_reference):
    model, _, _ = load(stories_target)
    for item in stories_reference["items"]:
        ids = torch.tensor(item["prompt_ids"])
        logits = model(ids, torch.arange(len(ids)), model.new_cache(64), last_only=True)[0]
        top_ids = [i for i, _ in item["first_step_top5_logits"]]
        top_values = torch.tensor([v for _, v in item["first_step_top5_logits"]])
        assert logits.topk(5).indices.tolist() == top_ids
        assert torch.allclose(logits[top_ids], top_values, atol=1e-4)


def test_stories260k_text_matches_reference(stories_target, stories_reference):
    _, tok, _ = load(stories_target)
    for item in stories_reference["items"]:
        full = tok.decode(item["prompt_ids"] + item["new_token_ids"])
        assert full == item["full_text"]
