"""`specd bench`: a quick side-by-side of the decoding strategies on the configured model
pair, in-process, greedy, with tokens/s relative to autoregressive decoding.

Every strategy must produce the same greedy tokens (lossless); the table says so."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from daemon.runtime import STRATEGY_BUILDERS, Runtime
from daemon.serve_cmd import add_settings_args, settings_from_args
from speculative.generation import Generation
from speculative.sampling import SamplingParams


def run_strategy(runtime: Runtime, name: str, prompt_ids: list[int], max_tokens: int) -> dict:
    strategy = runtime.strategy(name)
    session = runtime.new_session(strategy)
    gen = Generation(
        strategy,
        session,
        runtime.tokenizer,
        prompt_ids,
        SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    gen.run()
    return {"strategy": name, "token_ids": gen.token_ids, **gen.stats.to_dict()}


def prefix_cache_hit_rate(stats: dict) -> float | None:
    """Hits over look-ups of the tree's prefix cache, or None when it was not consulted."""
    looked = stats.get("prefix_cache_hits", 0) + stats.get("prefix_cache_misses", 0)
    return stats["prefix_cache_hits"] / looked if looked else None


def cmd_bench(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    runtime = Runtime(settings.runtime_options())
    names = args.strategies or [
        n for n in STRATEGY_BUILDERS if n == "autoregressive" or runtime.draft_kind is not None
    ]
    prompt_ids = runtime.tokenizer.encode(args.prompt)
    run_strategy(runtime, "autoregressive", prompt_ids, 8)  # warm-up: first-call overheads
    rows = [run_strategy(runtime, n, prompt_ids, args.max_tokens) for n in names]
    base = next((r for r in rows if r["strategy"] == "autoregressive"), None)
    print(
        f"{'strategy':<16}{'tokens/s':>10}{'vs AR':>8}{'tok/pass':>10}{'accept':>8}"
        f"{'prefix hits':>13}  same"
    )
    for r in rows:
        tps = r["tokens_per_second"] or 0.0
        ratio = tps / base["tokens_per_second"] if base and base["tokens_per_second"] else None
        same = "yes" if base is None or r["token_ids"] == base["token_ids"] else "NO"
        accept = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        hit_rate = prefix_cache_hit_rate(r)
        hits = "-" if hit_rate is None else f"{hit_rate:.0%}"
        print(
            f"{r['strategy']:<16}{tps:>10.1f}{'-' if ratio is None else f'{ratio:.2f}':>8}"
            f"{r['tokens_per_target_pass']:>10.2f}{accept:>8}{hits:>13}  {same}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["token_ids"] == rows[0]["token_ids"] for r in rows) else 1


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="compare strategies on the configured model pair")
    add_settings_args(bench)
    bench.add_argument("--prompt", default="Once upon a time")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--strategies", nargs="+", default=None, help="default: all that apply")
    bench.add_argument("--json", type=Path, default=None, help="also write the rows here")
    bench.set_defaults(func=cmd_bench)
