"""Concurrent clients: the batched engine (one target pass per step for every active
generation) against the interleaved one (`limits.batch_passes: false`), in one run.

    .venv/bin/python scripts/bench_concurrency.py [--clients 1,2,4,8] [--max-tokens 128]
        [--repeats 5] [--budget auto|N] [--rest/--no-rest] [--json PATH] [--plot PATH]
        [--quick]

For each client count N, N greedy generations (fixed prompts of mixed lengths, tree
speculation with the draft, --max-tokens each, EOS ignored) run at once, in-process through
an `Engine` and over the REST API of a `specd serve` process with N streaming clients. The
target's layers are streamed from host RAM (offload stream, no resident layer, 2 slots), the
CPU run of the path a GPU streams over the bus. Per row:

- aggregate tokens/s: all generated tokens over the wall time from the first submission to
  the last token (median over repeats); against the interleaved engine, the median over
  repeats of the ratio within each repeat (the two engines run back to back);
- target passes per generated token (the engine's `passes`, prefill passes included);
- streamed bytes per generated token (the streamer's own count);
- p50 / p95 inter-token latency: the gaps between one client's chunks that carry tokens
  (chunks are coalesced over `server.stream_interval_ms`, 20 ms by default, which floors
  them), the median of the clients' p50 and the worst client's p95;
- same: every request's output equals between the two engines (lossless): token ids
  in-process, text over REST (the stream carries text).

The prefix cache and the session pool are off so that repeats do not reuse earlier work.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.engine import Engine, EngineLimits  # noqa: E402
from daemon.jobs import Failed, Finished, GenerationRequest  # noqa: E402
from daemon.metrics import Metrics  # noqa: E402
from daemon.options import RuntimeOptions  # noqa: E402
from daemon.runtime import Runtime  # noqa: E402
from scripts.concurrency_plot import plot  # noqa: E402
from speculative.generation import Chunk  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"
ENGINES = ("batched", "interleaved")
# Mixed lengths (about 5 to 90 tokens): client i sends PROMPTS[i % len(PROMPTS)].
PROMPTS = (
    "Once upon a time",
    "Lily and Tom went to the park. They saw a big slide and a swing.",
    "The little dog",
    "One day, a girl named Sue found a shiny red ball under her bed. She wanted to show it to"
    ' her mom, but her mom was busy in the kitchen. Sue said, "Mom, look what I found!" Her'
    " mom smiled and said,",
    "Tim had a toy car.",
    "There was a big tree in the garden. A little bird lived in the tree with her babies."
    " Every day she flew away to find food.",
    "Ben liked to",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the"
    " park with her friends. One day, she saw a big red ball under a tree. She ran to get it"
    " but a big dog came and took the ball. Lily was sad and started to cry. Then",
)


@dataclass
class ClientRun:
    """One request's outcome, as its client saw it."""

    output: list[int] | str  # token ids in-process, text over REST
    text: str
    tokens: int
    gaps: list[float]  # seconds between chunks that carried tokens
    target_passes: int = 0  # the target passes it rode in (its stats, `specd` over REST)
    streamed_bytes: int = 0  # the streamer's count its stats took when it finished
    budget: int | None = None  # the tree budget of its last round (auto chooses it)


@dataclass
class Trial:
    """N clients at once, one engine, one repeat."""

    seconds: float
    clients: list[ClientRun]
    passes: int
    streamed_bytes: int

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.clients)


