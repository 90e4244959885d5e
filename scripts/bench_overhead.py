"""Per-step overhead: compiled passes against eager ones, side by side in one run.

Sections (all by default; `--sections decode,draft,profile`):

- decode: tokens/s of greedy generation on the shared pair, compilation off against on
  (alternating repeats, best of each), for autoregressive, linear and tree speculation;
  the outputs must be identical.
- draft: one draft step per tree depth (1, 8, 32 nodes over a ~100-token cache), eager
  against compiled, median microseconds.
- profile: host time per decode step from torch.profiler, eager against compiled, with
  the profiler's top table for each.
- shaped: a random draft in a real model's shape (`--shaped llama-3.2-1b`: 16 layers,
  vocabulary 128,256), one draft step at 1-64 nodes over a 512-token cache, eager against
  compiled (CUDA graphs on a GPU). Runs by default only where CUDA is; on a CPU ask for it
  (`--sections shaped --hidden-scale 0.05`), scaled down.

Ratios, not absolute times, are the result: the machine is shared.

    .venv/bin/python scripts/bench_overhead.py [--json bench-results/overhead.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speculative.checkpoint import load  # noqa: E402
from speculative.compiled import CompiledPasses  # noqa: E402
from speculative.drafting import ModelDrafter  # noqa: E402
from speculative.generation import Generation, Strategy  # noqa: E402
from speculative.model import Transformer  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.autoregressive import Autoregressive  # noqa: E402
from speculative.strategies.linear import Linear  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402
from speculative.tokenizer import Tokenizer  # noqa: E402

MODELS = ROOT.parent / "shared" / "models"
PROMPT = "Once upon a time"


class Pair:
    """The shared target and draft, each with its compiled passes warmed; `compiled(on)`
    switches both."""

    def __init__(self, target_dir: Path, draft_dir: Path) -> None:
        self.target, self.tokenizer = load(str(target_dir))[:2]
        self.draft = load(str(draft_dir))[0]
        self.passes: dict[int, CompiledPasses] = {}
        self.warm_seconds = 0.0
        for model in (self.target, self.draft):
            passes = CompiledPasses(model)
            self.warm_seconds += passes.warm(lambda line: print(f"  {line}", flush=True))
            self.passes[id(model)] = passes

    def compiled(self, on: bool) -> None:
        for model in (self.target, self.draft):
            model.compiled = self.passes[id(model)] if on else None


def _generate(strategy: Strategy, tokenizer: Tokenizer, n: int) -> tuple[float, list[int]]:
    prompt = tokenizer.encode(PROMPT)
    session = strategy.new_session(len(prompt) + n + 64)
    gen = Generation(
        strategy, session, tokenizer, prompt, SamplingParams(temperature=0.0), n, ignore_eos=True
    )
    t0 = time.perf_counter()
    gen.run()
    return time.perf_counter() - t0, gen.token_ids


def decode_section(pair: Pair, tokens: int, repeats: int) -> list[dict[str, Any]]:
    strategies: dict[str, Callable[[], Strategy]] = {
        "autoregressive": lambda: Autoregressive(pair.target),
        "linear (k=4)": lambda: Linear(pair.target, ModelDrafter(pair.draft), 4),
        "tree (budget 8)": lambda: TreeSpeculation(pair.target, pair.draft, budget=8),
    }
    rows = []
    for name, build in strategies.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, list[int]] = {}
        for i in range(repeats + 1):  # the first round of each is a warm-up
            for on in (False, True) if i % 2 == 0 else (True, False):
                pair.compiled(on)
                seconds, ids = _generate(build(), pair.tokenizer, tokens)
                outputs[on] = ids
                if i:
                    times[on].append(seconds)
        pair.compiled(False)
        eager, compiled = min(times[False]), min(times[True])
        rows.append(
            {
                "strategy": name,
                "eager_tokens_per_s": tokens / eager,
                "compiled_tokens_per_s": tokens / compiled,
                "ratio": eager / compiled,
                "identical_output": outputs[False] == outputs[True],
            }
        )
    return rows


def _step_seconds(
    model: Transformer,
    nodes: int,
    context: int,
    repeats: int,
    sync: Callable[[], None] = lambda: None,
) -> float:
    """Median seconds of one draft step of `nodes` tree nodes over a `context`-token cache
    (the step is rolled back after each run, so every run sees the same cache)."""
    device = model.device
    cache = model.new_cache(context + nodes)
    model.forward(torch.arange(context) % 100 + 3, torch.arange(context), cache)
    mask = torch.ones(nodes, context + nodes, dtype=torch.bool, device=device)
    mask[:, context:] = torch.eye(nodes, dtype=torch.bool)  # siblings: each sees itself
    tokens = torch.arange(nodes, device=device) + 7
    positions = torch.full((nodes,), context, device=device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.forward(tokens, positions, cache, mask=mask)
        sync()
        samples.append(time.perf_counter() - t0)
        cache.truncate(context)
    return statistics.median(samples[1:])


def draft_section(pair: Pair, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for nodes in (1, 8, 32):
        pair.compiled(False)
        eager = _step_seconds(pair.draft, nodes, 100, repeats)
        pair.compiled(True)
        compiled = _step_seconds(pair.draft, nodes, 100, repeats)
        pair.compiled(False)
        rows.append(
            {
                "nodes": nodes,
                "eager_us": 1e6 * eager,
                "compiled_us": 1e6 * compiled,
                "ratio": eager / compiled,
            }
        )
    return rows


def shaped_section(
    preset: str, hidden_scale: float, device: str, dtype: torch.dtype, repeats: int
) -> list[dict[str, Any]]:
    """Draft steps of a random real-shaped model at 1-64 nodes, eager against compiled."""
    from scripts.real_shapes import PRESETS, build_model, model_config

    config = model_config(preset, layers=PRESETS[preset].num_layers, hidden_scale=hidden_scale)
    model = build_model(config, dtype, device)
    passes = CompiledPasses(model)
    passes.warm(lambda line: print(f"  {line}", flush=True))
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    rows = []
    for nodes in (1, 2, 4, 8, 16, 32, 64):
        seconds = {}
        for on in (False, True):
            model.compiled = passes if on else None
            sync()
            seconds[on] = _step_seconds(model, nodes, 512, repeats, sync)
        model.compiled = None
        rows.append(
            {
                "nodes": nodes,
                "eager_us": 1e6 * seconds[False],
                "compiled_us": 1e6 * seconds[True],
                "ratio": seconds[False] / seconds[True],
            }
        )
    return rows


def profile_section(pair: Pair, steps: int) -> dict[str, Any]:
    """Host (CPU) time per decode step of the target as torch.profiler sees it."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for on in (False, True):
        pair.compiled(on)
        _generate(Autoregressive(pair.target), pair.tokenizer, 8)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _generate(Autoregressive(pair.target), pair.tokenizer, steps)
        events = prof.key_averages()
        total_us = sum(e.self_cpu_time_total for e in events)
        label = "compiled" if on else "eager"
        out[label] = {
            "host_us_per_step": total_us / steps,
            "ops_per_step": sum(e.count for e in events) / steps,
            "table": events.table(sort_by="self_cpu_time_total", row_limit=8),
        }
    pair.compiled(False)
    out["ratio"] = out["eager"]["host_us_per_step"] / out["compiled"]["host_us_per_step"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--target", type=Path, default=MODELS / "stories260k")
    ap.add_argument("--draft", type=Path, default=MODELS / "stories260k-draft")
    ap.add_argument(
        "--sections",
        default=None,
        help="comma-separated: decode,draft,profile,shaped (default: all; shaped only on CUDA)",
    )
    ap.add_argument("--shaped", default="llama-3.2-1b", help="real_shapes preset of the draft")
    ap.add_argument("--hidden-scale", type=float, default=1.0, help="shaped: width scale")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    default = "decode,draft,profile" + (",shaped" if cuda else "")
    sections = set((args.sections or default).split(","))
    torch.set_num_threads(args.threads)

    result: dict[str, Any] = {"torch": torch.__version__, "threads": args.threads}
    if sections & {"decode", "draft", "profile"}:
        print("warming the compiled passes (loaded from the disk cache after the first run)")
        pair = Pair(args.target, args.draft)
        result["warm_seconds"] = pair.warm_seconds
        print(f"  warm-up took {pair.warm_seconds:.1f} s")
    if "decode" in sections:
        rows = decode_section(pair, args.tokens, args.repeats)
        result["decode"] = rows
        print(f"\ndecode, {args.tokens} greedy tokens, best of {args.repeats}")
        print(f"{'strategy':<18}{'eager tok/s':>13}{'compiled tok/s':>16}{'ratio':>8}  same")
        for r in rows:
            print(
                f"{r['strategy']:<18}{r['eager_tokens_per_s']:>13.0f}"
                f"{r['compiled_tokens_per_s']:>16.0f}{r['ratio']:>7.2f}x  {r['identical_output']}"
            )
    if "draft" in sections:
        rows = draft_section(pair, max(args.repeats * 20, 21))
        result["draft"] = rows
        print("\ndraft step (one tree depth) over a 100-token cache, median")
        print(f"{'nodes':>6}{'eager µs':>11}{'compiled µs':>13}{'ratio':>8}")
        for r in rows:
            print(
                f"{r['nodes']:>6}{r['eager_us']:>11.0f}{r['compiled_us']:>13.0f}{r['ratio']:>7.2f}x"
            )
    if "profile" in sections:
        prof = profile_section(pair, 50)
        result["profile"] = prof
        for label in ("eager", "compiled"):
            p = prof[label]
            print(
                f"\nprofile, {label}: {p['host_us_per_step']:.0f} µs host time and "
                f"{p['ops_per_step']:.0f} profiled ops per decode step"
            )
            print(p["table"])
        print(f"host time per step, eager / compiled: {prof['ratio']:.2f}x")
    if "shaped" in sections:
        device = "cuda" if cuda else "cpu"
        dtype = torch.bfloat16 if cuda else torch.float32
        print(f"\n{args.shaped}-shaped draft (width x{args.hidden_scale}), {device}")
        rows = shaped_section(args.shaped, args.hidden_scale, device, dtype, 50)
        result["shaped"] = {"preset": args.shaped, "hidden_scale": args.hidden_scale,
                            "device": device, "rows": rows}  # fmt: skip
        print(f"{'nodes':>6}{'eager µs':>11}{'compiled µs':>13}{'ratio':>8}")
        for r in rows:
            print(
                f"{r['nodes']:>6}{r['eager_us']:>11.0f}{r['compiled_us']:>13.0f}{r['ratio']:>7.2f}x"
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
