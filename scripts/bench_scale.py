"""The memory plan against measured peaks, at real vocabularies, tree budgets and contexts.

For each target/draft pair (real layer shapes and vocabularies, random weights, `--layers`
decoder layers: scripts/real_shapes.py) and each context and tree budget, on the device at
hand, it measures with `offload.machine.PeakMemory` (CUDA allocator peak; CPU peak RSS)
what each phase ADDS to what is already held when it starts:

    kv          both KV caches allocated for the whole context and written (random K/V,
                no 32k prefill: the caches are then set to hold `context - chunk` tokens)
    prefill     one prefill chunk that ends the context (target, then draft: `feed`), so
                that it attends to as many keys as the plan allows
    tree        one full tree round (TreeSpeculation: draft tree of the budget, target
                verification, walk, prefix-cache store, commit), sampled, on a prompt
                that leaves the context room for the tree and the round's tokens
    regenerate  the same prompt again with another seed: one round; prefix-cache hits

and sets each beside the plan's figure for what that phase may add (daemon.footprint.
footprint + daemon.memory_plan.plan_request + offload.planning.make_plan, read in
`plan_figures` only):

    kv          the plan's KV caches, against the caches' allocated bytes (exact; the
                resident-set probe resolves no better than a few pages, its reading is in
                the notes as probe_bytes)
    prefill     the activations of a prefill-chunk pass (the plan's max(target, draft):
                the two passes run one after the other and keep nothing)
    tree,       the activations of a pass of the tree (root and budget nodes, a logit row
    regenerate  each) plus the planned prefix cache minus the slot memory the cache has
                already allocated when the round starts (`PrefixCache.allocated_bytes`;
                on a GPU the cache is pinned host RAM: the activations alone)

Each scenario runs twice on one prefix cache, on two histories. The first (cold) run may be
the process's first passes (the first matrix products leave the BLAS library's buffers
and code resident: about 7 MiB with MKL on a CPU, kept for the process's life, not tensors
of the plan) and starts with an empty prefix cache that the tree round fills. The second (warm) run is a running daemon's: the
cache is full of another conversation's rows, which the round's store replaces. The table
reports the warm run; each row's notes keep the cold run's planned and measured bytes.

On a Linux CPU, glibc's mmap threshold is fixed at 64 KiB (`mallopt`; by default it rises
to 32 MiB as large blocks are freed, after which large tensors come from the heap, whose
freed holes keep pages resident), so the peak resident set follows the tensors alive at
once rather than the heap's history, as tests/test_attention_memory.py does.

The goal (issue 8) is a plan that is an upper bound everywhere and within 25% of the
measured peak: 1 <= plan/measured <= 1.25. The table says which rows meet it; nothing is
adjusted.

    python scripts/bench_scale.py                                   # CPU defaults, minutes
    python scripts/bench_scale.py --device cuda --presets all --budgets 64,256,1024 \\
        --contexts 4096,32768 --hidden-scale 1 --json scale.json --plot scale.png

Full-width 70B layers on a 2-core CPU take minutes per pass: CPU runs default to a
narrow width (`--hidden-scale`, same vocabulary and head counts) and a short prefill chunk.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from daemon.footprint import footprint  # noqa: E402
from daemon.memory_plan import OffloadOptions, plan_request  # noqa: E402
from modeling.checkpoints.checkpoint import DTYPES  # noqa: E402
from modeling.config import ModelConfig  # noqa: E402
from modeling.decoder import Transformer  # noqa: E402
from modeling.kv_cache import WINDOW_ROOM, KVCache  # noqa: E402
from offload.machine import PeakMemory  # noqa: E402
from offload.plan import MemoryBudget, MemoryPlan  # noqa: E402
from offload.planning import make_plan  # noqa: E402
from offload.units import format_size  # noqa: E402
from scripts.real_shapes import PAIRS, build_model, model_config  # noqa: E402
from speculative.passes import alone  # noqa: E402
from speculative.prefill import feed  # noqa: E402
from speculative.prefix_cache import PrefixCache  # noqa: E402
from speculative.sampling import SamplingParams, make_generator  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402

TIGHTNESS = 1.25  # the goal: plan <= 1.25 x measured, and >= measured
ROUND_TOKENS = 64  # max new tokens a measured round may aim for (depth is capped by it)


def _unbounded(device: str) -> MemoryBudget:
    """Budgets that never limit: the bench holds the plan's figures against measurements."""
    return MemoryBudget(device, 1 << 60, "bench", 1 << 60, "bench", None, "none")