@dataclass
class Row:
    path: str  # in-process | rest
    clients: int
    engine: str
    trials: list[Trial] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        tokens = sum(t.tokens for t in self.trials)
        per_client = [
            [g for t in self.trials for g in t.clients[i].gaps] for i in range(self.clients)
        ]
        p50 = [percentile(g, 50) for g in per_client if g]
        p95 = [percentile(g, 95) for g in per_client if g]
        passes = sum(t.passes for t in self.trials)
        request_passes = sum(c.target_passes for t in self.trials for c in t.clients)
        return {
            "path": self.path,
            "clients": self.clients,
            "engine": self.engine,
            "repeats": len(self.trials),
            "tokens": tokens,
            "tokens_per_second": statistics.median(t.tokens / t.seconds for t in self.trials),
            "passes": passes,
            "passes_per_token": passes / tokens,
            "streamed_bytes": sum(t.streamed_bytes for t in self.trials),
            "streamed_bytes_per_token": sum(t.streamed_bytes for t in self.trials) / tokens,
            "itl_p50_ms": statistics.median(p50) * 1e3 if p50 else None,
            "itl_p95_ms": max(p95) * 1e3 if p95 else None,
            "itl_per_client_ms": [
                {"p50": percentile(g, 50) * 1e3, "p95": percentile(g, 95) * 1e3} if g else None
                for g in per_client
            ],
            # The target passes each request rode in, summed: over the passes run, the mean
            # generations per pass (1 for the interleaved engine).
            "request_passes": request_passes,
            "generations_per_pass": request_passes / passes if passes else 0.0,
            "budgets": [c.budget for t in self.trials for c in t.clients],
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def prompt_ids(runtime: Runtime, n: int) -> list[list[int]]:
    return [runtime.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]


# ---- in-process: an Engine driven from asyncio, as the HTTP handlers drive it ----


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    return RuntimeOptions(
        model=args.model,
        draft=args.draft,
        device="cpu",
        offload="stream",
        resident_layers=0,
        slots=2,
        prefix_cache=0,
        budget=args.budget,
        sequences=max_concurrent(args),
    )


def max_concurrent(args: argparse.Namespace) -> int:
    return max(8, *args.clients)  # the daemon's default, or more when asked


def make_engine(runtime: Runtime, args: argparse.Namespace, batched: bool) -> Engine:
    limits = EngineLimits(
        max_concurrent=max_concurrent(args),
        cached_sessions=0,
        stream_interval=args.stream_interval_ms / 1000,
        batch_passes=batched,
    )
    engine = Engine(runtime.options, limits, Metrics(), runtime_factory=lambda _: runtime)
    engine.start()
    engine.loaded.wait()
    return engine


async def engine_client(engine: Engine, ids: list[int], max_tokens: int) -> ClientRun:
    loop = asyncio.get_running_loop()
    request = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens, ignore_eos=True)
    job = engine.submit(request, loop)
    tokens: list[int] = []
    text: list[str] = []
    stamps: list[float] = []
    while True:
        event = await job.events.get()
        if isinstance(event, Chunk):
            if event.token_ids:
                stamps.append(time.perf_counter())
                tokens += event.token_ids
            text.append(event.text)
        elif isinstance(event, Finished):
            stats = event.stats
            streamed = int(stats.get("streamed_bytes_total", 0))
            return ClientRun(
                tokens,
                "".join(text),
                len(tokens),
                gaps(stamps),
                stats["target_passes"],
                streamed,
                stats.get("budget"),
            )
        elif isinstance(event, Failed):
            raise RuntimeError(f"a generation failed: {event.error!r}") from event.error


def in_process_trial(engine: Engine, prompts: list[list[int]], max_tokens: int) -> Trial:
    runtime = engine.runtime
    assert runtime is not None
    runtime.offload_stats()  # the streamer counts from here
    passes = engine.metrics.passes.value

    async def all_clients() -> tuple[float, list[ClientRun]]:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(engine_client(engine, p, max_tokens) for p in prompts))
        return time.perf_counter() - t0, list(runs)

    seconds, runs = asyncio.run(all_clients())
    # Each generation's stats take (and reset) the streamer's count when it finishes: the
    # last finish ends the trial, so their sum (and whatever is left) is every byte it moved.
    streamed = sum(c.streamed_bytes for c in runs)
    streamed += int(runtime.offload_stats().get("streamed_bytes_total", 0))
    return Trial(seconds, runs, int(engine.metrics.passes.value - passes), streamed)


def gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(stamps)]


# ---- over REST: `specd serve` in its own process, N streaming aiohttp clients ----


