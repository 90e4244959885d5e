"""Step timings of the draft, the `shaped` and `budget` sections of scripts/bench_overhead.py
(see its docstring): one draft step at a tree depth's width, eager against compiled and, on
CUDA, against CUDA graphs; and what those times do to the auto tree budget's choice for a
streamed target."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from modeling.compiled import CompiledPasses, rebuilds_in_graph
from modeling.decoder import Transformer
from modeling.graphs import bucket_for
from speculative.budget import TreeShape, choose_shape
from speculative.pass_costs import CostLine


def step_seconds(
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


def print_steps(rows: list[dict[str, Any]]) -> None:
    columns = [key for key in rows[0] if key.endswith("_us")]
    names = [key[: -len("_us")].replace("_", "+") + " µs" for key in columns]
    print(f"{'nodes':>6}" + "".join(f"{n:>{max(len(n) + 2, 11)}}" for n in names) + f"{'ratio':>8}")
    for r in rows:
        cells = "".join(
            f"{r[key]:>{max(len(n) + 2, 11)}.0f}" for key, n in zip(columns, names, strict=True)
        )
        print(f"{r['nodes']:>6}{cells}{r['ratio']:>7.2f}x")


def _shaped_variants(model: Transformer) -> dict[str, CompiledPasses | None]:
    """The ways a step can run: eager and compiled; on CUDA also captured as CUDA graphs,
    eager and compiled ("compiled+graphed" is what `--compile on` runs there)."""
    variants: dict[str, CompiledPasses | None] = {"eager": None}
    if model.device.type != "cuda":
        variants["compiled"] = CompiledPasses(model)
        return variants
    variants["compiled"] = CompiledPasses(model, graphs=False)
    if not rebuilds_in_graph(model):  # (an eager step's rebuilds are not captured alone)
        variants["graphed"] = CompiledPasses(model, compile=False)
    variants["compiled+graphed"] = CompiledPasses(model)
    return variants


def _shaped_rows(
    preset: str,
    hidden_scale: float,
    device: str,
    dtype: torch.dtype,
    repeats: int,
    bits: int | None = None,
    layers: int | None = None,
) -> list[dict[str, Any]]:
    """Draft steps of a random real-shaped model at 1-64 nodes, eager against compiled (and
    on CUDA against CUDA graphs). `ratio`: eager over what `--compile on` runs. `bits`: the
    model's `bits` HQQ substitute instead (every layer a copy: issue 36's substitute step,
    its projections rebuilt per step eager and inside the graph compiled); `layers`: fewer
    than the preset's."""
    from modeling.substitute import build_substitute
    from scripts.real_shapes import PRESETS, build_model, model_config

    count = layers or PRESETS[preset].num_layers
    config = model_config(preset, layers=count, hidden_scale=hidden_scale)
    model = build_model(config, dtype, device)
    if bits is not None:
        every = list(model.layers)
        model = build_substitute(model, bits, every, lambda i: True, torch.device(device))
    variants = _shaped_variants(model)
    for name, passes in variants.items():
        if passes is not None:
            print(f"  warming {name}", flush=True)
            passes.warm(lambda line: print(f"    {line}", flush=True))
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    default = list(variants)[-1]
    rows = []
    for nodes in (1, 2, 4, 8, 16, 32, 64):
        row: dict[str, Any] = {"nodes": nodes}
        for name, passes in variants.items():
            model.compiled = passes
            sync()
            row[f"{name.replace('+', '_')}_us"] = 1e6 * step_seconds(
                model, nodes, 512, repeats, sync
            )
        model.compiled = None
        row["ratio"] = row["eager_us"] / row[f"{default.replace('+', '_')}_us"]
        rows.append(row)
    for name, passes in variants.items():
        graphs = passes.graphs if passes is not None else None
        if graphs is not None:
            print(
                f"  {name}: {graphs.captures} CUDA graphs captured in "
                f"{graphs.capture_seconds:.2f} s, {graphs.replays} replays"
            )
    return rows


_SHAPED: dict[tuple[str, float], dict[str, Any]] = {}


def shaped(args: argparse.Namespace) -> dict[str, Any]:
    key = (args.shaped, args.hidden_scale, args.shaped_bits, args.shaped_layers)
    if key in _SHAPED:  # measured already in this run (the budget section reads it)
        return _SHAPED[key]
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    what = "draft" if args.shaped_bits is None else f"{args.shaped_bits}-bit substitute"
    layers = "" if args.shaped_layers is None else f", {args.shaped_layers} layers"
    print(f"\n{args.shaped}-shaped {what} (width x{args.hidden_scale}{layers}), {device}")
    rows = _shaped_rows(args.shaped, args.hidden_scale, device, dtype, args.shaped_repeats,
                        args.shaped_bits, args.shaped_layers)  # fmt: skip
    print_steps(rows)
    _SHAPED[key] = {"preset": args.shaped, "hidden_scale": args.hidden_scale, "device": device,
                    "bits": args.shaped_bits, "layers": args.shaped_layers,
                    "rows": rows}  # fmt: skip
    return _SHAPED[key]


