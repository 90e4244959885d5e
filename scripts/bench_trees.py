"""Trees against chains: tokens per target pass of tree speculation at budget B next to
linear chains of K = 4, 16 and B drafted tokens, with the same draft, on the shared pair.

A chain of K tokens is a tree of K nodes, so at the same budget a tree should never give
fewer tokens per target pass than the best chain (DESIGN.md, "Trees that never lose to a
chain"). For each draft (the trained stories260k-draft, the target itself quantized to
int8 and to int4 on load, n-gram prompt lookup), each temperature and each budget B, every
strategy generates the same prompts from fresh sessions; the tree strategy is built once
per (draft, temperature) and keeps what it learns across budgets and prompts, as the
daemon keeps it across requests. Reported per cell: tree tokens per target pass, each
chain's, the ratio to the best chain, the draft passes the tree spent per target pass (a
deep tree costs one draft pass per level), and how its rounds were verified.

Tokens per pass, not seconds: on this pair every model is tiny and the ratio that matters
for a streamed target (whose pass costs a full weight transfer) is tokens per pass.

    .venv/bin/python scripts/bench_trees.py                          # docs/measurements.md's table
    .venv/bin/python scripts/bench_trees.py --drafts int8 --temperatures 1 --budgets 64
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
from scripts.bench_speculative import PROMPTS  # noqa: E402
from speculative.acceptance import AcceptanceModel  # noqa: E402
from speculative.drafting import ModelDrafter  # noqa: E402
from speculative.ngram import NgramDrafter  # noqa: E402
from speculative.passes import alone  # noqa: E402
from speculative.prefix_cache import PrefixCache  # noqa: E402
from speculative.rounds import Strategy  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.linear import Linear  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"
DRAFTS = ("trained", "int8", "int4", "ngram")
CHAINS = (4, 16)


def load_draft(name: str, target_dir: Path, draft_dir: Path) -> Transformer | None:
    if name == "ngram":
        return None
    if name == "trained":
        return load(draft_dir)[0]
    return load(target_dir, quantize=name)[0]  # the target itself, quantized on load


def run(
    strategy: Strategy,
    prompts: list[list[int]],
    params: SamplingParams,
    tokens: int,
    capacity: int,
    seeds: int = 1,
) -> dict[str, Any]:
    """Generate `tokens` after each prompt `seeds` times, each in a fresh session with its
    own generator (the request carries no seed: `auto` may verify by rejection); sums of
    what the rounds report."""
    out = {"tokens": 0, "passes": 0, "draft_passes": 0, "rounds": 0, "seconds": 0.0}
    kinds: dict[str, int] = {}
    runs = [ids for _ in range(seeds) for ids in prompts]
    for i, ids in enumerate(runs):
        session = strategy.new_session(capacity)
        generator = torch.Generator().manual_seed(i)
        t0 = time.perf_counter()
        for rnd in alone(strategy.steps(session, ids, params, tokens, generator)):
            st = rnd.stats
            out["tokens"] += len(rnd.tokens)
            out["passes"] += st.target_passes - st.prefill_passes
            out["draft_passes"] += st.draft_passes
            out["rounds"] += int(bool(rnd.tokens))
            if st.tree_verification is not None:
                kinds[st.tree_verification] = kinds.get(st.tree_verification, 0) + 1
        out["seconds"] += time.perf_counter() - t0
    out["tokens_per_pass"] = out["tokens"] / max(out["passes"], 1)
    out["draft_passes_per_pass"] = out["draft_passes"] / max(out["passes"], 1)
    out["verification"] = kinds
    return out


def chain(target: Transformer, draft: Transformer | None, k: int) -> Linear:
    drafter = ModelDrafter(draft) if draft is not None else NgramDrafter(target.config.vocab_size)
    return Linear(target, drafter, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--target", type=Path, default=SHARED / "stories260k")
    ap.add_argument("--draft", type=Path, default=SHARED / "stories260k-draft")
    ap.add_argument("--drafts", default=",".join(DRAFTS))
    ap.add_argument("--temperatures", default="0,0.7,1")
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=240)
    ap.add_argument("--seeds", type=int, default=2, help="samples per prompt (T > 0)")
    ap.add_argument("--verification", default="auto", choices=("auto", "walk", "rejection"))
    ap.add_argument("--json", type=Path, default=ROOT / "bench-results" / "trees.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    target, tok, _ = load(args.target)
    capacity = target.config.max_position_embeddings
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    budgets = [int(b) for b in args.budgets.split(",")]
    rows: list[dict[str, Any]] = []
    print(
        f"{args.prompts} prompts x {args.tokens} tokens ({args.seeds} samples each at T > 0), "
        f"context {capacity} (budgets and chains past the room left are cut to it)\n"
        "| draft | T | B | tree tok/pass | K=4 | K=16 | K=B | tree / best chain "
        "| tree draft passes / pass | verification (rounds) |\n|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for name in args.drafts.split(","):
        draft = load_draft(name, args.target, args.draft)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            params = SamplingParams(temperature=temperature)
            seeds = 1 if params.greedy else args.seeds  # greedy text is one text
            chains: dict[int, dict[str, Any]] = {}
            acceptance = AcceptanceModel()  # learned across this draft's budgets, as a daemon
            for budget in budgets:
                for k in (*CHAINS, budget):
                    if k not in chains:
                        chains[k] = run(
                            chain(target, draft, k), prompts, params, args.tokens, capacity, seeds
                        )
                tree = TreeSpeculation(
                    target, draft, budget=budget, prefix_cache=PrefixCache(0),
                    verification=args.verification, acceptance=acceptance,
                )  # fmt: skip
                got = run(tree, prompts, params, args.tokens, capacity, seeds)
                best = max(chains[k]["tokens_per_pass"] for k in (*CHAINS, budget))
                row = {
                    "draft": name,
                    "temperature": temperature,
                    "budget": budget,
                    "tree": got,
                    "chains": {str(k): chains[k] for k in (*CHAINS, budget)},
                    "tree_over_best_chain": got["tokens_per_pass"] / best,
                }
                rows.append(row)
                kinds = ", ".join(f"{k} {v}" for k, v in sorted(got["verification"].items()))
                print(
                    f"| {name} | {temperature:g} | {budget} | {got['tokens_per_pass']:.2f} "
                    f"| {chains[4]['tokens_per_pass']:.2f} | {chains[16]['tokens_per_pass']:.2f} "
                    f"| {chains[budget]['tokens_per_pass']:.2f} | {row['tree_over_best_chain']:.2f} "
                    f"| {got['draft_passes_per_pass']:.1f} | {kinds or '-'} |",
                    flush=True,
                )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"target": str(args.target),
                                                          "draft": str(args.draft),
                                                          "json": str(args.json)},
                                     "rows": rows}, indent=1))  # fmt: skip
    worst = min(rows, key=lambda r: r["tree_over_best_chain"])
    print(
        f"\nworst cell: {worst['draft']} T={worst['temperature']:g} B={worst['budget']}: "
        f"tree {worst['tree_over_best_chain']:.2f}x the best chain"
    )


if __name__ == "__main__":
    main()