class Daemon:
    """`specd serve` with the same options as the in-process runtime, one per engine."""

    def __init__(self, args: argparse.Namespace, batched: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "daemon.cli", "serve", "--model", args.model,
               "--draft", args.draft, "--device", "cpu", "--offload", "stream",
               "--resident-layers", "0", "--slots", "2", "--prefix-cache", "0",
               "--budget", str(args.budget), "--port", str(self.port),
               "--log-level", "warning"]  # fmt: skip
        env = {
            **os.environ,
            "SPECD_LIMITS_BATCH_PASSES": "true" if batched else "false",
            "SPECD_LIMITS_CACHED_SESSIONS": "0",
            "SPECD_LIMITS_MAX_CONCURRENT": str(max_concurrent(args)),
            "SPECD_SERVER_STREAM_INTERVAL_MS": str(args.stream_interval_ms),
        }
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        async def poll() -> None:
            deadline = time.monotonic() + timeout
            async with aiohttp.ClientSession() as http:
                while time.monotonic() < deadline:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"specd serve exited with status {self.proc.returncode}")
                    try:
                        async with http.get(self.url + "/health") as resp:
                            if resp.status == 200:
                                return
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.2)
            raise TimeoutError(f"specd serve did not become healthy within {timeout:.0f} s")

        asyncio.run(poll())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


METRIC_NAMES = ("specd_passes_total", "specd_stream_bytes_total")


async def read_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRIC_NAMES:
            values[name] = float(value)
    return values


async def rest_client(
    http: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int
) -> ClientRun:
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    text: list[str] = []
    stamps: list[float] = []
    tokens = passes = 0
    budget = None
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST /v1/completions: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"the stream ended in an error: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if "target_passes" in event.get("specd", {}):
                passes = event["specd"]["target_passes"]
                budget = event["specd"].get("budget")
            for choice in event.get("choices", []):
                if choice["text"]:
                    stamps.append(time.perf_counter())
                    text.append(choice["text"])
    return ClientRun("".join(text), "".join(text), tokens, gaps(stamps), passes, budget=budget)


def rest_trial(url: str, prompts: list[list[int]], max_tokens: int) -> Trial:
    async def all_clients() -> Trial:
        limits = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=limits, timeout=timeout) as http:
            before = await read_metrics(http, url)
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(rest_client(http, url, p, max_tokens) for p in prompts))
            seconds = time.perf_counter() - t0
            after = await read_metrics(http, url)
        delta = {k: int(after.get(k, 0) - before.get(k, 0)) for k in METRIC_NAMES}
        return Trial(
            seconds, list(runs), delta["specd_passes_total"], delta["specd_stream_bytes_total"]
        )

    return asyncio.run(all_clients())


# ---- the run ----


def order(i: int) -> tuple[str, ...]:
    """Batched first on even repeats, interleaved first on odd ones (drift cancels out)."""
    return ENGINES if i % 2 == 0 else ENGINES[::-1]


def run_in_process(args: argparse.Namespace, runtime: Runtime) -> list[Row]:
    engines = {name: make_engine(runtime, args, name == "batched") for name in ENGINES}
    rows = {(n, e): Row("in-process", n, e) for n in args.clients for e in ENGINES}
    try:
        warm = prompt_ids(runtime, max(args.clients))
        for engine in engines.values():  # first-call overheads, the tree's cost estimates
            in_process_trial(engine, warm[:1], 8)
            in_process_trial(engine, warm, 8)
        for i in range(args.repeats):
            for n in args.clients:
                for name in order(i):
                    trial = in_process_trial(engines[name], prompt_ids(runtime, n), args.max_tokens)
                    rows[(n, name)].trials.append(trial)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return list(rows.values())


def run_rest(args: argparse.Namespace, runtime: Runtime) -> list[Row]:
    daemons = {name: Daemon(args, name == "batched") for name in ENGINES}
    rows = {(n, e): Row("rest", n, e) for n in args.clients for e in ENGINES}
    try:
        for daemon in daemons.values():
            daemon.wait_healthy()
        warm = prompt_ids(runtime, max(args.clients))
        for daemon in daemons.values():
            rest_trial(daemon.url, warm[:1], 8)
            rest_trial(daemon.url, warm, 8)
        for i in range(args.repeats):
            for n in args.clients:
                for name in order(i):
                    trial = rest_trial(daemons[name].url, prompt_ids(runtime, n), args.max_tokens)
                    rows[(n, name)].trials.append(trial)
    finally:
        for daemon in daemons.values():
            daemon.stop()
    return list(rows.values())


