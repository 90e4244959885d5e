"""Peak memory one tree round adds at a real vocabulary and budget, on the CPU.

A random model with the real vocabulary (128,256) and a tiny hidden size, so the round's
memory is what grows with nodes × vocabulary: the verified logits, and whatever sampling and
the prefix cache add. The second round is measured (the first pays one-off allocations).

    .venv/bin/python scripts/bench_walk_memory.py --budget 1024 --prefix-cache 0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.config import ModelConfig  # noqa: E402
from modeling.decoder import Transformer  # noqa: E402
from offload.machine import PeakMemory  # noqa: E402
from offload.units import format_size, parse_size  # noqa: E402
from speculative.passes import alone  # noqa: E402
from speculative.prefix_cache import PrefixCache  # noqa: E402
from speculative.sampling import SamplingParams, make_generator  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402


def random_model(vocab: int, seed: int) -> Transformer:
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--prefix-cache", default="0", help="size, e.g. 1GiB, or 0")
    p.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token")
    args = p.parse_args()
    torch.set_num_threads(1)
    target, draft = random_model(args.vocab, 0), random_model(args.vocab, 1)
    cache_bytes = 0 if args.prefix_cache == "0" else parse_size(args.prefix_cache)
    strategy = TreeSpeculation(
        target, draft, budget=args.budget, max_depth=16, prefix_cache=PrefixCache(cache_bytes)
    )
    session = strategy.new_session(4 * args.budget)
    # Sampling with penalties and top-k: every per-node temporary the old draw rule built.
    params = SamplingParams(
        temperature=1.0, top_k=50, repetition_penalty=1.1, seed=0, logprobs=args.logprobs
    )
    rounds = alone(strategy.steps(session, list(range(1, 9)), params, 64, make_generator(0)))
    next(rounds)
    with PeakMemory("cpu") as peak:
        rnd = next(rounds)
    logits = (args.budget + 1) * args.vocab * 4
    result = {
        "vocab": args.vocab,
        "budget": args.budget,
        "tree_nodes": rnd.stats.tree_nodes,
        "prefix_cache_bytes": cache_bytes,
        "round_peak_bytes": peak.bytes,
        "logits_bytes": logits,
        "logprobs": args.logprobs,
    }
    shown = "unmeasured" if peak.bytes is None else format_size(peak.bytes)
    print(
        f"vocab {args.vocab}, budget {args.budget}, prefix cache {format_size(cache_bytes)}: "
        f"one round adds {shown} (its verified logits alone: {format_size(logits)})"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