# --- reading the plan: the one place that knows the plan's part names ---------------------


def pass_plan(
    target: ModelConfig,
    draft: ModelConfig,
    dtype: torch.dtype,
    context: int,
    tokens: int,
    logit_rows: int = 1,
    prefix_cache_bytes: int = 0,
    device: str = "cpu",
) -> MemoryPlan:
    """The daemon's plan for this pair and context, everything resident, with its largest
    pass set to `tokens` tokens returning `logit_rows` rows of logits (a prefill chunk: 1; a
    tree of N nodes: N + 1 tokens and rows) and a prefix cache of `prefix_cache_bytes`, for
    a `device` ("cpu": the cache is a device part; "cuda": it lives in pinned host RAM)."""
    t = footprint(target, dtype, "target", device_type=device)
    # The draft's logits at the target's width, as the daemon plans them (choose_plan)
    d = footprint(draft, dtype, "draft", target.vocab_size, device_type=device)
    options = OffloadOptions(offload="none", prefix_cache_bytes=prefix_cache_bytes)
    request = plan_request(t, d, context, options, tree_budget=max(logit_rows - 1, 1))
    exact = dataclasses.replace(request, pass_tokens=tokens, logit_rows=logit_rows)
    return make_plan(exact, _unbounded(device))


def plan_figures(plan: MemoryPlan) -> dict[str, int]:
    """The plan's bytes for the parts this bench measures (a part the plan does not have
    reads 0, which the table then shows as missed)."""
    figures = {"kv": 0, "activations": 0, "prefix_cache": 0}
    for name, n in plan.device_parts.items():
        if "KV cache" in name:
            figures["kv"] += n
        elif name.startswith("activations"):
            figures["activations"] += n
        elif "prefix cache" in name.lower():
            figures["prefix_cache"] += n
    return figures


# --- measuring ---------------------------------------------------------------------------


@dataclass
class Row:
    target: str
    draft: str
    context: int
    budget: int
    phase: str
    planned: int
    measured: int | None
    seconds: float
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return self.planned / self.measured if self.measured else None

    @property
    def upper_bound(self) -> bool | None:
        return None if self.measured is None else self.planned >= self.measured

    @property
    def within_goal(self) -> bool | None:
        r = self.ratio
        return None if r is None else 1.0 <= r <= TIGHTNESS

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(ratio=self.ratio, upper_bound=self.upper_bound, within_goal=self.within_goal)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MMAP_THRESHOLD = 64 * 2**10  # bytes: every tensor larger than this is its own mapping


