"""Stacked projections: dense q/k/v and gate/up are one matmul each (`FusedLinear`), loaded
part by part from the checkpoint's separate tensors. The stacked model computes what the
separate projections compute; packed formats keep their projections apart; streaming (RAM
and disk tiers) and the memory plan see the stacked layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from daemon.footprint import footprint
from daemon.target_loading import disk_sources
from modeling.checkpoints.checkpoint import load, open_checkpoint
from modeling.decoder import Transformer
from modeling.layers.self_attention import Attention
from modeling.weights.packed import CompressedLinear, PackedLinear
from modeling.weights.projections import FUSED_PROJECTIONS, FusedLinear, stored_names, stored_state
from offload.arena import HostArena
from offload.layout import FlatLayout
from offload.placement import build_streamer
from offload.storage import DiskStorage
from scripts.bench_fusion import unstacked

PROMPT = [1, 403, 407, 261, 378, 432, 383]


def logits_and_greedy(
    model: Transformer, steps: int = 40, prompt: list[int] = PROMPT
) -> tuple[torch.Tensor, list[int]]:
    """Prefill's logits and `steps` greedy decode steps' (one token each), and the tokens."""
    cache = model.new_cache(len(prompt) + steps + 1)
    prefill = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    rows, tokens = [prefill], []
    token = int(prefill[-1].argmax())
    for i in range(steps):
        tokens.append(token)
        pos = torch.tensor([len(prompt) + i])
        row = model(torch.tensor([token]), pos, cache)
        rows.append(row)
        token = int(row[-1].argmax())
    return torch.cat(rows), tokens


def test_the_real_target_loads_stacked_and_matches_its_unstacked_self(stories_target: Path):
    model, _, _ = load(stories_target, "fp32")
    attn = model.layers[0].self_attn  # type: ignore[index]
    assert isinstance(attn.qkv_proj, FusedLinear) and attn.q_proj is None
    assert isinstance(model.layers[0].mlp.gate_up_proj, FusedLinear)  # type: ignore[index]
    # The stacked rows are the stored tensors, bit for bit.
    with safe_open(str(stories_target / "model.safetensors"), "pt") as f:
        stored = torch.cat(
            [f.get_tensor(f"model.{n}") for n in stored_names("layers.0.self_attn.qkv_proj.weight")]
        )
    assert torch.equal(attn.qkv_proj.weight, stored)
    fused_logits, fused_tokens = logits_and_greedy(model)
    plain_logits, plain_tokens = logits_and_greedy(unstacked(model))
    assert (fused_logits - plain_logits).abs().max().item() <= 1e-5
    assert fused_tokens == plain_tokens


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_bias_and_qk_norm_families_match_unstacked(tiny_checkpoint, family: str) -> None:
    """Qwen2 stacks the q/k/v biases; Qwen3 norms q and k per head after the split."""
    model, _, _ = load(tiny_checkpoint(family, vocab_size=96), "fp32")
    if family == "qwen2":
        assert model.layers[0].self_attn.qkv_proj.bias is not None  # type: ignore[index]
    prompt = [1, 5, 9, 20, 33, 47]
    fused_logits, fused_tokens = logits_and_greedy(model, 10, prompt)
    plain_logits, plain_tokens = logits_and_greedy(unstacked(model), 10, prompt)
    assert (fused_logits - plain_logits).abs().max().item() <= 1e-5
    assert fused_tokens == plain_tokens


def test_stored_names_map_a_stacked_tensor_to_its_parts() -> None:
    assert stored_names("layers.3.self_attn.qkv_proj.bias") == [
        "layers.3.self_attn.q_proj.bias",
        "layers.3.self_attn.k_proj.bias",
        "layers.3.self_attn.v_proj.bias",
    ]
    assert stored_names("mlp.gate_up_proj.weight") == ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    assert stored_names("mlp.down_proj.weight") == ["mlp.down_proj.weight"]


def test_packed_projections_stay_apart_and_dequantizing_stacks_them(shared_models: Path) -> None:
    model, _, _ = load(shared_models / "quantized" / "gptq-w4-g32", "fp32")
    layer = model.layers[0]  # type: ignore[index]
    assert layer.self_attn.qkv_proj is None and isinstance(layer.self_attn.q_proj, PackedLinear)
    assert layer.mlp.gate_up_proj is None and isinstance(layer.mlp.up_proj, PackedLinear)
    packed_logits, packed_tokens = logits_and_greedy(model, 10)
    model.dequantize_layers()
    layer = model.layers[0]  # type: ignore[index]
    assert isinstance(layer.self_attn.qkv_proj, FusedLinear) and layer.self_attn.q_proj is None
    assert isinstance(layer.mlp.gate_up_proj, FusedLinear) and layer.mlp.gate_proj is None
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    dense_logits, dense_tokens = logits_and_greedy(model, 10)
    # Packed and dequantized differ by float rounding (test_quant's tolerance) ...
    assert (dense_logits - packed_logits).abs().max().item() <= 1e-4
    assert dense_tokens == packed_tokens
    # ... and stacking the dequantized projections adds nothing to that.
    plain_logits, plain_tokens = logits_and_greedy(unstacked(model), 10)
    assert (dense_logits - plain_logits).abs().max().item() <= 1e-5
    assert plain_tokens == dense_tokens


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_streamed_stacked_layers_compute_the_same_logits(stories_target: Path, tier: str) -> None:
    model, _, ckpt = load(stories_target, "fp32")
    want, want_tokens = logits_and_greedy(model, 10)
    layers = list(model.layers)
    streamed = [1, 2, 3, 4]
    sources = None
    if tier == "disk":
        names = [e.name for e in FlatLayout.of(layers[0]).tensors]
        assert "self_attn.qkv_proj.weight" in names and "mlp.gate_up_proj.weight" in names
        sources = disk_sources(ckpt, streamed, names, "fp32")
    streamer = build_streamer(layers, [0], "cpu", 2, tier, sources)
    model.set_layers(streamer)
    got, got_tokens = logits_and_greedy(model, 10)
    assert torch.equal(got, want) and got_tokens == want_tokens
    streamer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_disk_tier_reads_stacked_parts_into_the_packed_layer_bytes(
    stories_target: Path, dtype: torch.dtype
) -> None:
    """The disk tier's staging holds exactly what the RAM tier packs from the loaded layer
    (the parts read one after another, cast on the way for bf16)."""
    model, _, ckpt = load(stories_target, dtype)
    layer = model.layers[2]  # type: ignore[index]
    layout = FlatLayout.of(layer)
    packed = HostArena(layout.nbytes, 1).view(0)
    packed.zero_()
    layout.pack(layer, packed)
    storage = DiskStorage(layout, disk_sources(ckpt, [2], [e.name for e in layout.tensors], "fp32"))
    staging = HostArena(layout.nbytes, 1).view(0)
    staging.zero_()
    storage.read(2, staging)
    storage.close()
    assert torch.equal(staging, packed)


def test_the_disk_tier_refuses_parts_that_do_not_stack(stories_target: Path) -> None:
    model, _, ckpt = load(stories_target, "fp32")
    layout = FlatLayout.of(model.layers[0])  # type: ignore[index]
    sources = disk_sources(ckpt, [0], [e.name for e in layout.tensors], "fp32")
    bad = {name: list(parts) for name, parts in sources[0].items()}  # type: ignore[arg-type]
    bad["self_attn.qkv_proj.weight"] = bad["self_attn.qkv_proj.weight"][:2]  # no v_proj
    with pytest.raises(ValueError, match=r"q_proj\.weight with shape \[64, 64\] \+ "):
        DiskStorage(layout, {0: bad})


def test_the_plan_counts_the_stacked_layer_and_the_same_parameter_bytes(
    stories_target: Path,
) -> None:
    ckpt = open_checkpoint(stories_target)
    cfg = ckpt.config
    model, _, _ = load(stories_target, "fp32")
    layer = model.layers[0]  # type: ignore[index]
    plan = footprint(cfg, torch.float32, "target")
    assert plan.layer_bytes == FlatLayout.of(layer).nbytes  # what the streamer allocates
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, 0
    kv = cfg.num_kv_heads * cfg.head_dim
    params = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d  # q/k/v, o, gate/up/down, norms
    assert sum(p.numel() for p in layer.parameters()) == params
    with torch.device("meta"):
        unstacked_layer = unstacked(Transformer(cfg)).layers[0]  # type: ignore[index]
    assert sum(p.numel() for p in unstacked_layer.parameters()) == params
    # Fewer tensors, so never more alignment padding than the unstacked layout.
    assert FlatLayout.of(layer).nbytes <= FlatLayout.of(unstacked_layer).nbytes


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_stacked_rows_gives_each_parts_codes(bits: int) -> None:
    """On-load quantization is per output row (groups along the input), so quantizing
    q/k/v stacked gives exactly the codes and scales of quantizing each apart: stacking
    before or after quantizing is the same model."""
    torch.manual_seed(0)
    parts = [torch.randn(rows, 256) for rows in (64, 32, 32)]

    def quantized(weight: torch.Tensor) -> CompressedLinear:
        m = CompressedLinear(256, weight.shape[0], False, bits, 128, True, torch.float16)
        m.quantize_from(weight, rows=48)  # blocks that straddle the parts' boundaries
        return m

    whole = quantized(torch.cat(parts))
    apart = [quantized(p) for p in parts]
    assert torch.equal(whole.weight_packed, torch.cat([m.weight_packed for m in apart]))
    assert torch.equal(whole.weight_scale, torch.cat([m.weight_scale for m in apart]))
    assert torch.equal(
        whole.dequantize(torch.float32), torch.cat([m.dequantize(torch.float32) for m in apart])
    )


def test_a_meta_built_attention_is_stacked_in_stored_order(tiny_checkpoint) -> None:
    """A meta-built model of the dense layout is stacked too (what plans are made from)."""
    config = open_checkpoint(tiny_checkpoint("llama")).config
    with torch.device("meta"):
        attn = Attention(config)
    assert isinstance(attn.qkv_proj, FusedLinear)
    assert [n for n, _ in attn.qkv_proj.parts] == list(FUSED_PROJECTIONS["qkv_proj"])


def test_stored_state_gives_back_the_checkpoints_tensors(stories_target: Path) -> None:
    """The inverse of loading (what scripts/real_shapes.py writes folders with)."""
    model, _, _ = load(stories_target, "fp32")
    state = stored_state(model)
    with safe_open(str(stories_target / "model.safetensors"), "pt") as f:
        stored = {k.removeprefix("model."): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    stored.pop("lm_head.weight", None)  # tied: the embedding
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert sorted(state) == sorted(stored)
    assert all(torch.equal(state[k], stored[k]) for k in stored)
