"""A request's `n` choices with their prompt prefilled once against each choice prefilling it,
side by side in one run.

    .venv/bin/python scripts/bench_choices.py [--n 4] [--prompt-tokens 600] [--max-tokens 2]
        [--repeats 3] [--model PATH] [--threads 1]

SmolLM2-135M-Instruct's GGUF by default, on the CPU, through an in-process `Engine` (the
daemon's own scheduling): `n` greedy choices of one long prompt, each of --max-tokens, with
the choices in one prompt group (the others wait for the first choice's prompt and start
from a copy of its KV caches) and without (every choice prefills the prompt, in the same
batched passes). Per row: the wall time from submission to the last choice's end (median
over repeats, the two ways taking turns), the target tokens prefilled in all, and whether
every choice's tokens are the same both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.engine import Engine, EngineLimits  # noqa: E402
from daemon.jobs import Failed, Finished, GenerationRequest  # noqa: E402
from daemon.metrics import Metrics  # noqa: E402
from daemon.options import RuntimeOptions  # noqa: E402
from daemon.runtime import Runtime  # noqa: E402
from scripts.real_forms import SMOLLM2_GGUF  # noqa: E402
from speculative.generation import Chunk  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402

WORDS = [
    "the",
    "river",
    "runs",
    "past",
    "an",
    "old",
    "mill",
    "where",
    "children",
    "play",
    "in",
    "the",
    "summer",
    "light",
    "and",
]


def run(engine: Engine, requests: list[GenerationRequest]) -> tuple[float, list[list[int]], int]:
    """(seconds, each choice's tokens, prompt tokens its sessions were prefilled with)."""

    async def go() -> tuple[float, list[list[int]], int]:
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        jobs = [engine.submit(r, loop) for r in requests]
        tokens: list[list[int]] = []
        fed = 0
        for job in jobs:
            ids: list[int] = []
            while True:
                event = await job.events.get()
                if isinstance(event, Chunk):
                    ids += event.token_ids
                elif isinstance(event, Finished):
                    cached = int(event.stats.get("cached_prompt_tokens", 0))
                    fed += event.prompt_tokens - cached
                    break
                elif isinstance(event, Failed):
                    raise event.error
            tokens.append(ids)
        return time.perf_counter() - began, tokens, fed

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=str(SMOLLM2_GGUF))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    runtime = Runtime(RuntimeOptions(model=args.model, device="cpu", draft=None, prefix_cache=0,
                                     threads=args.threads, compile="off", sequences=args.n))  # fmt: skip
    words = (WORDS * (args.prompt_tokens // len(WORDS) + 1))[: args.prompt_tokens]
    prompt = runtime.tokenizer.encode(" ".join(words))[: args.prompt_tokens]
    limits = EngineLimits(max_concurrent=args.n, cached_sessions=0, stream_interval=0.0)
    engine = Engine(runtime.options, limits, Metrics(), runtime_factory=lambda _: runtime)
    engine.start()
    assert engine.loaded.wait(120) and engine.ready
    greedy = SamplingParams(temperature=0.0)
    seconds: dict[str, list[float]] = {"shared": [], "each": []}
    fed: dict[str, int] = {}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for repeat in range(args.repeats):
            ways = ["shared", "each"] if repeat % 2 == 0 else ["each", "shared"]
            for way in ways:
                group = object() if way == "shared" else None
                requests = [
                    GenerationRequest(prompt_ids=list(prompt), params=greedy,
                                      max_tokens=args.max_tokens, ignore_eos=True,
                                      prompt_group=group)
                    for _ in range(args.n)
                ]  # fmt: skip
                took, tokens, prefilled = run(engine, requests)
                seconds[way].append(took)
                fed[way], outputs[way] = prefilled, tokens
    finally:
        engine.shutdown()
    same = outputs["shared"] == outputs["each"]
    print(f"{Path(args.model).name}, n={args.n}, a {len(prompt)}-token prompt, "
          f"{args.max_tokens} tokens each, {args.threads} thread(s), median of {args.repeats}")  # fmt: skip
    print("| choices' prompt | seconds | prompt tokens prefilled | same tokens |")
    print("|---|---|---|---|")
    for way, label in (("shared", "prefilled once"), ("each", "prefilled by each")):
        print(f"| {label} | {statistics.median(seconds[way]):.2f} | {fed[way]} | {same} |")
    ratio = statistics.median(seconds["each"]) / statistics.median(seconds["shared"])
    print(f"prefilled once is {ratio:.2f}x faster")


if __name__ == "__main__":
    main()