def fix_heap() -> None:
    """Linux CPU: glibc maps every block above MMAP_THRESHOLD on its own and trims the heap
    above it (M_MMAP_THRESHOLD = -3, M_TRIM_THRESHOLD = -1), so a freed tensor goes back
    to the system and the peak resident set is the tensors alive at once (module docstring)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)
        libc.mallopt(-1, MMAP_THRESHOLD)


def probe(device: torch.device) -> PeakMemory:
    """A PeakMemory for the next phase. On Linux CPU, memory the previous phases freed is
    handed back to the system first (glibc `malloc_trim`): otherwise glibc's heap keeps those
    pages resident, a phase that reuses them raises no peak, and small phases read 0."""
    _sync(device)
    if device.type == "cpu" and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return PeakMemory(device)


def context_cache(
    model: Transformer, context: int, generator: torch.Generator | None = None
) -> KVCache:
    """A cache of `model`'s kind (window layers' ring and slot positions included) allocated
    for the whole context and written everywhere: random K/V from `generator`, zeros
    without one. Every page is touched, so a pass measured afterwards is its own memory,
    not the cache growing."""
    cache = KVCache(
        model.config, context, model.dtype, model.device, initial=context,
        positions=model.windowed, pass_tokens=model.max_pass_tokens,
    )  # fmt: skip
    for store in (cache.k, cache.v, cache.ring_k, cache.ring_v):
        if store is None:
            continue
        if generator is None:
            store.zero_()
        else:
            store.normal_(generator=generator)
    if cache.positions is not None:
        cache.positions.copy_(torch.arange(context, device=cache.positions.device))
    return cache


def full_cache(model: Transformer, context: int, hold: int, generator: torch.Generator) -> KVCache:
    """A cache allocated for the whole context and written everywhere with random K/V (as a
    long conversation leaves it), holding `hold` tokens: a 32k context without a 32k prefill."""
    cache = context_cache(model, context, generator)
    # In passes of the ring's room, as a conversation fills it: a window ring then knows the
    # slots it holds, at the size a daemon's cache has (one reserve of all `hold` slots
    # would size it for a pass of that many tokens: up to the whole context).
    step = max(cache.pass_tokens, WINDOW_ROOM)
    while cache.length < hold:
        n = min(step, hold - cache.length)
        cache.reserve(n)
        cache.commit_append(n)
    return cache


def run_scenario(
    names: tuple[str, str],
    models: tuple[Transformer, Transformer],
    context: int,
    budget: int,
    prefill_tokens: int,
    seed: int,
) -> list[Row]:
    """kv, prefill, tree and regenerate rows for one pair, context and budget: the warm run,
    with the cold run's figures in each row's notes (see the module docstring)."""
    target, draft = models
    draft.set_vocab_width(target.vocab_width)  # Qwen's draft embeds fewer rows (one tokenizer)
    tcfg = target.config
    room = max(prefill_tokens, budget + 1 + ROUND_TOKENS)  # what the measured passes append
    if context - room < 1:
        raise ValueError(
            f"context {context} is too short for a {prefill_tokens}-token prefill chunk and a "
            f"{budget}-node tree (needs more than {room})"
        )
    # A prefix cache that holds one verified tree (the rows of `budget + 1` nodes in the
    # model dtype): the plan counts the configured size, so size it as one would to keep
    # the last answer regenerable. One cache for both runs: the warm run finds it full.
    item = torch.empty((), dtype=target.dtype).element_size()
    cache_bytes = (budget + 1) * tcfg.vocab_size * item
    pcache = PrefixCache(cache_bytes, dtype=target.dtype, pin=target.device.type == "cuda")
    strategy = TreeSpeculation(target, draft, budget=budget, prefix_cache=pcache)
    cold = _measure(strategy, context, budget, prefill_tokens, seed)
    warm = _measure(strategy, context, budget, prefill_tokens, seed + 1)
    rows = []
    for phase, planned, measured, seconds, notes in warm:
        cold_phase = next(c for c in cold if c[0] == phase)
        notes.update(cold_planned=cold_phase[1], cold_bytes=cold_phase[2])
        rows.append(
            Row(names[0], names[1], context, budget, phase, planned, measured, seconds, notes)
        )
    return rows


Measured = tuple[str, int, int | None, float, dict[str, Any]]  # phase, planned, bytes, s, notes


def _measure(
    strategy: TreeSpeculation, context: int, budget: int, prefill_tokens: int, seed: int
) -> list[Measured]:
    """One run of the four phases on a history drawn from `seed`: (phase, planned bytes,
    measured bytes, seconds, notes) each."""
    target, draft = strategy.target, strategy.draft
    assert draft is not None, "the bench drafts with a model"
    pcache = strategy.prefix_cache
    device, dtype = target.device, target.dtype
    tcfg, dcfg = target.config, draft.config
    hold = context - prefill_tokens  # the prefill chunk ends the context: the most keys
    found: list[Measured] = []

    gen = torch.Generator(device=device).manual_seed(seed)
    vocab = min(tcfg.vocab_size, dcfg.vocab_size)  # ids both models embed (Qwen's differ)
    history_ids = torch.randint(3, vocab, (context,), generator=gen, device=device).tolist()

    session = strategy.new_session(context)  # its small initial caches are replaced below
    t0 = time.perf_counter()
    with probe(device) as peak:
        tcache = full_cache(target, context, hold, gen)
        dcache = full_cache(draft, context, hold, gen)
        _sync(device)
    seconds = time.perf_counter() - t0
    session.target_cache, session.draft_cache = tcache, dcache
    session.target_tokens = list(history_ids[:hold])
    session.draft_tokens = list(history_ids[:hold])
    kv_plan = pass_plan(tcfg, dcfg, dtype, context, prefill_tokens, device=device.type)
    # Exact: the caches' allocated bytes against the plan's. The resident-set probe
    # resolves no better than a few pages (its reading is in the notes).
    found.append(
        ("kv", plan_figures(kv_plan)["kv"], tcache.nbytes + dcache.nbytes, seconds,
         {"probe_bytes": peak.bytes})
    )  # fmt: skip

    chunk = history_ids[hold:]
    t0 = time.perf_counter()
    with probe(device) as peak:  # the two passes run one after the other: max(target, draft)
        feed(target, tcache, session.target_tokens, chunk, chunk=len(chunk))
        feed(draft, dcache, session.draft_tokens, chunk, chunk=len(chunk))
        _sync(device)
    seconds = time.perf_counter() - t0
    prefill_planned = plan_figures(kv_plan)["activations"]
    found.append(("prefill", prefill_planned, peak.bytes, seconds, {"tokens": len(chunk)}))

    # The rounds' prompt: the history up to where the tree and the round's tokens fit.
    prompt_length = context - (budget + 1 + ROUND_TOKENS)
    for cache, fed in ((tcache, session.target_tokens), (dcache, session.draft_tokens)):
        cache.truncate(prompt_length)
        del fed[prompt_length:]

    tree_plan = pass_plan(
        tcfg, dcfg, dtype, context, budget + 1, budget + 1, pcache.max_bytes, device.type
    )
    tree_figures = plan_figures(tree_plan)
    root = int(torch.randint(3, vocab, (1,), generator=gen, device=device))
    prompt = [*history_ids[:prompt_length], root]
    for phase, sample_seed in (("tree", seed), ("regenerate", seed + 1)):
        session.reuse_prefix(prompt)  # the regenerate: back to the prompt, as a new request
        params = SamplingParams(temperature=1.0, seed=sample_seed)
        rounds = alone(
            strategy.steps(
                session, prompt, params, ROUND_TOKENS, make_generator(sample_seed, device)
            )
        )
        hits = pcache.stats.hits
        # What the round may add: its pass's activations, and the part of the planned
        # prefix cache that is not allocated yet (rows stored into it during the round).
        # With a GPU the cache is pinned host RAM, not a device part: the plan's figure for
        # it on the device is 0, and what it holds is not on the device either.
        held = pcache.held_bytes  # slot chunks and interned prefixes, within max_bytes
        cache_part = tree_figures["prefix_cache"]
        planned = tree_figures["activations"] + (cache_part - held if cache_part else 0)
        t0 = time.perf_counter()
        with probe(device) as peak:
            done = next(rounds)
            _sync(device)
        seconds = time.perf_counter() - t0
        rounds.close()
        found.append(
            (phase, planned, peak.bytes, seconds, {
                "tokens": len(done.tokens),
                "tree_nodes": done.stats.tree_nodes,
                "prefix_cache_hits": pcache.stats.hits - hits,
                "prefix_cache_held_bytes": held,
                "prefix_cache_bytes": pcache.allocated_bytes,
                "prefix_cache_planned": tree_figures["prefix_cache"],
            })
        )  # fmt: skip
    return found


# --- output ------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    return "n/a" if n is None else format_size(n)


def render(rows: list[Row]) -> str:
    head = (
        f"{'target/draft':<28} {'ctx':>6} {'budget':>6} {'phase':<10} {'planned':>10} "
        f"{'measured':>10} {'plan/meas':>9} {'goal':>4} {'seconds':>8}  notes"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.2f}"
        goal = "n/a" if r.within_goal is None else ("ok" if r.within_goal else "MISS")
        notes = ", ".join(
            f"{k}={_size(v) if k.endswith(('bytes', 'planned')) else v}" for k, v in r.notes.items()
        )
        lines.append(
            f"{r.target + '/' + r.draft:<28} {r.context:>6} {r.budget:>6} {r.phase:<10} "
            f"{_size(r.planned):>10} {_size(r.measured):>10} {ratio:>9} {goal:>4} "
            f"{r.seconds:>8.2f}  {notes}"
        )
    measured = [r for r in rows if r.measured is not None]
    bound = sum(bool(r.upper_bound) for r in measured)
    tight = sum(bool(r.within_goal) for r in measured)
    lines.append(
        f"plan is an upper bound in {bound}/{len(measured)} rows; within {TIGHTNESS:g}x of the "
        f"measured peak (goal) in {tight}/{len(measured)}"
    )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["kv", "prefill", "tree", "regenerate"]
    scenarios = sorted({(r.target, r.context, r.budget) for r in rows})
    fig, axes = plt.subplots(
        1, len(phases), figsize=(4.2 * len(phases), 1.2 + 0.45 * len(scenarios)), squeeze=False
    )
    for ax, phase in zip(axes[0], phases, strict=True):
        by = {(r.target, r.context, r.budget): r for r in rows if r.phase == phase}
        ys = range(len(scenarios))
        planned = [by[s].planned / 2**20 if s in by else 0 for s in scenarios]
        measured = [(by[s].measured or 0) / 2**20 if s in by else 0 for s in scenarios]
        ax.barh([y + 0.2 for y in ys], planned, height=0.4, label="planned", color="tab:blue")
        ax.barh([y - 0.2 for y in ys], measured, height=0.4, label="measured", color="tab:red")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(
            [f"{t} ctx {c} B {b}" for t, c, b in scenarios] if phase == "kv" else [""] * len(ys)
        )
        ax.set_xlim(left=0)
        ax.set_xlabel("MiB")
        ax.set_title(phase)
    axes[0][0].legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if any")
    ap.add_argument(
        "--presets",
        default="all",
        help=f"targets, comma-separated, or 'all' ({', '.join(PAIRS)}); each runs with its draft",
    )
    ap.add_argument(
        "--budgets", default=None, help="tree budgets (default 64,256,1024; cpu 64,256)"
    )
    ap.add_argument("--contexts", default=None, help="default 4096,32768 (cpu: 2048,4096)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="bf16 cuda, fp32 cpu")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="chunk (2048; cpu 256)")
    ap.add_argument(
        "--hidden-scale", type=float, default=None, help="width factor (1 cuda; cpu 1/32)"
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = device.type == "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu:
        fix_heap()
    targets = list(PAIRS) if args.presets == "all" else args.presets.split(",")
    unknown = [t for t in targets if t not in PAIRS]
    if unknown:
        sys.exit(f"unknown target preset(s) {unknown}; choose from {', '.join(PAIRS)} or all")
    budgets = _ints(args.budgets or ("64,256" if cpu else "64,256,1024"))
    contexts = _ints(args.contexts or ("2048,4096" if cpu else "4096,32768"))
    dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    prefill = args.prefill_tokens or (256 if cpu else 2048)
    scale = args.hidden_scale or (1 / 32 if cpu else 1.0)

    rows: list[Row] = []
    for name in targets:
        draft_name = PAIRS[name]
        tcfg = model_config(name, args.layers, scale)
        dcfg = model_config(draft_name, args.layers, scale)
        models = (
            build_model(tcfg, dtype, device, seed=args.seed),
            build_model(dcfg, dtype, device, seed=args.seed + 1),
        )
        for context in contexts:
            for budget in budgets:
                found = run_scenario(
                    (name, draft_name), models, context, budget, prefill, args.seed
                )
                for r in found:
                    print(render([r]).splitlines()[2], flush=True)
                rows += found
        del models
    title = (
        f"{device.type} {str(dtype).removeprefix('torch.')}, {args.layers} layer(s), "
        f"hidden x{scale:.3g}, prefill chunk {prefill}"
    )
    print()
    print(title)
    print(render(rows))
    if args.json:
        meta = {
            "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": str(dtype).removeprefix("torch."),
            "layers": args.layers,
            "hidden_scale": scale,
            "prefill_tokens": prefill,
            "torch": torch.__version__,
            "goal": f"1 <= planned/measured <= {TIGHTNESS}",
        }
        args.json.write_text(json.dumps({**meta, "rows": [r.to_dict() for r in rows]}, indent=2))
    if args.plot:
        plot(rows, args.plot, title)


if __name__ == "__main__":
    main()
