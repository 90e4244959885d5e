"""What a grammar does to speculative decoding, on the shared pair: free text, a JSON
schema, json_object and a required tool call, side by side, under tree speculation and
linear chains, at T = 0 and T = 1.

Each answer is a `Generation` of the stories260k target with the stories260k-draft (the
library, as the daemon runs a request: `Constraint` from the request's grammar, masked
draft rows, masked verification, forced tokens emitted without a pass). Reported per cell,
summed over prompts and samples:

- tokens per target pass (decode passes; prefill not counted): what pays on a streamed
  target, whose pass costs the weight transfer whatever it carries. Forced tokens (the
  grammar allows one token alone: braces, key names, the call tags) ride in the next pass,
  so they raise it. Only those at the start of a round count as forced: a chain or tree
  that drafts through a forced position has it accepted instead (the masked draft row and
  the masked target row both allow that token alone);
- acceptance: accepted / drafted tokens (a tree's drafted tokens are its nodes besides the
  root, so a wide tree accepts a smaller share of what it drafted than a chain);
- forced tokens per answer, tokens per answer, and whether the answers are complete (ended
  by the grammar and parse as what was asked: JSON, the schema's keys, a call to a listed
  function with JSON arguments). The stories model never writes its end of sequence, so
  free text always runs to max_tokens, and json_object answers are stories inside a key;
- grammar work per answer: the masks the engine computed (one per committed state and per
  visited draft node) and the milliseconds spent in the request's `Constraint` (making its
  matcher, masks, moving between nodes, commits, forced tokens); applying the masks to the
  logits is tensor work and not in it. Answer ms is the whole generation, for scale (tiny
  models on a CPU: per-call overhead, not what a real target would spend).

Requests carry seeds (0, 1, ... per prompt), so sampled runs repeat; `auto` verification
walks a seeded request (its text is then autoregressive decoding's for that seed): pass
`--verification rejection` to compare. Every tree cell starts with a fresh acceptance model
and no prefix cache, so cells do not depend on the order they run in.

    .venv/bin/python scripts/bench_structured.py                  # docs/structured-output.md's table
    .venv/bin/python scripts/bench_structured.py --seeds 8 --strategies tree:16,tree:64,tree:256,linear:4,linear:16
    .venv/bin/python scripts/bench_structured.py --modes free,tool --temperatures 1 --verification rejection
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.options import RuntimeOptions  # noqa: E402
from daemon.runtime import Runtime, linear_drafter  # noqa: E402
from scripts.bench_speculative import PROMPTS  # noqa: E402
from speculative.acceptance import AcceptanceModel  # noqa: E402
from speculative.generation import Generation  # noqa: E402
from speculative.grammar import Constraint, Grammar  # noqa: E402
from speculative.prefix_cache import PrefixCache  # noqa: E402
from speculative.rounds import Strategy  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.linear import Linear  # noqa: E402
from speculative.strategies.tree import TreeSpeculation  # noqa: E402
from speculative.tool_calls import HERMES, Tool, read_answer, tool_grammar  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"
MODES = ("free", "json_schema", "json_object", "tool")
# tests/test_structured.py's schema: a name, a bounded integer, an enum, a short list.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["dog", "cat", "bird"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "pet", "friends"],
    "additionalProperties": False,
}
# Two functions, so the name is the model's choice after the shared `{"name":"`.
TOOLS = (
    Tool(
        "get_weather",
        "The weather in a city",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "find_pet",
        "Find a lost pet",
        {
            "type": "object",
            "properties": {
                "kind": {"enum": ["dog", "cat", "bird"]},
                "days": {"type": "integer", "minimum": 0, "maximum": 30},
            },
            "required": ["kind", "days"],
            "additionalProperties": False,
        },
    ),
)


def grammar_for(mode: str) -> Grammar | None:
    """The request's grammar in `mode`, as the daemon builds it from the request."""
    if mode == "free":
        return None
    if mode == "json_schema":
        return Grammar.json_schema(SCHEMA, "response_format.json_schema.schema", "story")
    if mode == "json_object":
        return Grammar.json_object("response_format")
    if mode == "tool":
        return tool_grammar(HERMES, TOOLS, "required", parallel=False, field="tools")
    raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")


