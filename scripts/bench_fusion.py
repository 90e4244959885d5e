"""Eager decode speed with stacked projections (q/k/v and gate/up one matmul each, the
model's dense layout) against the same weights split back into separate projections.

Both models live in one process and decode the same greedy continuation in lockstep:
step i of one, then step i of the other (the order alternating), so load on a shared
machine hits both alike. The headline is the median over steps of the paired ratio; the
median step and the best whole run of each are reported too, with the logits' largest
difference.

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

from modeling.checkpoints.checkpoint import DTYPES, load  # noqa: E402
from modeling.decoder import Transformer  # noqa: E402
from modeling.weights.projections import FUSED_PROJECTIONS, FusedLinear  # noqa: E402
from scripts.bench_decode import DEFAULT_MODEL  # noqa: E402


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


class Decoder:
    """One model's greedy decode, a step at a time (so two models can alternate steps)."""

    def __init__(self, model: Transformer, prompt: list[int], n: int) -> None:
        self.model, self.position = model, len(prompt)
        self.cache = model.new_cache(len(prompt) + n)
        logits = model(torch.tensor(prompt), torch.arange(len(prompt)), self.cache, last_only=True)
        self.tokens = [int(logits[-1].argmax())]

    def step(self) -> float:
        """Feed the last token, pick the next; the seconds it took."""
        t0 = time.perf_counter()
        pos = torch.tensor([self.position])
        logits = self.model(torch.tensor([self.tokens[-1]]), pos, self.cache)
        self.tokens.append(int(logits[-1].argmax()))
        seconds = time.perf_counter() - t0
        self.position += 1
        return seconds


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
    names = ("stacked", "split")
    steps: dict[str, list[float]] = {name: [] for name in names}  # seconds per step
    runs: dict[str, list[float]] = {name: [] for name in names}  # seconds per decode
    ratios: list[float] = []  # split / stacked, step by step
    tokens: dict[str, list[int]] = {}
    for r in range(args.repeats + 1):  # the first run is a warm-up
        decoders = {"stacked": Decoder(stacked, prompt, n), "split": Decoder(split, prompt, n)}
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(n - 1):
            # Step i of both back to back, in alternating order: both see the same load.
            for name in names if i % 2 == 0 else reversed(names):
                times[name].append(decoders[name].step())
        tokens = {name: d.tokens for name, d in decoders.items()}
        if r == 0:
            continue
        for name in names:
            steps[name] += times[name]
            runs[name].append(sum(times[name]))
        ratios += [b / a for a, b in zip(times["stacked"], times["split"], strict=True)]

    ids = torch.tensor(prompt + tokens["stacked"][:-1])
    with torch.inference_mode():
        whole = [m(ids, torch.arange(len(ids)), m.new_cache(len(ids))) for m in (stacked, split)]
    diff = (whole[0] - whole[1]).abs().max().item()
    print(
        f"model {args.model}  dtype {args.dtype}  {n - 1} decode steps per run  "
        f"threads {args.threads}  {args.repeats} runs, the two layouts' steps alternating"
    )
    print(f"{'layout':<9}{'best run tok/s':>15}{'median step ms':>16}{'median tok/s':>14}")
    median = {name: statistics.median(times) for name, times in steps.items()}
    for name in names:
        best = (n - 1) / min(runs[name])
        print(f"{name:<9}{best:>15.1f}{1000 * median[name]:>16.3f}{1 / median[name]:>14.1f}")
    print(
        f"stacked / split tokens/s: median of paired steps {statistics.median(ratios):.3f}, "
        f"best run {min(runs['split']) / min(runs['stacked']):.3f}   identical greedy tokens: "
        f"{tokens['stacked'] == tokens['split']}   max |logit diff| (prefill of "
        f"{len(ids)} tokens): {diff:.2e}"
    )


if __name__ == "__main__":
    main()