def same_outputs(a: Row, b: Row) -> bool:
    """Every request's output equals between the two rows' engines, repeat by repeat."""
    return all(
        x.output == y.output
        for ta, tb in zip(a.trials, b.trials, strict=True)
        for x, y in zip(ta.clients, tb.clients, strict=True)
    )


def summarise(rows: list[Row]) -> list[dict[str, Any]]:
    by_key = {(r.path, r.clients, r.engine): r for r in rows}
    out = []
    for r in rows:
        s = r.summary()
        other = by_key[(r.path, r.clients, "interleaved" if r.engine == "batched" else "batched")]
        s["same"] = same_outputs(r, other)
        # Each repeat ran both engines back to back: the median of those paired ratios
        # holds up better to the machine's drift than a ratio of medians.
        base = by_key[(r.path, r.clients, "interleaved")]
        s["vs_interleaved"] = statistics.median(
            (t.tokens / t.seconds) / (b.tokens / b.seconds)
            for t, b in zip(r.trials, base.trials, strict=True)
        )
        out.append(s)
    return out


def goals(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, per path: at the most clients, streamed bytes per token at most a
    fifth of one client's and tokens/s at least twice the interleaved engine's (moonshot 4x);
    one client within 5% of the interleaved engine."""
    out = []
    for path in dict.fromkeys(s["path"] for s in summary):
        mine = {(s["clients"], s["engine"]): s for s in summary if s["path"] == path}
        lo, hi = min(c for c, _ in mine), max(c for c, _ in mine)
        one, many = mine[(lo, "batched")], mine[(hi, "batched")]
        bytes_ratio = (
            many["streamed_bytes_per_token"] / one["streamed_bytes_per_token"]
            if one["streamed_bytes_per_token"]
            else None
        )
        out.append(
            {
                "path": path,
                "clients": hi,
                "bytes_per_token_vs_one_client": bytes_ratio,
                "bytes_goal_met": bytes_ratio is not None and bytes_ratio <= 0.2,
                "speedup_vs_interleaved": many["vs_interleaved"],
                "speedup_goal_met": many["vs_interleaved"] >= 2.0,
                "speedup_moonshot_met": many["vs_interleaved"] >= 4.0,
                "one_client_vs_interleaved": one["vs_interleaved"],
                "one_client_goal_met": one["vs_interleaved"] >= 0.95,
            }
        )
    return out


def _budget(budgets: list[int | None]) -> str:
    """The tree budgets the requests ended on: one value, or the range."""
    known = [b for b in budgets if b is not None]
    if not known:
        return "-"
    lo, hi = min(known), max(known)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(summary: list[dict[str, Any]]) -> None:
    print(
        f"{'path':<11}{'clients':>8}  {'engine':<12}{'tok/s':>9}{'vs int':>8}{'pass/tok':>10}"
        f"{'bytes/tok':>11}{'ITL p50':>9}{'ITL p95':>9}{'batch':>7}{'budget':>8}  same"
    )
    for s in summary:
        print(
            f"{s['path']:<11}{s['clients']:>8}  {s['engine']:<12}{s['tokens_per_second']:>9.1f}"
            f"{s['vs_interleaved']:>8.2f}{s['passes_per_token']:>10.3f}"
            f"{s['streamed_bytes_per_token']:>11.0f}{_ms(s['itl_p50_ms']):>9}"
            f"{_ms(s['itl_p95_ms']):>9}{s['generations_per_pass']:>7.2f}{_budget(s['budgets']):>8}  "
            f"{'same' if s['same'] else 'DIFFERENT'}"
        )


def consistent_across_rows(rows: list[Row]) -> bool:
    """Greedy decoding of one prompt gives one text, whatever the path, the client count,
    the engine or the repeat (what the other generations in a pass were must not matter)."""
    texts: dict[int, set[str]] = {}
    for r in rows:
        for t in r.trials:
            for i, c in enumerate(t.clients):
                texts.setdefault(i % len(PROMPTS), set()).add(c.text)
    return all(len(v) == 1 for v in texts.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SHARED / "stories260k"))
    p.add_argument("--draft", default=str(SHARED / "stories260k-draft"))
    p.add_argument("--clients", default="1,2,4,8", help="comma list of client counts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", default="auto", help="tree node budget, or auto")
    p.add_argument("--stream-interval-ms", type=int, default=20, help="server.stream_interval_ms")
    p.add_argument("--rest", action=argparse.BooleanOptionalAction, default=None,
                   help="also over the REST API (default: yes, no with --quick)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="PNG (SVG without matplotlib)")
    p.add_argument("--quick", action="store_true", help="1 and 2 clients, 8 tokens, once")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.max_tokens, args.repeats = "1,2", 8, 1
    args.clients = [int(c) for c in args.clients.split(",")]
    args.rest = not args.quick if args.rest is None else args.rest
    args.budget = args.budget if args.budget == "auto" else int(args.budget)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    runtime = Runtime(runtime_options(args))
    threads = torch.get_num_threads()
    assert runtime.streamer is not None, "the plan streams no layer"
    per_pass = int(runtime.streamer.stats()["streamed_bytes_per_pass"])
    print(
        f"{Path(args.model).name} + {Path(args.draft).name}, tree (budget {args.budget}), greedy, "
        f"{args.max_tokens} tokens per client, {args.repeats} repeat(s); target streamed from "
        f"host RAM on the CPU ({runtime.streamer.streamed_layers} layers, "
        f"{per_pass:,} bytes per pass), {threads} torch thread(s)"
    )
    rows = run_in_process(args, runtime)
    if args.rest:
        rows += run_rest(args, runtime)
    summary = summarise(rows)
    print_table(summary)
    consistent = consistent_across_rows(rows)
    print(f"each prompt's output is the same in every row and repeat: {consistent}")
    # One generation per interleaved pass: its requests' passes add up to the engine's.
    accounted = all(s["request_passes"] == s["passes"] for s in summary if s["engine"] != "batched")
    print(f"interleaved: the requests' target passes add up to the passes run: {accounted}")
    for g in goals(summary):
        ratio = g["bytes_per_token_vs_one_client"]
        print(
            f"{g['path']}, {g['clients']} clients: bytes/token {_ratio(ratio)} of 1 client's "
            f"(goal <= 0.20: {_met(g['bytes_goal_met'])}); tokens/s "
            f"{g['speedup_vs_interleaved']:.2f}x interleaved (goal >= 2: "
            f"{_met(g['speedup_goal_met'])}, moonshot 4: {_met(g['speedup_moonshot_met'])}); "
            f"1 client {g['one_client_vs_interleaved']:.2f}x interleaved (goal >= 0.95: "
            f"{_met(g['one_client_goal_met'])})"
        )
    elapsed = time.perf_counter() - started
    print(f"{elapsed:.0f} s in all")
    if args.plot:
        title = (
            f"{Path(args.model).name} + {Path(args.draft).name}, tree budget {args.budget}, "
            f"{args.max_tokens} tokens per client, target streamed from host RAM (CPU)"
        )
        how = plot(summary, args.plot, title)
        print(f"wrote {args.plot} ({how})")
    if args.json:
        record = {
            "command": " ".join(["scripts/bench_concurrency.py", *(argv or sys.argv[1:])]),
            "model": args.model,
            "draft": args.draft,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "budget": args.budget,
            "stream_interval_ms": args.stream_interval_ms,
            "threads": threads,
            "streamed_bytes_per_pass": per_pass,
            "prompts": [PROMPTS[i % len(PROMPTS)] for i in range(max(args.clients))],
            "rows": summary,
            "consistent_across_rows": consistent,
            "interleaved_passes_accounted": accounted,
            "goals": goals(summary),
            "seconds": elapsed,
        }
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    lossless = all(s["same"] for s in summary) and consistent
    return 0 if lossless else 1


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


if __name__ == "__main__":
    sys.exit(main())