def complete(mode: str, gen: Generation) -> bool:
    """The grammar ended the answer and it reads as what the mode asked for."""
    if gen.finish_reason != "stop":
        return False
    if mode == "free":
        return True
    if mode == "tool":
        content, calls = read_answer(gen.text, HERMES)
        names = {t.name for t in TOOLS}
        return (
            not content
            and len(calls) == 1
            and calls[0].name in names
            and _is_object(calls[0].arguments)
        )
    if not _is_object(gen.text):
        return False
    return mode == "json_object" or set(json.loads(gen.text)) == set(SCHEMA["required"])


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class TimedConstraint(Constraint):
    """A request's Constraint that counts the masks it computes and the seconds spent in
    it (its public methods, its construction included: the first mask is made there)."""

    def __init__(self, grammar: Grammar, tokenizer: Any, width: int) -> None:
        self.seconds = 0.0
        self.mask_count = 0
        t0 = time.perf_counter()
        super().__init__(grammar, tokenizer, width)
        self.seconds += time.perf_counter() - t0

    def _compute(self) -> torch.Tensor:
        self.mask_count += 1
        return super()._compute()

    def words(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return super().words()
        finally:
            self.seconds += time.perf_counter() - t0

    def masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return super().masks(paths)
        finally:
            self.seconds += time.perf_counter() - t0

    def commit(self, tokens: Sequence[int]) -> None:
        t0 = time.perf_counter()
        try:
            super().commit(tokens)
        finally:
            self.seconds += time.perf_counter() - t0

    def take_forced(self, limit: int) -> list[int]:
        t0 = time.perf_counter()
        try:
            return super().take_forced(limit)
        finally:
            self.seconds += time.perf_counter() - t0

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        t0 = time.perf_counter()
        try:
            return super().valid_prefix(tokens)
        finally:
            self.seconds += time.perf_counter() - t0


@dataclass
class Cell:
    """One (mode, strategy, temperature): sums over its answers."""

    mode: str
    strategy: str
    temperature: float
    answers: int = 0
    tokens: int = 0
    passes: int = 0  # decode target passes
    drafted: int = 0
    accepted: int = 0
    forced: int = 0
    masks: int = 0
    grammar_seconds: float = 0.0
    seconds: float = 0.0
    complete: int = 0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / max(self.passes, 1)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def per_answer(self, total: float) -> float:
        return total / max(self.answers, 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "tokens_per_pass": self.tokens_per_pass,
            "acceptance": self.acceptance,
        }


def build_strategy(rt: Runtime, spec: str, verification: str) -> Strategy:
    """`tree:B` (budget B) or `linear:K` (K drafted tokens a round), with the runtime's
    draft; a tree gets its own acceptance model and no prefix cache."""
    kind, _, size = spec.partition(":")
    if kind == "tree":
        return TreeSpeculation(
            rt.target, rt.draft, budget=int(size), prefix_cache=PrefixCache(0),
            verification=verification, acceptance=AcceptanceModel(),
        )  # fmt: skip
    if kind == "linear":
        return Linear(rt.target, linear_drafter(rt), int(size or 4))
    if kind == "autoregressive":
        return rt.strategy("autoregressive")
    raise SystemExit(f"strategy {spec!r}: tree:B, linear:K or autoregressive")


def run_cell(
    rt: Runtime,
    cell: Cell,
    strategy: Strategy,
    grammar: Grammar | None,
    prompts: list[list[int]],
    seeds: int,
    max_tokens: int,
) -> None:
    for ids in prompts:
        for seed in range(seeds):
            params = SamplingParams(temperature=cell.temperature, seed=seed)
            constraint = (
                TimedConstraint(grammar, rt.tokenizer, rt.target.vocab_width)
                if grammar is not None
                else None
            )
            gen = Generation(
                strategy, rt.new_session(strategy), rt.tokenizer, ids, params, max_tokens,
                constraint=constraint,
            ).run()  # fmt: skip
            st = gen.stats
            cell.answers += 1
            cell.tokens += st.generated_tokens
            cell.passes += st.decode_passes
            cell.drafted += st.drafted
            cell.accepted += st.accepted
            cell.forced += st.forced_tokens
            cell.seconds += st.total_seconds
            cell.complete += int(complete(cell.mode, gen))
            if constraint is not None:
                cell.masks += constraint.mask_count
                cell.grammar_seconds += constraint.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--target", type=Path, default=SHARED / "stories260k")
    ap.add_argument("--draft", type=Path, default=SHARED / "stories260k-draft")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--strategies", default="tree:16,tree:64,linear:4")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--seeds", type=int, default=4, help="samples per prompt (T > 0)")
    ap.add_argument("--tokens", type=int, default=120, help="max_tokens of each answer")
    ap.add_argument("--verification", default="auto", choices=("auto", "walk", "rejection"))
    ap.add_argument("--json", type=Path, default=ROOT / "bench-results" / "structured.json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rt = Runtime(
        RuntimeOptions(
            model=str(args.target), draft=str(args.draft), device="cpu", threads=1,
            prefix_cache=0,
        )
    )  # fmt: skip
    prompts = [rt.tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    modes = args.modes.split(",")
    grammars = {mode: grammar_for(mode) for mode in modes}
    for grammar in grammars.values():
        if grammar is not None:
            grammar.check(rt.tokenizer)  # as the daemon does before queueing
    print(
        f"{len(prompts)} prompts ({args.seeds} samples each at T > 0), max_tokens {args.tokens}, "
        f"verification {args.verification}; per answer: forced tokens, masks, grammar ms\n"
        "| mode | strategy | T | tok/pass | vs free | acceptance | tok/answer | forced/answer "
        "| masks/answer | grammar ms/answer | answer ms | complete |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    t_start = time.perf_counter()
    cells: list[Cell] = []
    free: dict[tuple[str, float], float] = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        seeds = 1 if SamplingParams(temperature=temperature).greedy else args.seeds
        for spec in args.strategies.split(","):
            for mode in modes:
                cell = Cell(mode, spec, temperature)
                strategy = build_strategy(rt, spec, args.verification)
                run_cell(rt, cell, strategy, grammars[mode], prompts, seeds, args.tokens)
                cells.append(cell)
                if mode == "free":
                    free[spec, temperature] = cell.tokens_per_pass
                base = free.get((spec, temperature))
                ratio = f"{cell.tokens_per_pass / base:.2f}x" if base else "-"
                acc = "-" if cell.acceptance is None else f"{cell.acceptance:.2f}"
                done = f"{cell.complete}/{cell.answers}" if mode != "free" else "-"
                grammar_ms = (
                    f"{cell.per_answer(cell.grammar_seconds) * 1e3:.1f}" if mode != "free" else "-"
                )
                print(
                    f"| {mode} | {spec} | {temperature:g} | {cell.tokens_per_pass:.2f} | {ratio} "
                    f"| {acc} | {cell.per_answer(cell.tokens):.1f} "
                    f"| {cell.per_answer(cell.forced):.1f} | {cell.per_answer(cell.masks):.0f} "
                    f"| {grammar_ms} | {cell.per_answer(cell.seconds) * 1e3:.0f} "
                    f"| {done} |",
                    flush=True,
                )
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(cells)} cells in {elapsed:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) for k, v in vars(args).items()}
    args.json.write_text(
        json.dumps({"args": meta, "seconds": elapsed, "cells": [c.as_dict() for c in cells]},
                   indent=1)
    )  # fmt: skip


if __name__ == "__main__":
    main()
