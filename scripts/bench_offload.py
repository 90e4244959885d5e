"""Streamed target pass time against the pure transfer time, next to accelerate's cpu_offload.

On a GPU: random weights in real shapes (8B- and 32B-shaped layers, bf16), every decoder layer
streamed (the GPU budget forced to the non-layer parts plus the slots). It measures pinned
host→device bandwidth, then the time of one target pass over 1, 64, 256 and 1024 new tokens,
and reports

    overlap ratio = pass_time / (streamed_bytes / bandwidth)     (goal: <= 1.15 up to 256)

and accelerate's `cpu_offload` of the same layers in the same run, as a time ratio.

`--quantize none,int8,int4,q4_k_m` adds the same model with packed int8 / int4 projections
(the `--quantize` layout) or GGUF Q4_K_M blocks (llama-quantize's mix of Q4_K and Q6_K): bytes per layer, the time to dequantize one layer's projections, and
each pass's time as a ratio to the unquantized pass of the same shape and tokens (the
issue's goal on a GPU: int4 ≤ 0.3 × bf16 at 64–256 tree tokens).

Without a GPU it runs the same code path on the CPU with small shapes and says plainly that
the overlap figures need a GPU (on a CPU "host→device" is a RAM copy and compute dominates).

    python scripts/bench_offload.py --out bench_offload.json
    python scripts/bench_offload.py --shapes 8b --layers 8 --tokens 1,64,256
    python scripts/bench_offload.py --quantize none,int8,int4 --no-accelerate
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.config import ModelConfig  # noqa: E402
from modeling.decoder import Transformer  # noqa: E402
from modeling.models import config_from_hf  # noqa: E402
from modeling.weights.gguf_blocks import BLOCK_SIZES, GGMLType  # noqa: E402
from modeling.weights.gguf_modules import GGUFLinear  # noqa: E402
from modeling.weights.packed import CompressedLinear, PackedLinear  # noqa: E402
from modeling.weights.quant import QuantizationSpec, on_load_quantization  # noqa: E402
from offload.machine import measure_bandwidth  # noqa: E402
from offload.placement import build_streamer  # noqa: E402
from offload.stream import LayerStreamer  # noqa: E402

SHAPES = {
    # hidden, intermediate, heads, kv heads, vocab (Llama-3.1-8B and Qwen2.5-32B layers)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, model_type="llama"),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, model_type="qwen2"),
    "small": dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096, model_type="llama"),
}  # fmt: skip


def random_model(
    shape: str, layers: int, dtype: torch.dtype, quantize: str | None = None
) -> Transformer:
    raw = {**SHAPES[shape], "num_hidden_layers": layers, "max_position_embeddings": 4096}
    cfg = config_from_hf(raw, source=f"{shape}-shaped")
    if quantize == "q4_k_m":
        cfg = replace(cfg, quantization=q4_k_m(cfg))
    elif quantize is not None:
        cfg = replace(cfg, quantization=on_load_quantization(quantize))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
        for m in model.modules():
            if isinstance(m, CompressedLinear):
                m.quantize_from(torch.empty(m.out_features, m.in_features).uniform_(-0.02, 0.02))
            if isinstance(m, GGUFLinear):
                random_blocks(m)
    model.set_rope("cpu")  # fp32, as the loader sets it
    return model.eval()


def q4_k_m(cfg: ModelConfig) -> QuantizationSpec:
    """llama-quantize's Q4_K_M mix for `cfg`'s layers: Q4_K, with Q6_K for attn_v and
    ffn_down in the first and last eighth of the layers and every third between
    (`use_more_bits`), as a GGUF file of it holds them."""
    n = cfg.num_layers

    def more_bits(i: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    types = []
    for i in range(n):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            heavy = name in ("self_attn.v_proj", "mlp.down_proj") and more_bits(i)
            kind = GGMLType.Q6_K if heavy else GGMLType.Q4_K
            types.append((f"layers.{i}.{name}.weight", int(kind)))
    return QuantizationSpec.gguf(tuple(types), "Q4_K_M", ())


def random_blocks(m: GGUFLinear) -> None:
    """Random codes with small finite scales (random bytes would make NaN halves)."""
    m._buffers["blocks"] = torch.randint(0, 256, m.blocks.shape, dtype=torch.uint8)
    per_block = m.stored().view(-1, BLOCK_SIZES[m.ggml_type][1])  # this layer's type
    scale = torch.full((per_block.shape[0], 1), 1e-4, dtype=torch.float16).view(torch.uint8)
    if m.ggml_type == GGMLType.Q4_K:  # d, dmin at the start
        per_block[:, 0:2], per_block[:, 2:4] = scale, scale
    else:  # Q6_K: d at the end
        per_block[:, -2:] = scale


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pass(model: Transformer, tokens: int, device: torch.device, repeats: int) -> float:
    """Median seconds of one target pass over `tokens` new tokens (causal, empty cache)."""
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    positions = torch.arange(tokens, device=device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        cache = model.new_cache(tokens)
        sync(device)
        t0 = time.perf_counter()
        model(ids, positions, cache)
        sync(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def dequantize_seconds(layer: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> float:
    """Median seconds to rebuild every packed projection of one (resident) layer."""
    packed = [m for m in layer.modules() if isinstance(m, PackedLinear)]
    if not packed:
        return 0.0
    layer.to(device)
    times = []
    for _ in range(4):
        sync(device)
        t0 = time.perf_counter()
        for m in packed:
            m.dequantize(dtype)
        sync(device)
        times.append(time.perf_counter() - t0)
    layer.to("cpu")
    return sorted(times[1:])[1]


def bench_shape(
    args: argparse.Namespace, shape: str, device: torch.device, quantize: str | None = None
) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = random_model(shape, args.layers, dtype, quantize)
    weights = quantize or args.dtype
    rebuild = dequantize_seconds(random_model(shape, 1, dtype, quantize).layers[0], dtype, device)
    layers = list(model.layers)
    streamer = build_streamer(layers, [], device, args.slots)
    model.set_layers(streamer)
    model.to(device)
    bandwidth, how = measure_bandwidth(device)
    streamed = streamer.layout.nbytes * len(layers)
    transfer = streamed / bandwidth
    print(
        f"\n{shape}-shaped, {args.layers} layers × {streamer.layout.nbytes / 1e9:.3f} GB "
        f"({weights}, compute {args.dtype}), {args.slots} slots; bandwidth "
        f"{bandwidth / 1e9:.2f} GB/s ({how}); pure transfer {transfer * 1e3:.1f} ms; "
        f"dequantize a layer {rebuild * 1e3:.2f} ms"
    )
    rows = []
    for n in args.tokens:
        t = time_pass(model, n, device, args.repeats)
        rows.append(
            {
                "shape": shape,
                "device": device.type,
                "dtype": args.dtype,
                "weights": weights,
                "layer_bytes": streamer.layout.nbytes,
                "dequantize_layer_seconds": rebuild,
                "layers": args.layers,
                "slots": args.slots,
                "tokens": n,
                "streamed_bytes": streamed,
                "bandwidth_gbps": bandwidth / 1e9,
                "transfer_seconds": transfer,
                "pass_seconds": t,
                "overlap_ratio": t / transfer,
            }
        )
    if args.accelerate and quantize is None:
        compare_accelerate(args, shape, dtype, device, rows)
    for r in rows:
        acc = r.get("accelerate_over_streamer")
        acc_text = f"{acc:8.2f}x" if acc is not None else "       -"
        print(
            f"  tokens {r['tokens']:5d}  pass {r['pass_seconds'] * 1e3:9.1f} ms  "
            f"ratio {r['overlap_ratio']:6.2f}  accelerate/ours {acc_text}"
        )
    del model, streamer
    return rows


def accelerate_offloaded(
    shape: str, layers: int, dtype: torch.dtype, device: torch.device
) -> Transformer:
    """The same random model with every decoder layer under accelerate's `cpu_offload` and
    the rest on `device`. The layers read their Linear weights directly (`F.linear(x,
    module.weight)`), so accelerate's per-submodule hooks would never fire and the weights
    would stay on the meta device: `preload_module_classes` makes each layer load all of
    its weights at the start of its forward, which is what accelerate documents for such
    modules."""
    from accelerate import cpu_offload

    model = random_model(shape, layers, dtype)
    for layer in model.layers:
        cpu_offload(layer, execution_device=device, preload_module_classes=["DecoderLayer"])
    model.embed_tokens.to(device)
    model.norm.to(device)
    model.lm_head.to(device)
    model.inv_freq = model.inv_freq.to(device)
    return model


def compare_accelerate(
    args: argparse.Namespace, shape: str, dtype: torch.dtype, device: torch.device, rows: list
) -> None:
    """accelerate's cpu_offload on the same layers (embeddings, norm, head on the device)."""
    if device.type != "cuda":
        return  # cpu_offload moves weights to an execution device; on CPU there is none
    model = accelerate_offloaded(shape, args.layers, dtype, device)
    for r in rows:
        t = time_pass(model, r["tokens"], device, max(1, args.repeats // 2))
        r["accelerate_seconds"] = t
        r["accelerate_over_streamer"] = t / r["pass_seconds"]
    del model


def compare_weights(
    args: argparse.Namespace, shape: str, device: torch.device, kinds: list[str | None]
) -> list[dict]:
    """Each kind of weights streamed side by side: for every token count the kinds take
    turns pass by pass, and each kind's pass is divided by the unquantized pass of the same
    turn (a shared machine drifts; a paired ratio does not)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    kinds = [None, *(k for k in kinds if k is not None)]  # the unquantized pass is the base
    models = {}
    for kind in kinds:
        model = random_model(shape, args.layers, dtype, kind)
        model.set_layers(build_streamer(list(model.layers), [], device, args.slots))
        models[kind] = model.to(device)
    rows = []
    for n in args.tokens:
        ratios: dict[str | None, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.repeats + 1):
            times = {kind: time_pass(m, n, device, 1) for kind, m in models.items()}
            for kind in kinds:
                ratios[kind].append(times[kind] / times[None])
        for kind in kinds:
            if kind is None:
                continue
            paired = sorted(ratios[kind][1:])  # the first turn warms up
            layers = models[kind].layers
            assert isinstance(layers, LayerStreamer)
            rows.append(
                {
                    "shape": shape,
                    "weights": kind,
                    "tokens": n,
                    "layer_bytes": layers.layout.nbytes,
                    "pass_over_unquantized": paired[len(paired) // 2],
                    "paired": True,
                }
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shapes", default=None, help="comma list of 8b,32b,small (default by device)")
    p.add_argument("--layers", type=int, default=None, help="layers per model (all streamed)")
    p.add_argument("--tokens", default="1,64,256,1024")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-accelerate", dest="accelerate", action="store_false")
    p.add_argument(
        "--quantize",
        default="none",
        help="comma list of none,int8,int4,q4_k_m: the weights to compare, side by side",
    )
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args()
    args.tokens = [int(x) for x in args.tokens.split(",")]
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    shapes = (args.shapes or ("8b,32b" if gpu else "small")).split(",")
    args.layers = args.layers or (8 if gpu else 6)
    if not gpu:
        args.dtype = "fp32" if args.dtype == "bf16" else args.dtype
        args.tokens = [t for t in args.tokens if t <= 256]
        print(
            "No CUDA device: running the CPU path with small shapes. The overlap figures "
            "(pass time over transfer time, accelerate comparison) need a GPU: on a CPU the "
            "'transfer' is a RAM copy and the pass is compute-bound."
        )
    kinds = [None if k == "none" else k for k in args.quantize.split(",")]
    rows = [r for shape in shapes for k in kinds for r in bench_shape(args, shape, device, k)]
    if len(kinds) > 1:
        print(
            f"\npass time against the {args.dtype} pass of the same shape and tokens, the "
            "weights alternating pass by pass (median of the paired ratios):"
        )
        for shape in shapes:
            for r in compare_weights(args, shape, device, kinds):
                rows.append(r)
                print(
                    f"  {r['shape']:>5} {r['weights']:>5} tokens {r['tokens']:5d}  "
                    f"layer {r['layer_bytes'] / 1e6:8.2f} MB  {r['pass_over_unquantized']:5.2f}x"
                )
    if args.out:
        args.out.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
