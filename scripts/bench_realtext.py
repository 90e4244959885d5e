"""Speculation on real text: tokens per target pass on MT-Bench (per category) and
HumanEval, first turn through the model's chat template, for SmolLM2-135M-Instruct (the
shared real chat model) and the stories pair for contrast, at T=0 and T=1; then what that
means in tokens per second for the `config/profiles/` targets.

Drafts: the substitute at 2, 3, 4 and 8 bits with every layer a low-bit copy (the target
streamed: `--offload stream --resident-layers 0`, so each layer has its copy), n-gram
prompt lookup, and optionally the target's own int8/int4 copy (`--drafts int8,int4`, on
the F32 form of SmolLM2: scripts/real_forms.py). Per (draft, T, category): a tree at the
budget (cold: a fresh acceptance model for every prompt, no learned file, which is what a
first `specd generate` sees) and linear chains of the same draft; tokens per target pass,
draft passes per target pass, acceptance (accepted / drafted), and the tree against the
best chain.

The projection: a streamed target's pass costs its transfer (`specd plan`'s bytes streamed
per pass / the profile's bus rate, `bandwidth` below); a round costs that plus the draft
passes it ran at a step cost (`--draft-step-ms`, assumed unless measured on a GPU); so
tokens/s = tokens per pass / (pass seconds + draft passes per pass x step). Plain decoding
is 1 / pass seconds.

On a GPU (`--device cuda --timed`, issue 35's GPU item; scripts/gpu_checks.sh runs it
with `--compile on`, the drafts' steps compiled as the daemon's --compile on does):
every draft's target streamed (`--offload stream --resident-layers 0`, `--gpu-budget`),
the substitute's packed steps as they run (on a CPU they are rebuilt to dense once, since
there only tokens per pass are measured), and each cell also decoded plainly by the same
streamed target; tokens per second of the tree, the best chain and plain decoding, from
the rounds after each prompt's prefill, against the projection's
formula fed with this run's own parts: tree tokens per pass / (the plain pass's seconds +
the tree's draft passes per pass x one draft pass's seconds, from the best chain's run).

    .venv/bin/python scripts/bench_realtext.py                      # docs/measurements.md's table
    .venv/bin/python scripts/bench_realtext.py --drafts sub4 --temperatures 0 --per-category 1
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

from daemon.options import RuntimeOptions  # noqa: E402
from daemon.runtime import Runtime, linear_drafter  # noqa: E402
from modeling.weights.projections import dequantize_projections  # noqa: E402
from scripts.pypi_models import Unavailable  # noqa: E402
from scripts.real_forms import SMOLLM2_GGUF, smollm2_f32  # noqa: E402
from scripts.realtext_data import human_eval, mt_bench  # noqa: E402
from speculative.passes import alone  # noqa: E402
from speculative.rounds import Strategy  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402
from speculative.strategies.linear import Linear  # noqa: E402

SHARED = ROOT.parent / "shared" / "models"
DRAFTS = ("sub2", "sub3", "sub4", "sub8", "ngram")
PROFILES = ROOT / "config" / "profiles"


def draft_options(
    name: str,
    model: str,
    substitute_cache: Path,
    context: int,
    device: str = "cpu",
    gpu_budget: str = "auto",
    compile: str = "off",
) -> RuntimeOptions:
    """The runtime of one draft kind: the substitute with every layer streamed (so every
    layer has a low-bit copy), n-gram, or the target's own int8/int4 copy. On a GPU every
    kind's target streams (what the timed figures are about). `compile`: "on" compiles
    what --compile on does (the draft's steps; a streamed target runs eager)."""
    common: dict[str, Any] = {
        "device": device, "context": context, "prefix_cache": 0, "compile": compile
    }  # fmt: skip
    if device != "cpu":
        common.update(offload="stream", resident_layers=0, gpu_budget=gpu_budget)
    if name.startswith("sub"):
        common.update(offload="stream", resident_layers=0)
        return RuntimeOptions(
            model=model, draft="substitute", substitute_bits=int(name[3:]),
            substitute_cache=str(substitute_cache), **common,
        )  # fmt: skip
    if name == "ngram":
        return RuntimeOptions(model=model, draft="ngram", **common)
    if name in ("int8", "int4"):
        return RuntimeOptions(model=model, draft=model, draft_quantize=name, **common)
    if name == "trained":
        return RuntimeOptions(model=model, draft=str(SHARED / "stories260k-draft"), **common)
    raise SystemExit(f"unknown draft {name!r}")


def prompts(tokenizer: Any, per_category: int, humaneval: int) -> dict[str, list[list[int]]]:
    """Prompt ids per cell: MT-Bench's first turns per category and HumanEval's prompts,
    through the chat template when the model has one (else as plain text)."""
    cells: dict[str, list[str]] = {}
    for q in mt_bench():
        cell = cells.setdefault(q["category"], [])
        if len(cell) < per_category:
            cell.append(q["turns"][0])
    cells["humaneval"] = [
        "Complete this Python function:\n\n" + p["prompt"] for p in human_eval()[:humaneval]
    ]

    def ids(text: str) -> list[int]:
        if tokenizer.has_chat_template:
            return tokenizer.encode_chat([{"role": "user", "content": text}])
        return tokenizer.encode(text)

    return {name: [ids(t) for t in texts] for name, texts in cells.items()}


def run(
    rt: Runtime,
    make: Any,
    ids: list[list[int]],
    params: SamplingParams,
    tokens: int,
    seeds: int,
) -> dict[str, float]:
    """Sums over the prompts (each `seeds` times, a fresh strategy from `make()` and a fresh
    session each: cold). `timed_tokens` and `timed_seconds` count the rounds after the
    prompt's prefill (a round that holds prefill passes is left out); `timed_passes` are
    those rounds' target passes."""
    out = {"tokens": 0, "passes": 0, "draft_passes": 0, "drafted": 0, "accepted": 0,
           "seconds": 0.0, "timed_tokens": 0, "timed_seconds": 0.0, "timed_passes": 0,
           "timed_draft_passes": 0}  # fmt: skip
    for i, prompt in enumerate(ids):
        for s in range(seeds):
            rt.acceptance.tables.clear()  # cold: nothing learned from the prompts before
            strategy: Strategy = make()
            session = strategy.new_session(rt.context)
            generator = torch.Generator().manual_seed(1000 * i + s)
            t0 = time.perf_counter()
            first_end = None
            for rnd in alone(strategy.steps(session, prompt, params, tokens, generator)):
                st = rnd.stats
                out["tokens"] += len(rnd.tokens)
                out["passes"] += st.target_passes - st.prefill_passes
                out["draft_passes"] += st.draft_passes
                out["drafted"] += st.drafted
                out["accepted"] += st.accepted
                if st.prefill_passes:  # (the prompt's passes lead; none is timed)
                    synchronize()
                    first_end = time.perf_counter()
                    continue
                out["timed_tokens"] += len(rnd.tokens)
                out["timed_passes"] += st.target_passes - st.prefill_passes
                out["timed_draft_passes"] += st.draft_passes
            synchronize()
            end = time.perf_counter()
            out["seconds"] += end - t0
            out["timed_seconds"] += end - (first_end or end)
    passes = max(out["passes"], 1)
    out["tokens_per_pass"] = out["tokens"] / passes
    out["draft_passes_per_pass"] = out["draft_passes"] / passes
    out["acceptance"] = out["accepted"] / max(out["drafted"], 1)
    return out


# What a cell's runs add up to in the "all" row.
SUMMED = ("tokens", "passes", "draft_passes", "drafted", "accepted", "seconds", "timed_tokens",
          "timed_seconds", "timed_passes", "timed_draft_passes")  # fmt: skip


def synchronize() -> None:
    """Wait for the GPU's queued work (a round's tokens are on the host when it ends, but
    a timed interval should not end on work still in flight)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def rate(run: dict[str, float]) -> float:
    """Tokens per second of a run's timed rounds (0 where none was timed)."""
    return run["timed_tokens"] / run["timed_seconds"] if run["timed_seconds"] else 0.0


def timed_figures(
    tree: dict[str, float], chains: dict[str, dict[str, float]], plain: dict[str, float]
) -> dict[str, float]:
    """Measured tokens/s of the tree, the best chain (by tokens/s) and plain decoding, and
    the projection's formula with this run's parts: a plain pass's seconds, one draft
    pass's seconds (the best chain's seconds beyond its target passes, per draft pass)."""
    pass_s = plain["timed_seconds"] / max(plain["timed_passes"], 1)
    best = max(chains.values(), key=rate)
    spare = best["timed_seconds"] - best["timed_passes"] * pass_s
    step_s = max(spare, 0.0) / best["timed_draft_passes"] if best["timed_draft_passes"] else 0.0
    passes = max(tree["timed_passes"], 1)
    projected = (tree["timed_tokens"] / passes) / (
        pass_s + tree["timed_draft_passes"] / passes * step_s
    )
    return {
        "plain_tok_s": rate(plain), "tree_tok_s": rate(tree), "best_chain_tok_s": rate(best),
        "pass_ms": pass_s * 1e3, "draft_step_ms": step_s * 1e3, "projected_tree_tok_s": projected,
    }  # fmt: skip


# A profile's target and draft as the shapes of their published configs (scripts/real_shapes.py):
# planned from config.json alone, nothing downloaded.
PROFILE_SHAPES = {
    "Qwen/Qwen2.5-14B-Instruct": "qwen2.5-14b",
    "Qwen/Qwen2.5-32B-Instruct": "qwen2.5-32b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
}


def plan_json(profile: Path, shape: Path, draft: str, bits: int | None, bus: str) -> dict[str, Any]:
    """`specd plan --json` for a profile with its target replaced by a config-only folder
    of the same shape and the draft measured here."""
    import subprocess

    command = [
        sys.executable, "-m", "daemon.cli", "plan", "--config", str(profile), "--model",
        str(shape), "--draft", draft, "--ram-budget", "128GB", "--bandwidth", bus, "--json",
    ]  # fmt: skip
    if bits is not None:
        command += ["--substitute-bits", str(bits)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(done.stdout)


def projection(rows: list[dict[str, Any]], bus: str, gpu_rate: float) -> list[str]:
    """Tokens/s for each GPU profile's target: a round costs the plan's seconds per pass
    (the streamed bytes at the bus rate `bus`) plus its draft passes, each reading the
    draft's weights once at `gpu_rate` bytes/s (assumed: no GPU measured here); with the
    tokens and draft passes per pass measured above, for each draft at each temperature,
    the best shown."""
    import tempfile

    import yaml

    from scripts.real_shapes import full_config, hf_config

    lines = [
        "| profile | target | streamed per pass | pass s | plain tok/s | T | best draft "
        "| tok/pass | draft passes/pass | draft pass ms | projected tok/s | × plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # SmolLM2's rows only: the stories pair is there for contrast, not as a real text's rate.
    summary = [r for r in rows if r["cell"] == "all" and r.get("model", "smollm2") == "smollm2"]
    with tempfile.TemporaryDirectory() as scratch:
        for path in sorted(PROFILES.glob("gpu-*.yaml")):
            target = yaml.safe_load(path.read_text())["models"]["target"]
            shape = Path(scratch) / PROFILE_SHAPES[target]
            shape.mkdir(exist_ok=True)
            (shape / "config.json").write_text(
                json.dumps(hf_config(full_config(PROFILE_SHAPES[target])))
            )
            for temperature in sorted({r["temperature"] for r in summary}):
                best: tuple[float, str] | None = None
                for r in (r for r in summary if r["temperature"] == temperature):
                    bits = int(r["draft"][3:]) if r["draft"].startswith("sub") else None
                    kind = "substitute" if bits else r["draft"]
                    if kind not in ("substitute", "ngram"):
                        continue  # (the int copies were measured on another target)
                    try:
                        plan = plan_json(path, shape, kind, bits, bus)
                    except RuntimeError:
                        continue  # (this draft does not fit this profile's card)
                    pass_s = plan["seconds_per_pass"] or 0.0
                    if not pass_s:
                        continue  # nothing streams: not a transfer-bound pass
                    step_s = plan["device_parts"].get("draft weights", 0) / gpu_rate
                    tree = r["tree"]
                    rate = tree["tokens_per_pass"] / (
                        pass_s + tree["draft_passes_per_pass"] * step_s
                    )
                    text = (
                        f"| {path.stem} | {target} | "
                        f"{plan['streamed_bytes_per_pass'] / 2**30:.1f} GiB | {pass_s:.2f} "
                        f"| {1 / pass_s:.2f} | {temperature:g} | {r['draft']} "
                        f"| {tree['tokens_per_pass']:.1f} | {tree['draft_passes_per_pass']:.1f} "
                        f"| {step_s * 1e3:.1f} | {rate:.2f} | {rate * pass_s:.1f} |"
                    )
                    if best is None or rate > best[0]:
                        best = (rate, text)
                if best is not None:
                    lines.append(best[1])
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default="smollm2", help="smollm2 | stories | a model path")
    ap.add_argument("--drafts", default=",".join(DRAFTS))
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--chains", default="16,64", help="linear chain lengths to compare")
    ap.add_argument("--per-category", type=int, default=1, help="MT-Bench prompts per category")
    ap.add_argument("--humaneval", type=int, default=2, help="HumanEval prompts")
    ap.add_argument("--tree-verification", default="auto", choices=("auto", "walk", "rejection"))
    ap.add_argument("--cells", default="", help="only these cells (e.g. writing,humaneval)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=1, help="samples per prompt at T > 0")
    ap.add_argument(
        "--bus",
        default="25GB/s",
        help="the projection's host-to-GPU rate (PCIe 4.0 x16 as measured on desktops)",
    )
    ap.add_argument("--gpu-rate", default="300GB/s",
                    help="the projection's rate at which a draft pass reads its weights on the "
                    "card (assumed: about half a desktop card's memory bandwidth)")  # fmt: skip
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--projection-from", type=Path, nargs="*", default=[],
                    help="measure nothing: the table and projection of these runs' JSON")  # fmt: skip
    ap.add_argument("--substitute-cache", type=Path,
                    default=Path.home() / ".cache" / "specd" / "bench-substitutes")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu | cuda (every target streamed there)")
    ap.add_argument("--gpu-budget", default="auto", help="on a GPU: its budget (e.g. 256MB)")
    ap.add_argument("--compile", default="off", choices=("off", "on"),
                    help="compile the drafts' steps as --compile on does (timed runs)")  # fmt: skip
    ap.add_argument("--timed", action="store_true",
                    help="also plain decoding per cell, and tokens/s (meaningful on a GPU)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=ROOT / "bench-results" / "realtext.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    drafts = args.drafts.split(",")
    context = 2048
    if args.model == "smollm2":
        # Its F32 form (scripts/real_forms.py: the Q4_1 file's own values as F32) is the
        # target where it can be made: the same logits to float rounding, so the same tokens
        # per pass, but a tree's 65-token pass is one BLAS product a projection where the
        # Q4_1 blocks past the CPU kernels' few rows are rebuilt every pass (several times
        # slower). The substitutes quantize the same values either way.
        model = str(SMOLLM2_GGUF)
        try:
            model = str(smollm2_f32())
        except Unavailable as err:
            if {"int8", "int4"} & set(drafts):  # the aligned int copies need full precision
                raise SystemExit(f"int8/int4 drafts need SmolLM2's F32 form: {err}") from None
    elif args.model == "stories":
        model, context = str(SHARED / "stories260k"), 512  # its whole context
    else:
        model = args.model
    chains = [int(k) for k in args.chains.split(",")]
    rows: list[dict[str, Any]] = []
    print(
        f"{Path(model).name}: budget {args.budget}, chains {chains}, {args.tokens} tokens, "
        f"{args.per_category} MT-Bench prompt(s) per category, {args.humaneval} HumanEval, "
        f"cold trees\n| model | draft | T | cell | tree tok/pass | " + " | ".join(f"K={k}" for k in chains)
        + " | tree / best chain | draft passes / pass | acceptance |\n|"
        + "---|" * (8 + len(chains)),
        flush=True,
    )  # fmt: skip
    for name in drafts if not args.projection_from else []:
        options = draft_options(
            name, model, args.substitute_cache, context, args.device, args.gpu_budget, args.compile
        )
        rt = Runtime(options)
        if args.compile == "on":  # before the first cell, as a daemon warms before serving
            compilation = rt.compile(serving=True)
            compilation.warm(lambda line: print(f"  {line}", flush=True))
            print(f"  compiled: {compilation.to_dict()}", flush=True)
        rows += measure(rt, name, args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=1))  # each draft as it ends
    for path in args.projection_from:
        rows += json.loads(path.read_text())["rows"]
    for r in rows if args.projection_from else []:
        print(line(r, chains))
    print("\n" + "\n".join(cells_table(rows)))
    if any("timed" in r for r in rows):
        print("\n" + "\n".join(timed_table(rows)))
    worst = min(rows, key=lambda r: r["tree_over_best_chain"])
    print(
        f"\nworst cell: {worst['draft']} T={worst['temperature']:g} {worst['cell']}: "
        f"tree {worst['tree_over_best_chain']:.2f}x the best chain"
    )
    table: list[str] = []
    if not args.no_projection:
        from offload.units import parse_size

        table = projection(rows, args.bus, parse_size(args.gpu_rate.removesuffix("/s")))
        print(f"\nprojection (bus {args.bus}, draft weights read at {args.gpu_rate}):")
        print("\n".join(table))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                     "rows": rows, "projection": table}, indent=1))  # fmt: skip


