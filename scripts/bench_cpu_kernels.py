"""Products on GGUF blocks on the CPU, per ggml type: the kernels that read the blocks where
they lie (modeling/weights/cpu_kernels.py) against rebuilding the float matrix for each
product (specd before them, and still for long passes) and against a dense fp32 matrix
(the model's F32 form), for 1, 4 and 8 input rows.

The matrix is an 8B layer's o_proj (4,096 x 4,096); a few distinct copies are taken in turn
so that each product reads its bytes from RAM, not from a cache. Blocks are random codes
with scales of a trained model's size. Times are medians; the three ways take turns.

    .venv/bin/python scripts/bench_cpu_kernels.py [--threads 1] [--json bench-results/cpu-kernels.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as GGMLType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.weights import cpu_kernels  # noqa: E402
from modeling.weights.gguf_blocks import BLOCK_SIZES, BlockType, SpecdType, dequantize  # noqa: E402

# Byte offsets of each type's float16 scale fields in its block.
HALVES = {
    GGMLType.Q8_0: (0,), GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,), GGMLType.Q3_K: (108,),
    SpecdType.Q4_Z: (0,), GGMLType.Q2_K: (80, 82),
    SpecdType.Q4_0B: (0,), SpecdType.Q8_0B: (0,), SpecdType.Q4_ZB: (0,),
}  # fmt: skip


def blocks_of(kind: BlockType, rows: int, columns: int, seed: int) -> torch.Tensor:
    elements, size = BLOCK_SIZES[kind]
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows * columns // elements, size), dtype=torch.uint8, generator=g)
    for at in HALVES.get(kind, ()):
        bf16 = kind in (SpecdType.Q4_0B, SpecdType.Q8_0B, SpecdType.Q4_ZB)
        scale = (torch.rand(b.shape[0], generator=g) * 2e-3 + 1e-4).to(
            torch.bfloat16 if bf16 else torch.float16
        )
        b[:, at : at + 2] = scale.view(torch.uint8).view(-1, 2)
    if kind == GGMLType.MXFP4:  # its E8M0 byte: scales 2^-18 .. 2^-8, as HALVES' are small
        b[:, 0] = torch.randint(110, 120, (b.shape[0],), generator=g).to(torch.uint8)
    return b.view(rows, -1)


def median_us(fn: Callable[[int], object], copies: int, repeats: int) -> float:
    fn(0)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for i in range(copies):
            fn((r + i) % copies)
        times.append((time.perf_counter() - t0) / copies)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", type=int, default=4096, help="the square matrix's side")
    ap.add_argument("--copies", type=int, default=6, help="distinct matrices taken in turn")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--types", default="", help="only these types (e.g. Q4_0,MXFP4); default all")
    ap.add_argument("--json", type=Path, default=ROOT / "bench-results" / "cpu-kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if not cpu_kernels.available():
        raise SystemExit(f"no CPU kernels here: {cpu_kernels.status()}")
    n = args.size
    dense = [torch.randn(n, n) * 0.02 for _ in range(args.copies)]
    print(f"{n} x {n} products, {args.threads} thread(s), median of {args.repeats}; "
          "us per product, and the stored bytes read per second by the kernel")  # fmt: skip
    print(
        "| type | rows | kernel us | GB/s | rebuild + mm us | dense fp32 us | x rebuild | x dense |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows_out = []
    kinds = [k for k in cpu_kernels.TYPES if not args.types or k.name in args.types.split(",")]
    for kind in kinds:
        stored = [blocks_of(kind, n, n, seed) for seed in range(args.copies)]
        nbytes = stored[0].numel()
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, n)

            def kernel_product(
                i: int, x: torch.Tensor = x, kind: BlockType = kind, stored: list = stored
            ) -> object:
                return cpu_kernels.gemv(x, stored[i], kind)

            def rebuilt(
                i: int, x: torch.Tensor = x, kind: BlockType = kind, stored: list = stored
            ) -> object:
                return torch.nn.functional.linear(x, dequantize(stored[i], kind, n))

            def dense_product(i: int, x: torch.Tensor = x) -> object:
                return torch.nn.functional.linear(x, dense[i])

            kernel = median_us(kernel_product, args.copies, args.repeats)
            rebuild = median_us(rebuilt, args.copies, max(3, args.repeats // 2))
            fp32 = median_us(dense_product, args.copies, args.repeats)
            gbs = nbytes / kernel / 1e3
            print(f"| {kind.name} | {m} | {kernel:.0f} | {gbs:.1f} | {rebuild:.0f} | {fp32:.0f} "
                  f"| {rebuild / kernel:.1f} | {fp32 / kernel:.2f} |")  # fmt: skip
            rows_out.append({"type": kind.name, "rows": m, "kernel_us": kernel,
                             "rebuild_us": rebuild, "dense_fp32_us": fp32,
                             "stored_bytes": nbytes})  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"size": n, "threads": args.threads, "rows": rows_out}, indent=1)
    )


if __name__ == "__main__":
    main()
