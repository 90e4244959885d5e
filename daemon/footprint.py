"""What one model takes in memory, measured before any weight exists: `footprint` builds it on
the meta device from its config and sizes what is outside the layers, one layer as the
streamer lays it out, its KV cache per token, and the rebuild room of packed projections;
`activation_footprint` follows the model code's temporaries per token, per attention key
and per logit row. daemon/memory_plan.py plans with these sizes."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import nn

from offload.activations import ActivationFootprint
from offload.layout import FlatLayout
from offload.machine import gemm_copies_output
from offload.plan import ModelFootprint, module_bytes
from speculative.attention import ATTENTION_CHUNK_BYTES, attention_row_bytes
from speculative.config import ModelConfig
from speculative.kv_cache import KVCache
from speculative.model import Transformer
from speculative.packed import PackedLinear
from speculative.sampling import DRAW_BYTES_PER_ENTRY


def footprint(
    config: ModelConfig,
    dtype: torch.dtype,
    name: str,
    vocab_width: int | None = None,
    device_type: str = "cuda",
) -> ModelFootprint:
    """Sizes of one model in `dtype`, from a meta-device instance (no memory, no weights).
    `vocab_width`: the width its logits are given (a draft speaks its target's, see
    `Transformer.set_vocab_width`); None: its own vocabulary. `device_type`: where it
    computes (a CPU's matrix products may hold more, `gemm_copies_output`)."""
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    # A freshly built Transformer holds its own blocks: a ModuleList, never a streamer.
    block = cast(nn.ModuleList, model.layers)[0]
    # A layer's bytes as the streamer lays them out (slots, host arenas): the parameters
    # with each tensor's alignment padding, so the plan's figures are what gets allocated.
    layer = FlatLayout.of(block).nbytes
    outside_layers = module_bytes(model) - config.num_layers * module_bytes(block)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    dense_layer = 0
    if config.quantization is not None:
        with torch.device("meta"):
            dense = Transformer(replace(config, quantization=None)).to(dtype)
        dense_layer = FlatLayout.of(cast(nn.ModuleList, dense.layers)[0]).nbytes
    return ModelFootprint(
        name=name,
        dtype=str(dtype).removeprefix("torch."),
        resident_bytes=outside_layers,
        layer_bytes=layer,
        num_layers=config.num_layers,
        kv_bytes_per_token=KVCache.bytes_for(config, 1, dtype),
        activations=activation_footprint(
            config, dtype, vocab_width, gemm_copies_output(dtype, device_type)
        ),
        quantization=config.quantization.label if config.quantization is not None else "",
        dense_layer_bytes=dense_layer,
        dequant_bytes=max((m.rebuild_bytes(dtype) for m in packed), default=0),
    )


def activation_footprint(
    config: ModelConfig,
    dtype: torch.dtype,
    vocab_width: int | None = None,
    gemm_output_copy: bool = False,
) -> ActivationFootprint:
    """What a pass of speculative.model allocates, traced through its code. Per token, in
    bytes; `x` is a layer's input (held by the caller while the layer runs), `h` its norm.
    `gemm_output_copy`: each matrix product holds an fp32 copy of its output while it runs
    (offload.machine.gemm_copies_output: bf16 on a CPU without bf16 instructions)."""
    item = torch.empty((), dtype=dtype).element_size()
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    fp32_copy = 4 if item != 4 else 0  # `.float()` copies unless the model is fp32 already
    to_dtype = item if item != 4 else 0  # `.to(dtype)` of fp32 copies unless fp32
    # Logits (Transformer._to_vocab_width): the head's rows, then fp32 at the given width: a
    # copy unless the model is fp32 and not widened (a wider result is always a new tensor).
    rows = config.vocab_size
    width = vocab_width or rows
    fp32_logits = 4 * width if width > rows or item != 4 else 0
    copy = 4 if gemm_output_copy else 0  # a product's own fp32 output buffer, per column

    def norm(n: int) -> int:
        # RMSNorm's peak: the fp32 input and x²; then the normalised fp32, its cast and
        # the weighted output.
        return max(fp32_copy + 4, 4 + to_dtype + item) * n

    phases = [
        item * d + norm(d),  # input norm
        # x, h, the stacked q/k/v output (q and k views of it), and RoPE on q and k in one
        # go: x*cos, roll, roll*sin (the unstacked projections of packed models hold less)
        item * (2 * d + 4 * q + 5 * kv),
        # output, its (T, H*hd) copy and o_proj; the rotated q and k beside the stacked
        # output, which v (a view of it) keeps alive
        item * (3 * d + 4 * q + 3 * kv),
        3 * item * d,  # residual add
        2 * item * d + norm(d),  # post-attention norm (x and the new residual alive)
        # MLP: x, residual, h, then the stacked gate/up output and silu(gate), multiplied
        # by up in place (unstacked: silu(gate), up, their product)
        item * (3 * d + 3 * f),
        4 * item * d,  # the last residual add
    ]
    if copy:  # each product while it runs: its inputs, its output and the fp32 buffer
        phases += [
            item * (2 * d + q + 2 * kv) + copy * (q + 2 * kv),  # q/k/v
            item * (3 * d + 4 * q + 3 * kv) + copy * d,  # o_proj: as the phase above
            item * (3 * d + 2 * f) + copy * 2 * f,  # gate/up: x, residual, h
            item * (4 * d + 3 * f) + copy * d,  # down: the MLP phase's tensors and its output
        ]
    if config.qk_norm:
        phases += [
            item * (2 * d + q + 2 * kv) + norm(q),  # q norm (beside the q/k/v output)
            item * (2 * d + 2 * q + 2 * kv) + norm(kv),  # k norm (q and its norm alive)
            item * (2 * d + 5 * q + 3 * kv),  # RoPE on q: normed q and k, three temporaries
            item * (2 * d + 2 * q + 6 * kv),  # RoPE on k (q done)
        ]
    return ActivationFootprint(
        persistent_bytes_per_token=2 * hd * item,  # RoPE cos and sin
        layer_bytes_per_token=max(phases),
        # x, h, the q/k/v output, rotated q and k, the attention output
        attention_bytes_per_token=item * (2 * d + 3 * q + 3 * kv),
        mask_bytes_per_pair=1,  # torch.bool
        score_bytes_per_key=attention_row_bytes(config.num_heads, 1),
        score_bytes_per_query=2 * item * q,  # a chunk's copy of its queries and its output
        chunk_bytes=ATTENTION_CHUNK_BYTES,
        hidden_bytes_per_token=item * d,
        # The head's output in the model dtype and its fp32 logits, after the final norm.
        logit_bytes_per_row=max(norm(d), item * d + item * rows + max(fp32_logits, copy * rows)),
        fp32_row_bytes=4 * width,
        draw_bytes_per_row=DRAW_BYTES_PER_ENTRY * width,
    )
