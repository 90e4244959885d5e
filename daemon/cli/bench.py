"""`specd bench`: a quick side-by-side of the decoding strategies on the configured model
pair, in-process, greedy, with tokens/s relative to autoregressive decoding.

Every strategy must produce the same greedy tokens (lossless); the table says so.

`--concurrency N` (N > 1) also runs each strategy as N generations at once through the
daemon's engine (batched passes: one target pass per step serves every generation) and
reports aggregate tokens/s and generated tokens per target pass beside the single-stream
table; each of the N must produce the single stream's tokens."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

from daemon.admission import Ask, admit
from daemon.cli.argtypes import count
from daemon.cli.serve import add_settings_args, settings_from_args
from daemon.compiling import print_progress
from daemon.engine import Engine, EngineLimits
from daemon.jobs import Failed, Finished, GenerationRequest
from daemon.metrics import Metrics
from daemon.runtime import STRATEGY_BUILDERS, Runtime
from daemon.settings import Settings
from speculative.generation import Chunk
from speculative.sampling import SamplingParams


def workload(runtime: Runtime, name: str, prompt: str, max_tokens: int) -> GenerationRequest:
    """The request every row runs with strategy `name`: greedy, EOS ignored, admitted as
    the daemon admits one (a --max-tokens past the context is cut to what fits)."""
    greedy = SamplingParams(temperature=0.0)
    ask = Ask(prompt, None, greedy, max_tokens, strategy=name, ignore_eos=True)
    return admit(runtime, ask, clamp_max_tokens=True)


def run_strategy(runtime: Runtime, request: GenerationRequest) -> dict:
    gen = runtime.generation(
        request.prompt_ids,
        request.params,
        request.max_tokens,
        strategy=request.strategy,
        ignore_eos=request.ignore_eos,
    )
    gen.run()
    return {"strategy": request.strategy, "token_ids": gen.token_ids, **gen.stats.to_dict()}


def per_pass(r: dict) -> str:
    """A row's tokens per target pass, "-" where no pass ran (every token replayed)."""
    value = r["tokens_per_target_pass"]
    return "-" if value is None else f"{value:.2f}"


def row_sentence(r: dict) -> str:
    """What a row of the table means, in words (the budget's reason when a tree ran)."""
    passes = r["target_passes"] - r["prefill_passes"]
    said = f"{r['generated_tokens']} tokens in {passes} target passes"
    if r["tokens_per_target_pass"] is not None:  # (None: every token replayed or forced)
        said += f" ({r['tokens_per_target_pass']:.2f} a pass)"
    if r["drafted"]:
        said += f", {r['accepted']} of {r['drafted']} drafted tokens accepted"
    if r.get("budget_reason"):
        said += f"; budget {r['budget']}: {r['budget_reason']}"
    return said


def prefix_cache_hit_rate(stats: dict) -> float | None:
    """Hits over look-ups of the tree's prefix cache, or None when it was not consulted."""
    looked = stats.get("prefix_cache_hits", 0) + stats.get("prefix_cache_misses", 0)
    return stats["prefix_cache_hits"] / looked if looked else None


def run_concurrent(engine: Engine, request: GenerationRequest, n: int) -> dict:
    """`n` generations of one request at once through the engine: aggregate tokens/s over
    the wall time, and generated tokens per target pass the engine ran."""

    async def one(loop: asyncio.AbstractEventLoop) -> tuple[list[int], dict]:
        job = engine.submit(request, loop)
        token_ids: list[int] = []
        while True:
            event = await job.events.get()
            if isinstance(event, Chunk):
                token_ids += event.token_ids
            elif isinstance(event, Finished):
                return token_ids, event.stats
            elif isinstance(event, Failed):
                raise event.error

    async def all_of_them() -> list[tuple[list[int], dict]]:
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(one(loop) for _ in range(n))))

    passes = engine.metrics.passes.value
    t0 = time.perf_counter()
    done = asyncio.run(all_of_them())
    seconds = time.perf_counter() - t0
    passes = engine.metrics.passes.value - passes
    outputs = [token_ids for token_ids, _ in done]
    tokens = sum(len(o) for o in outputs)
    return {
        "strategy": request.strategy,
        "concurrency": n,
        "outputs": outputs,
        "tokens": tokens,
        "seconds": seconds,
        "target_passes": int(passes),  # every pass the engine ran, prefill included
        "tokens_per_second": tokens / seconds,
        "tokens_per_target_pass": tokens / max(passes, 1),
        "prefix_cache_hits": sum(stats["prefix_cache_hits"] for _, stats in done),
        "prefix_cache_misses": sum(stats["prefix_cache_misses"] for _, stats in done),
    }


