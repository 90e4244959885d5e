"""The substitute draft against the trained draft on the shared pair, and what that would
make of streamed targets.

On the stories260k pair: tokens per target pass and acceptance of tree speculation with
the target's own HQQ layers at 8, 4, 3 and 2 bits (every layer quantized, as for a target
that streams them all) next to the trained stories260k-draft, at budgets 16..1024 and
T = 0 and 1; the draft passes a round spends; one draft step's time here (these are tiny
models on a CPU: a step is per-call overhead, so this only ranks them).

Then a projection for real streamed targets (a model, not a run): a target pass costs the
plan's transfer-bound time (its streamed bytes over the bus), a substitute step reads its
packed layers once at the card's memory bandwidth, and a round yields what the shared pair
measured at that budget and bits:

    tokens/s = tokens per pass / (pass seconds + draft passes per pass x step seconds)

for an 8B on a 12 GB card and a 32B and a 70B on 24 GB (the plan's own choice of bits
for each is printed too, with --substitute-bits auto's rule).

    .venv/bin/python scripts/bench_substitute.py                      # docs/substitute-draft.md's table
    .venv/bin/python scripts/bench_substitute.py --budgets 64 --temperatures 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.checkpoints.checkpoint import load  # noqa: E402
from modeling.decoder import Transformer  # noqa: E402
from modeling.substitute import SUBSTITUTE_BITS, build_substitute  # noqa: E402
from scripts.bench_speculative import PROMPTS  # noqa: E402
from scripts.bench_trees import run  # noqa: E402
from speculative.acceptance import AcceptanceModel  # noqa: E402
from speculative.prefix_cache import PrefixCache  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"
# Streamed targets and the cards they stream on (bytes of device memory, and its bandwidth
# in bytes/s: an RTX 4070-class and an RTX 4090-class card), over a PCIe 4.0 x16 bus.
CARDS = (
    ("llama-3.1-8b", 12e9, 504e9),
    ("qwen2.5-32b", 24e9, 1008e9),
    ("llama-3.1-70b", 24e9, 1008e9),
)
BUS = 25e9


def step_seconds(model: Transformer, repeats: int = 50) -> float:
    """Median seconds of one single-token draft step on a 64-token prefix."""
    cache = model.new_cache(128)
    model(torch.arange(3, 67), torch.arange(64), cache)
    times = []
    for i in range(repeats):
        cache.truncate(64)
        t0 = time.perf_counter()
        model(torch.tensor([5 + i % 7]), torch.tensor([64]), cache)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def projections(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The streamed targets' projected tokens/s from the measured rows (module docstring)."""
    from daemon.footprint import footprint
    from daemon.memory_plan import OffloadOptions, plan_request
    from daemon.pair_plan import plan_with_draft
    from modeling.substitute import substitute_config
    from offload.plan import MemoryBudget
    from offload.planning import PlanError, make_plan
    from scripts.real_shapes import full_config

    out = []
    for preset, card, memory_bandwidth in CARDS:
        config = full_config(preset)
        budget = MemoryBudget("cuda", int(card), "card", int(160e9), "160 GB", BUS, "PCIe 4.0 x16")
        try:
            _, chosen = plan_with_draft(
                config, "substitute", None, "auto", preset, "bf16", 8192, "cuda",
                OffloadOptions(offload="stream"), budget,
            )  # fmt: skip
            auto_bits: int | None = chosen.substitute_bits
        except PlanError:
            auto_bits = None
        target = footprint(config, torch.bfloat16, preset)
        for row in rows:
            if row["draft"] == "trained":
                continue
            bits = int(row["draft"].removesuffix("-bit"))
            sub = footprint(substitute_config(config, bits), torch.bfloat16, "substitute")
            request = plan_request(target, None, 8192, OffloadOptions(offload="stream"))
            # The pass streams what the device does not hold beside the substitute.
            room = MemoryBudget("cuda", int(card) - sub.num_layers * sub.layer_bytes, "card",
                          int(160e9), "160 GB", BUS, "")  # fmt: skip
            try:
                plan = make_plan(request, room)
            except PlanError:
                continue  # the substitute at these bits leaves no room for the target
            step = sub.num_layers * sub.layer_bytes / memory_bandwidth
            tree = row["tree"]
            seconds = (plan.seconds_per_pass or 0.0) + tree["draft_passes_per_pass"] * step
            out.append({
                "target": preset, "card_gb": card / 1e9, "bits": bits, "auto_bits": auto_bits,
                "budget": row["budget"], "temperature": row["temperature"],
                "pass_s": plan.seconds_per_pass, "step_s": step,
                "tokens_per_pass": tree["tokens_per_pass"],
                "projected_tokens_per_s": tree["tokens_per_pass"] / seconds,
                "autoregressive_tokens_per_s": 1.0 / (plan.seconds_per_pass or 1.0),
            })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--target", type=Path, default=SHARED / "stories260k")
    ap.add_argument("--draft", type=Path, default=SHARED / "stories260k-draft")
    ap.add_argument("--bits", default=",".join(str(b) for b in SUBSTITUTE_BITS))
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=240)
    ap.add_argument("--seeds", type=int, default=2, help="samples per prompt (T > 0)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench-results" / "substitute.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    target, tok, _ = load(args.target)
    capacity = target.config.max_position_embeddings
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    layers = list(target.layers)  # type: ignore[arg-type]
    drafts: dict[str, Transformer] = {"trained": load(args.draft)[0]}
    for bits in (int(b) for b in args.bits.split(",")):
        drafts[f"{bits}-bit"] = build_substitute(
            target, bits, layers, lambda i: True, torch.device("cpu")
        )
    steps = {name: step_seconds(model) for name, model in drafts.items()}
    target_step = step_seconds(target)
    print(f"{args.prompts} prompts x {args.tokens} tokens ({args.seeds} samples each at T > 0)")
    print("one draft step (CPU, tiny models: per-call overhead): " + ", ".join(
        f"{n} {s * 1e3:.2f} ms" for n, s in steps.items()) + f"; the target {target_step * 1e3:.2f} ms")  # fmt: skip
    print("| draft | T | B | tokens/pass | acceptance | draft passes/pass | verification |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, draft in drafts.items():
        for temperature in (float(t) for t in args.temperatures.split(",")):
            params = SamplingParams(temperature=temperature)
            seeds = 1 if params.greedy else args.seeds
            acceptance = AcceptanceModel()
            for budget in (int(b) for b in args.budgets.split(",")):
                tree = TreeSpeculation(
                    target, draft, budget=budget, prefix_cache=PrefixCache(0),
                    acceptance=acceptance, shared_cache=name != "trained",
                )  # fmt: skip
                got = run(tree, prompts, params, args.tokens, capacity, seeds)
                accepted = (got["tokens"] - got["rounds"]) / max(got["rounds"], 1)
                row = {"draft": name, "temperature": temperature, "budget": budget,
                       "tree": got, "accepted_per_round": accepted}  # fmt: skip
                rows.append(row)
                kinds = ", ".join(f"{k} {v}" for k, v in sorted(got["verification"].items()))
                print(
                    f"| {name} | {temperature:g} | {budget} | {got['tokens_per_pass']:.2f} "
                    f"| {accepted:.2f} | {got['draft_passes_per_pass']:.1f} | {kinds} |",
                    flush=True,
                )
    projected = projections(rows)
    print("\nprojected for streamed targets (bf16, 8k context, PCIe 4.0 x16 at 25 GB/s):")
    print(
        "| target | card | bits (auto) | T | B | pass s | draft step ms | tok/s | vs autoregressive |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for p in projected:
        if p["budget"] != 64:
            continue
        print(
            f"| {p['target']} | {p['card_gb']:.0f} GB | {p['bits']} ({p['auto_bits']}) "
            f"| {p['temperature']:g} | {p['budget']} | {p['pass_s']:.2f} "
            f"| {p['step_s'] * 1e3:.1f} | {p['projected_tokens_per_s']:.2f} "
            f"| {p['projected_tokens_per_s'] / p['autoregressive_tokens_per_s']:.1f}x |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) for k, v in vars(args).items()}
    args.json.write_text(json.dumps({"args": meta, "steps": steps, "target_step": target_step,
                                     "rows": rows, "projected": projected}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
