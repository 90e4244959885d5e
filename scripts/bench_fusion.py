"""Eager decode speed with stacked projections (q/k/v and gate/up one matmul each, the
model's dense layout) against the same weights split back into separate projections.

Both models live in one process and decode the same greedy continuation alternately
(stacked, split, split, stacked, ...), so drift on a shared machine hits both alike. Each
decode step is timed: the median step is the steadiest figure on a busy machine; the best
whole run is reported too, with the logits' largest difference.

    .venv/bin/python scripts/bench_fusion.py [--model DIR] [--max-tokens 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_decode import DEFAULT_MODEL  # noqa: E402
from speculative.checkpoint import DTYPES, load  # noqa: E402
from speculative.model import FUSED_PROJECTIONS, FusedLinear, Transformer  # noqa: E402


@torch.no_grad()
def unstacked(model: Transformer) -> Transformer:
    """`model` with every stacked projection split back into its separate parts (the
    layout packed models keep), in place: the same weights, one matmul per part."""
    assert isinstance(model.layers, nn.ModuleList)
    for owner in list(model.layers.modules()):
        for fused in FUSED_PROJECTIONS:
            module = getattr(owner, fused, None)
            if not isinstance(module, FusedLinear):
                continue
            row = 0
            for name, rows in module.parts:
                part = nn.Linear(
                    module.in_features,
                    rows,
                    bias=module.bias is not None,
                    dtype=module.weight.dtype,
                )
                part.weight.copy_(module.weight[row : row + rows])
                if module.bias is not None:
                    part.bias.copy_(module.bias[row : row + rows])
                setattr(owner, name, part.requires_grad_(False))
                row += rows
            setattr(owner, fused, None)
    return model


def decode(model: Transformer, prompt: list[int], n: int) -> tuple[list[float], list[int]]:
    """Greedy decode of `n` tokens after `prompt`: each decode step's seconds, the tokens."""
    cache = model.new_cache(len(prompt) + n)
    logits = model(torch.tensor(prompt), torch.arange(len(prompt)), cache, last_only=True)
    token = int(logits[-1].argmax())
    steps, tokens = [], [token]
    for i in range(n - 1):
        t0 = time.perf_counter()
        logits = model(torch.tensor([token]), torch.tensor([len(prompt) + i]), cache)
        token = int(logits[-1].argmax())
        steps.append(time.perf_counter() - t0)
        tokens.append(token)
    return steps, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    stacked, tokenizer, _ = load(args.model, args.dtype)
    split = unstacked(copy.deepcopy(stacked))
    prompt = tokenizer.encode(args.prompt)
    n = args.max_tokens
    models = {"stacked": stacked, "split": split}
    tokens = {name: decode(m, prompt, n)[1] for name, m in models.items()}  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in models}  # seconds per decode run
    steps: dict[str, list[float]] = {name: [] for name in models}  # seconds per step
    for i in range(args.repeats):
        for name in list(models) if i % 2 == 0 else list(reversed(models)):
            times, _ = decode(models[name], prompt, n)
            runs[name].append(sum(times))
            steps[name] += times

    ids = torch.tensor(prompt + tokens["stacked"][:-1])
    with torch.inference_mode():
        whole = [m(ids, torch.arange(len(ids)), m.new_cache(len(ids))) for m in models.values()]
    diff = (whole[0] - whole[1]).abs().max().item()
    print(
        f"model {args.model}  dtype {args.dtype}  {n - 1} decode steps per run  "
        f"threads {args.threads}  {args.repeats} runs each, interleaved"
    )
    print(f"{'layout':<9}{'best run tok/s':>15}{'median step ms':>16}{'median tok/s':>14}")
    median = {name: statistics.median(times) for name, times in steps.items()}
    for name in models:
        best = (n - 1) / min(runs[name])
        print(f"{name:<9}{best:>15.1f}{1000 * median[name]:>16.3f}{1 / median[name]:>14.1f}")
    best_ratio = min(runs["split"]) / min(runs["stacked"])
    print(
        f"stacked / split tokens/s: best run {best_ratio:.3f}, median step "
        f"{median['split'] / median['stacked']:.3f}   identical greedy tokens: "
        f"{tokens['stacked'] == tokens['split']}   max |logit diff| (prefill of "
        f"{len(ids)} tokens): {diff:.2e}"
    )


if __name__ == "__main__":
    main()
