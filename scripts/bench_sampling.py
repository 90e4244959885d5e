"""What one row's sampling costs at a real vocabulary, before and after top-p and the
ordered draw of sampled children looked only at a row's largest entries and support.

Each row of a tree verified by rejection gets its draft distribution (penalties,
temperature, top-k, top-p: `probabilities`) and an ordered draw of its children (Gumbel
top-k, speculative/children.py); every sampled draw of any strategy pays the first. The
"whole row" columns are the former code (a sort of the whole row; noise for every entry),
kept here as the reference; both run in the same process, one thread, side by side.

    .venv/bin/python scripts/bench_sampling.py --vocab 262144
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from speculative.children import _ordered_draw  # noqa: E402
from speculative.sampling import top_p_filter  # noqa: E402


def whole_row_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    ordered, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (ordered.cumsum(-1) - ordered) < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def whole_row_draw(q: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    e = torch.empty(q.shape, dtype=torch.float64)
    keys = q.double().log() - e.exponential_(generator=generator).log()
    return torch.topk(keys, k).indices


def per_call(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--branch", type=int, default=8, help="children drawn per node")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"vocabulary {args.vocab:,}, top_p {args.top_p}, one thread, ms per row")
    print("| logits' spread | top-p mass in the largest 1,024 | top-p: whole row | largest "
          "entries | ratio | children's draw: whole row | support | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for spread in (8.0, 4.0, 2.0, 1.0):
        # A row as peaked as a model's (spread 4-8: most of the mass in a few hundred
        # tokens) down to a flat one (spread 1), where the prefix grows to the whole row.
        logits = torch.randn(1, args.vocab, generator=gen) * spread
        probs = torch.softmax(logits, -1)
        mass = float(probs.topk(1024).values.sum())
        old_p = per_call(lambda p=probs: whole_row_top_p(p, args.top_p), args.repeats)
        new_p = per_call(lambda p=probs: top_p_filter(p, args.top_p), args.repeats)
        q = top_p_filter(probs, args.top_p)[0]
        old_d = per_call(lambda q=q: whole_row_draw(q, args.branch, gen), args.repeats)
        new_d = per_call(lambda q=q: _ordered_draw(q, args.branch, gen), args.repeats)
        print(
            f"| {spread:g} | {mass:.3f} | {old_p * 1e3:.2f} | {new_p * 1e3:.2f} | "
            f"{old_p / new_p:.1f}x | {old_d * 1e3:.2f} | {new_d * 1e3:.2f} | "
            f"{old_d / new_d:.1f}x |"
        )


if __name__ == "__main__":
    main()