# Tokens per tree round of the real stories260k pair (greedy), as the tree builder of
# 2026-11-21 gave them at its shapes (it then capped a budget's depth; today's default
# depth is the budget, and calibrated growth decides): an acceptance curve the budget
# section's arithmetic assumes (tests/test_budget.py uses it too), not re-measured here.
# `scripts/bench_trees.py --drafts trained --temperatures 0` measures today's trees.
STORIES_TOKENS_PER_ROUND = {
    TreeShape(1, 1): 1.6,
    TreeShape(2, 2): 2.2,
    TreeShape(4, 4): 2.8,
    TreeShape(8, 5): 3.4,
    TreeShape(16, 6): 4.1,
    TreeShape(32, 7): 4.8,
    TreeShape(64, 8): 5.3,
    TreeShape(128, 9): 6.1,
}


def _budget_rows(shaped_rows: list[dict[str, Any]], bandwidth: float) -> list[dict[str, Any]]:
    """The tree shape the auto budget would choose for a streamed 8B and 70B target on a
    24 GB card, given the draft's measured step times (eager, and what `--compile on` runs)
    and a target pass at the transfer bound of the plan's streamed bytes. A prediction from
    measured costs (the acceptance is the stories pair's), not a run of the strategy."""
    from daemon.footprint import footprint
    from daemon.memory_plan import OffloadOptions, plan_request
    from offload.plan import MemoryBudget
    from offload.planning import make_plan
    from scripts.real_shapes import PAIRS, full_config

    variants = [key[: -len("_us")] for key in shaped_rows[0] if key.endswith("_us")]
    steps = {r["nodes"]: r for r in shaped_rows}
    rows = []
    # An 8B streams on a 12 GB card (on 24 GB it is resident), a 70B on a 24 GB one.
    for preset, card in (("llama-3.1-8b", 12e9), ("llama-3.1-70b", 24e9)):
        target = footprint(full_config(preset), torch.bfloat16, preset)
        draft = footprint(full_config(PAIRS[preset]), torch.bfloat16, PAIRS[preset])
        request = plan_request(target, draft, 8192, OffloadOptions(offload="stream"))
        budget = MemoryBudget("cuda", int(card), "card", int(160e9), "160 GB", bandwidth, "")
        plan = make_plan(request, budget)
        assert plan.seconds_per_pass, f"a {preset} on a {card / 1e9:.0f} GB card streams"
        target_line = CostLine()
        for n in (1, 257):  # a streamed pass costs its transfer, whatever it carries
            target_line.observe(n, plan.seconds_per_pass)
        for variant in (variants[0], variants[-1]):

            def draft_seconds(shape: TreeShape, variant: str = variant) -> float:
                width = bucket_for(-(-shape.budget // max(shape.depth, 1))) or 64
                return shape.draft_passes * steps[width][f"{variant}_us"] / 1e6

            shape = choose_shape(STORIES_TOKENS_PER_ROUND, target_line, draft_seconds)
            seconds = target_line.predict(1 + shape.budget) + draft_seconds(shape)
            tokens = STORIES_TOKENS_PER_ROUND.get(shape, 1.0)
            rows.append(
                {
                    "target": preset,
                    "card_gb": card / 1e9,
                    "draft_steps": variant.replace("_", "+"),
                    "target_pass_s": plan.seconds_per_pass,
                    "budget": shape.budget,
                    "depth": shape.depth,
                    "draft_s_per_round": draft_seconds(shape),
                    "predicted_tokens_per_s": tokens / seconds,
                }
            )
    return rows


def budget(args: argparse.Namespace) -> list[dict[str, Any]]:
    from offload.machine import measure_bandwidth

    report = shaped(args)
    bandwidth, how = measure_bandwidth(report["device"])
    print(f"\nauto tree budget for a streamed target, {bandwidth / 1e9:.1f} GB/s ({how})")
    rows = _budget_rows(report["rows"], bandwidth)
    print(
        f"{'target':<15}{'card':>6}  {'draft steps':<18}{'pass s':>8}{'tree':>10}"
        f"{'draft s':>9}{'tok/s':>8}"
    )
    for r in rows:
        print(
            f"{r['target']:<15}{r['card_gb']:>4.0f}GB  {r['draft_steps']:<18}"
            f"{r['target_pass_s']:>8.3f}"
            f"{r['budget']:>6}/{r['depth']:<3}{r['draft_s_per_round']:>9.4f}"
            f"{r['predicted_tokens_per_s']:>8.2f}"
        )
    return rows
