"""What rebuilding a packed layer for its matmuls costs: one Llama-3.1-8B-shaped layer's
projections (q/k/v, o, gate/up, down) dequantized to bf16, as HQQ at 4, 3 and 2 bits (the
substitute draft) and as int8 (`--quantize int8`), eager and through `torch.compile`; and
what building the HQQ layer (optimising its zero points) costs. On a CPU the shapes are
cut to a sixteenth (a full layer would take minutes) and only rank the variants.

    python3 scripts/bench_rebuild.py --json gpu-results/rebuild.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.weights.hqq import HQQLinear  # noqa: E402
from modeling.weights.packed import CompressedLinear, PackedLinear  # noqa: E402

# (out, in) of an 8B layer's projections as the substitute packs them, q/k/v and gate/up
# each counted as one (they share their input).
SHAPES = {"qkv": (4096 + 2 * 1024, 4096), "o": (4096, 4096), "gate_up": (2 * 14336, 4096),
          "down": (4096, 14336)}  # fmt: skip


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def layer_figures(make: Callable[[int, int], PackedLinear], device: torch.device, cut: int) -> dict:
    eager = compiled = build = 0.0
    for out, inp in SHAPES.values():
        out, inp = out // cut, inp // cut
        weight = torch.randn(out, inp, device=device, dtype=torch.bfloat16)
        module = make(inp, out).to(device)
        t0 = time.perf_counter()
        module.quantize_from(weight)  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize()
        build += time.perf_counter() - t0
        eager += median_seconds(lambda m=module: m.dequantize(torch.bfloat16), device)
        fast = torch.compile(module.dequantize, dynamic=False)
        compiled += median_seconds(lambda f=fast: f(torch.bfloat16), device)
    return {"eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3, "build_s": build}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cut = 1 if device.type == "cuda" else 16
    limits = torch._dynamo.config  # one compile per projection shape and module
    limits.recompile_limit = max(limits.recompile_limit, 64)
    limits.accumulated_recompile_limit = max(limits.accumulated_recompile_limit, 1024)
    rows = {}
    for bits in (4, 3, 2):
        rows[f"hqq{bits}"] = layer_figures(
            lambda i, o, b=bits: HQQLinear(i, o, False, b, 64), device, cut
        )
    rows["int8"] = layer_figures(
        lambda i, o: CompressedLinear(i, o, False, 8, min(128, i), True, torch.float16),
        device, cut,
    )  # fmt: skip
    print(f"one 8B-shaped layer{'' if cut == 1 else ' / 16'} on {device}:")
    for name, r in rows.items():
        print(
            f"  {name:<6} rebuild {r['eager_ms']:8.2f} ms eager, {r['compiled_ms']:8.2f} ms "
            f"compiled; build {r['build_s']:.2f} s"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(device), "cut": cut, "rows": rows}))


if __name__ == "__main__":
    main()