def concurrent_engine(settings: Settings, runtime: Runtime, n: int) -> Engine:
    """The daemon's engine over this runtime, batched, with room for `n` generations and no
    kept conversations (each generation starts from its own prompt)."""
    limits = EngineLimits(
        queue_size=max(settings.limits.queue_size, n),
        max_concurrent=n,
        cached_sessions=0,
        stream_interval=settings.server.stream_interval_ms / 1000.0,
        batch_passes=True,
        max_pass_tokens=settings.limits.max_pass_tokens,
    )
    engine = Engine(runtime.options, limits, Metrics(), runtime_factory=lambda _: runtime)
    engine.start()
    engine.loaded.wait()
    return engine


def print_concurrent(rows: list[dict], single: list[dict]) -> None:
    alone = {r["strategy"]: r for r in single}
    n = rows[0]["concurrency"]
    print(
        f"\n{n} concurrent generations of the same prompt, batched passes (in-process engine); "
        "tok/pass counts every target pass, prefill included"
    )
    print(f"{'strategy':<16}{'tokens/s':>10}{'vs 1':>8}{'tok/pass':>10}{'prefix hits':>13}  same")
    for r in rows:
        one = alone[r["strategy"]]
        ratio = r["tokens_per_second"] / one["tokens_per_second"] if one["tokens_per_second"] else 0
        same = "yes" if all(o == one["token_ids"] for o in r["outputs"]) else "NO"
        # The generations share a prompt: one may draw logits another verified.
        hit_rate = prefix_cache_hit_rate(r)
        hits = "-" if hit_rate is None else f"{hit_rate:.0%}"
        print(
            f"{r['strategy']:<16}{r['tokens_per_second']:>10.1f}{ratio:>8.2f}"
            f"{r['tokens_per_target_pass']:>10.2f}{hits:>13}  {same}"
        )


def cmd_bench(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    options = settings.runtime_options()
    if args.concurrency > 1:  # the plan holds a pass's logit rows for every generation
        options = dataclasses.replace(options, sequences=max(options.sequences, args.concurrency))
    runtime = Runtime(options)
    runtime.compile(serving=False).warm(print_progress)  # --compile on: before measuring
    names = args.strategies or [
        n for n in STRATEGY_BUILDERS if n == "autoregressive" or runtime.draft_kind is not None
    ]
    warm_up = workload(runtime, "autoregressive", args.prompt, 8)
    requests = [workload(runtime, n, args.prompt, args.max_tokens) for n in names]
    prompt_ids = warm_up.prompt_ids
    run_strategy(runtime, warm_up)  # warm-up: first-call overheads
    rows = [run_strategy(runtime, request) for request in requests]
    base = next((r for r in rows if r["strategy"] == "autoregressive"), None)
    print(
        f"workload: prompt {args.prompt!r} ({len(prompt_ids)} tokens), {args.max_tokens} new "
        f"tokens each, greedy, EOS ignored; tree budget {options.budget}, "
        f"linear length {options.spec_length}; draft {options.draft or 'none'}"
    )
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
            f"{per_pass(r):>10}{accept:>8}{hits:>13}  {same}"
        )
    for r in rows:
        print(f"  {r['strategy']}: {row_sentence(r)}")
    lossless = all(r["token_ids"] == rows[0]["token_ids"] for r in rows)
    record: list[dict] | dict = rows
    if args.concurrency > 1:
        engine = concurrent_engine(settings, runtime, args.concurrency)
        try:
            # The tree's prefix cache holds the single streams' logits: it would answer.
            runtime.prefix_cache.clear()
            run_concurrent(engine, warm_up, args.concurrency)
            together = []
            for request in requests:
                runtime.prefix_cache.clear()
                together.append(run_concurrent(engine, request, args.concurrency))
        finally:
            engine.shutdown()
        print_concurrent(together, rows)
        lossless = lossless and all(
            o == rows[0]["token_ids"] for r in together for o in r["outputs"]
        )
        record = {"single": rows, "concurrent": together}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0 if lossless else 1


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="compare strategies on the configured model pair")
    add_settings_args(bench)
    for action in bench._actions:  # (a benchmark listens nowhere: the daemon's flags)
        if action.dest in ("host", "port", "api_key_file"):
            action.help = argparse.SUPPRESS
    bench.add_argument("--prompt", default="Once upon a time")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--strategies", nargs="+", default=None, help="default: all that apply")
    bench.add_argument(
        "--concurrency",
        type=count("--concurrency", 1),
        default=1,
        help="also run N generations at once through the batched engine (default 1: no)",
    )
    bench.add_argument("--json", type=Path, default=None, help="also write the rows here")
    bench.set_defaults(func=cmd_bench)