def measure(rt: Runtime, name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every cell of one draft: per temperature and prompt cell, the cold tree and each
    chain; then the cells together ("all")."""
    chains = [int(k) for k in args.chains.split(",")]
    cells = prompts(rt.tokenizer, args.per_category, args.humaneval)
    if args.cells:
        wanted = args.cells.split(",")
        unknown = sorted(set(wanted) - set(cells))
        if unknown:
            raise SystemExit(f"--cells: no cell {unknown} (cells: {', '.join(cells)})")
        cells = {name: cells[name] for name in wanted}
    # A prompt the context cannot hold with a tree beyond it is left out, saying so (the
    # stories model's 512 positions against a long HumanEval prompt); one that fits ends
    # its text where the context does.
    room = rt.context - args.budget - 2
    for cell, ids in cells.items():
        kept = [p for p in ids if len(p) <= room]
        if len(kept) < len(ids):
            print(f"{cell}: {len(ids) - len(kept)} prompt(s) longer than {room} tokens left out")
        cells[cell] = kept
    cells = {cell: ids for cell, ids in cells.items() if ids}
    rows: list[dict[str, Any]] = []
    # (a compiled draft keeps its packed layers: its graphs were traced over them)
    dense_once = args.device == "cpu" and args.compile == "off"
    if rt.draft is not None and rt.draft_kind == "substitute" and dense_once:
        # The substitute's layers rebuilt to dense once (the same weights: what it drafts is
        # unchanged, to float rounding), so that its CPU passes cost 36 ms, not 153: this
        # measures tokens per pass; the packed pass's speed is issue 36's.
        rt.draft.dequantize_layers()
    elif rt.draft is not None and name in ("int8", "int4") and dense_once:
        # Likewise the target's int8/int4 copy: its packed projections rebuilt to dense once
        # (its drafts unchanged, to float rounding), 4x fewer seconds a draft pass.
        for module in list(rt.draft.modules()):
            dequantize_projections(module, torch.float32)
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = SamplingParams(temperature=temperature)
        seeds = 1 if params.greedy else args.seeds
        totals: dict[str, dict[str, float]] = {}
        for cell, ids in cells.items():
            got = {
                "tree": run(rt, lambda: rt.strategy("tree", budget=args.budget,
                                                    verification=args.tree_verification),
                            ids, params, args.tokens, seeds),
                **{f"K={k}": run(rt, lambda k=k: Linear(rt.target, linear_drafter(rt), k),
                                 ids, params, args.tokens, seeds) for k in chains},
            }  # fmt: skip
            timed = None
            if args.timed:  # the same streamed target alone, the same prompts and seeds
                plain = run(rt, lambda: rt.strategy("autoregressive"), ids, params,
                            args.tokens, seeds)  # fmt: skip
                chains_only = {k: v for k, v in got.items() if k != "tree"}
                timed = timed_figures(got["tree"], chains_only, plain)
            for key, value in [*got.items(), *([("plain", plain)] if args.timed else [])]:
                total = totals.setdefault(key, dict.fromkeys(value, 0.0))
                for field in SUMMED:
                    total[field] += value[field]
            rows.append({"model": args.model, **row(name, temperature, cell, got, rt)})
            if timed is not None:
                rows[-1]["timed"] = timed
            print(line(rows[-1], chains), flush=True)
        for total in totals.values():
            passes = max(total["passes"], 1)
            total["tokens_per_pass"] = total["tokens"] / passes
            total["draft_passes_per_pass"] = total["draft_passes"] / passes
            total["acceptance"] = total["accepted"] / max(total["drafted"], 1)
        plain_total = totals.pop("plain", None)
        rows.append({"model": args.model, **row(name, temperature, "all", totals, rt)})
        if plain_total is not None:
            chains_only = {k: v for k, v in totals.items() if k != "tree"}
            rows[-1]["timed"] = timed_figures(rows[-1]["tree"], chains_only, plain_total)
        print(line(rows[-1], chains), flush=True)
    return rows


def row(
    draft: str, temperature: float, cell: str, got: dict[str, dict[str, float]], rt: Runtime
) -> dict[str, Any]:
    tree = got.pop("tree")
    best = max(c["tokens_per_pass"] for c in got.values())
    return {
        "draft": draft,
        "temperature": temperature,
        "cell": cell,
        "substitute_layers": rt.substitute_layers,
        "tree": tree,
        "chains": got,
        "tree_over_best_chain": tree["tokens_per_pass"] / best,
    }


def cells_table(rows: list[dict[str, Any]]) -> list[str]:
    """docs/measurements.md's table: a line per (model, draft, T), a column per cell, each
    the tree over the best chain with (tree / best chain) tokens per pass; "—" where a cell
    did not run."""
    cells: list[str] = []
    for r in rows:
        if r["cell"] not in cells:
            cells.append(r["cell"])
    cells = [c for c in cells if c != "all"] + ["all"]
    keyed: dict[tuple[str, str, float], dict[str, str]] = {}
    for r in rows:
        best = max(c["tokens_per_pass"] for c in r["chains"].values())
        key = (r.get("model", "smollm2"), r["draft"], r["temperature"])
        keyed.setdefault(key, {})[r["cell"]] = (
            f"{r['tree_over_best_chain']:.2f} ({r['tree']['tokens_per_pass']:.1f}/{best:.1f})"
        )
    out = [
        "| model | draft | T | " + " | ".join(cells) + " |",
        "|---|---|---|" + "---|" * len(cells),
    ]
    for (model, draft, temperature), got in keyed.items():
        out.append(
            f"| {model} | {draft} | {temperature:g} | "
            + " | ".join(got.get(c, "—") for c in cells)
            + " |"
        )
    return out


def timed_table(rows: list[dict[str, Any]]) -> list[str]:
    """The timed cells (`--timed`): measured tokens/s against plain decoding and against
    the projection's formula with the run's own pass and draft-step times."""
    out = [
        "| model | draft | T | cell | plain tok/s | tree tok/s | best chain tok/s | tree x plain "
        "| pass ms | draft step ms | projected tree tok/s | measured / projected |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.get("timed")
        if t is None:
            continue
        over = t["tree_tok_s"] / t["plain_tok_s"] if t["plain_tok_s"] else 0.0
        fit = t["tree_tok_s"] / t["projected_tree_tok_s"] if t["projected_tree_tok_s"] else 0.0
        out.append(
            f"| {r.get('model', 'smollm2')} | {r['draft']} | {r['temperature']:g} | {r['cell']} "
            f"| {t['plain_tok_s']:.1f} | {t['tree_tok_s']:.1f} | {t['best_chain_tok_s']:.1f} "
            f"| {over:.2f} | {t['pass_ms']:.2f} | {t['draft_step_ms']:.2f} "
            f"| {t['projected_tree_tok_s']:.1f} | {fit:.2f} |"
        )
    return out


def line(r: dict[str, Any], chains: list[int]) -> str:
    tree = r["tree"]
    return (
        f"| {r.get('model', 'smollm2')} | {r['draft']} | {r['temperature']:g} | {r['cell']} "
        f"| {tree['tokens_per_pass']:.2f} | "
        + " | ".join(  # (runs read back with --projection-from may have other chains)
            f"{r['chains'][f'K={k}']['tokens_per_pass']:.2f}" if f"K={k}" in r["chains"] else "—"
            for k in chains
        )
        + f" | {r['tree_over_best_chain']:.2f} | {tree['draft_passes_per_pass']:.1f} "
        f"| {tree['acceptance']:.2f} |"
    )


if __name__ == "__main__":
    main()
