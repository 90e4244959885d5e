"""Mixture-of-experts models (issue 37): Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss from
safetensors.
Checkpoints are written by transformers itself (per-expert tensors; gpt-oss's stacked, split
as they load), and the reference is transformers: logits (prefill, cached decode steps, a tree pass) to
fp32 rounding, routing exactly, greedy speculation equal to plain decoding, and exact
parameter counts at the published models' shapes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from greedy_checks import RUN_IDS, RUNS, speculation_runtime
from test_model_parity import _check_parity
from torch import nn

from modeling.checkpoints.checkpoint import load
from modeling.config import MoEConfig
from modeling.layers.moe import MoEDecoderLayer, SparseMoE
from modeling.models import config_from_hf, parameter_count
from offload.layout import FlatLayout

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tiny_checkpoint, family: str, tie: bool) -> None:
    path = tiny_checkpoint(family, tie_word_embeddings=tie, vocab_size=96)
    model = load(path)[0]
    assert all(isinstance(layer, MoEDecoderLayer) for layer in model.layers)
    _check_parity(path, f"moe-{family}-{tie}")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_is_the_references(tiny_checkpoint, family: str) -> None:
    """The experts each token is sent to and their weights equal transformers' router's,
    for a batch with every expert chosen somewhere, and one expert's token subset adds up
    to the block's output as the reference adds it."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family, vocab_size=96)
    ours = load(path)[0]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randn(37, ours.config.hidden_size, generator=torch.Generator().manual_seed(5))
    block = ours.layers[0].mlp
    assert isinstance(block, SparseMoE)
    chosen, weights = block.route(x)
    ref_block = ref.model.layers[0].mlp
    router = getattr(ref_block, "gate", None) or ref_block.router
    with torch.no_grad():
        _, ref_weights, ref_chosen = router(x)
        ref_out = ref_block(x[None])
        ref_out = (ref_out[0] if isinstance(ref_out, tuple) else ref_out)[0]  # gpt-oss: a pair
    assert torch.equal(chosen, ref_chosen)
    torch.testing.assert_close(weights, ref_weights.float(), atol=0, rtol=0)
    assert set(chosen.unique().tolist()) == set(range(ours.config.moe.experts))
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref_out, atol=1e-5, rtol=0)
        # Grouped by one sort, the sums are those of a search per expert, bit for bit.
        by_search = torch.zeros_like(x)
        w = weights.to(x.dtype) if block.weights_in_model_dtype else weights
        for e in chosen.unique().tolist():
            tokens, slots = torch.where(chosen == e)
            y = block.experts[e](x[tokens]) * w[tokens, slots, None]
            by_search.index_add_(0, tokens, y.to(x.dtype))
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            gate = torch.sigmoid(block.shared_expert_gate(x))
            by_search = by_search + gate * block.shared_expert(x)
        assert torch.equal(block(x), by_search)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("draft", "strategy", "extra"), RUNS[:2], ids=RUN_IDS[:2])
def test_speculation_is_the_targets_greedy_output(
    tiny_checkpoint, family: str, draft: str | None, strategy: str, extra: dict
) -> None:
    """A streamed expert model, and an n-gram tree over it, give plain greedy decoding's
    tokens (the tree's rows route each to its own experts in one pass)."""
    path = tiny_checkpoint(family, vocab_size=96)
    speculation_runtime(path, draft, strategy, extra, seed=7)


def test_a_linear_chain_and_a_tree_of_the_target_itself(tiny_checkpoint) -> None:
    """The target as its own draft: a chain and a tree accept everything and still give
    plain decoding's tokens."""
    path = tiny_checkpoint("qwen3_moe", vocab_size=96)
    for strategy in ("linear", "tree"):
        speculation_runtime(path, str(path), strategy, {}, seed=9)


REAL_SHAPES = {
    # Qwen3-30B-A3B's config.json (published), its parameter count: 30.5B
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    # Mixtral-8x7B-v0.1's config.json (published): 46.7B
    "mixtral-8x7b": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
        "sliding_window": None, "tie_word_embeddings": False,
    },
    # Qwen1.5-MoE-A2.7B's config.json (published): 14.3B, a shared expert of 5,632
    "qwen1.5-moe-a2.7b": {
        "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
        "num_experts_per_tok": 4, "norm_topk_prob": False, "max_position_embeddings": 8192,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
    },
    # gpt-oss-20b's config.json (published, its MXFP4 quantization_config left out): 20.9B
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072,
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
        "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
        "truncate": False}, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
        "attention_bias": True, "swiglu_limit": 7.0,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    },
}  # fmt: skip


@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_parameter_counts_equal_transformers_at_real_shapes(shape: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(REAL_SHAPES[shape])
    ours = parameter_count(config_from_hf(raw))
    model_type = raw.pop("model_type")
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw))
    assert ours == sum(p.numel() for p in ref.parameters())


def test_configs_it_cannot_run_are_refused_by_name() -> None:
    base = dict(REAL_SHAPES["qwen3-30b-a3b"])
    for key, value, words in (
        ("mlp_only_layers", [3], "mlp_only_layers"),
        ("decoder_sparse_step", 2, "decoder_sparse_step"),
        ("num_experts_per_tok", 200, "num_experts_per_tok"),
        ("num_experts", 0, "num_experts"),
        ("use_sliding_window", True, "use_sliding_window"),
        # counts that would have us build 10^8 modules before a weight is read
        ("num_experts", 10**8, "experts per layer is 100000000"),
        ("num_hidden_layers", 10**8, "num_hidden_layers is 100000000"),
        ("num_hidden_layers", 1000, "layers x experts is 128000"),
    ):
        with pytest.raises(ValueError, match=words):
            config_from_hf({**base, key: value})
    with pytest.raises(ValueError, match="num_hidden_layers is 100000000"):
        config_from_hf({**REAL_SHAPES["mixtral-8x7b"], "num_hidden_layers": 10**8})


def test_a_config_says_it_is_a_mixture() -> None:
    cfg = config_from_hf(REAL_SHAPES["qwen3-30b-a3b"])
    assert cfg.moe == MoEConfig(experts=128, top_k=8, intermediate_size=768, normalize=True)
    assert replace(cfg, moe=None).moe is None


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_placed_by_routing_decode_as_with_their_layers(tiny_checkpoint, family) -> None:
    """`--experts stream` (a device cache of 3 of the 12 experts, and of 1) and `--experts
    cpu` give the tokens the experts with their layers give, alone and under an n-gram
    tree (whose rows route to many experts in one pass); the cache counts what it moved."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from daemon.target_loading import expert_source
    from speculative.sampling import SamplingParams

    path = tiny_checkpoint(family, vocab_size=96, num_layers=3)
    prompt = [5, 9, 17, 33, 2, 8, 40, 11, 5, 9, 17]
    greedy = SamplingParams(temperature=0.0)
    runs: dict[tuple, list[int]] = {}
    for mode, slots in (("device", None), ("stream", 3), ("stream", 1), ("cpu", None)):
        for draft in (None, "ngram"):
            rt = Runtime(RuntimeOptions(model=str(path), device="cpu", experts=mode,
                                        expert_slots=slots, context=96, draft=draft))  # fmt: skip
            assert rt.plan.expert_mode == mode and rt.plan.expert_slots == (slots or 0)
            runs[(mode, slots, draft)] = (
                rt.generation(prompt, greedy, 24, ignore_eos=True).run().token_ids
            )
            source = expert_source(rt.target)
            if mode == "stream":
                assert source is not None and source.slots == slots
                stats = source.stats
                assert stats.copies == stats.asked - stats.hits > 0
                assert stats.bytes_copied == stats.copies * source.expert_bytes
            else:
                assert (source is None) == (mode == "device")
    assert len({tuple(ids) for ids in runs.values()}) == 1, runs


def test_a_pass_copies_only_the_routed_experts_the_cache_lacks(tiny_checkpoint) -> None:
    """The expert cache by itself: a layer pass copies the experts it asks for that no slot
    holds, one copy of each one's bytes; asked again with room for them, nothing; with too
    little room the frequently routed expert stays and a rare one goes through the bypass
    slot."""
    from offload.experts import ExpertCache

    model = load(tiny_checkpoint("qwen3_moe", vocab_size=96, num_layers=2))[0]
    experts = [list(layer.mlp.experts) for layer in model.layers]  # 2 layers x 4
    originals = [[e.gate_up_proj.weight.clone() for e in row] for row in experts]
    cache = ExpertCache(experts, "cpu", slots=8)
    cache.prepare(0, [1, 3])
    got = [cache.expert(0, 1), cache.expert(0, 3)]
    assert cache.stats.copies == 2 and cache.stats.bytes_copied == 2 * cache.expert_bytes
    assert torch.equal(got[0].gate_up_proj.weight, originals[0][1])
    assert torch.equal(got[1].gate_up_proj.weight, originals[0][3])
    cache.prepare(0, [1, 3])
    cache.expert(0, 1), cache.expert(0, 3)
    assert cache.stats.copies == 2 and cache.stats.hits == 2  # both were there

    small = ExpertCache(experts, "cpu", slots=3)  # two to keep, one bypass
    for _ in range(5):  # expert (0, 0) routed often
        small.prepare(0, [0])
        small.expert(0, 0)
    for e in (1, 2, 3):  # each once: none may push (0, 0) out
        small.prepare(1, [e])
        small.expert(1, e)
    small.prepare(0, [0])
    expert = small.expert(0, 0)
    assert small.stats.hits == 5 and torch.equal(expert.gate_up_proj.weight, originals[0][0])


def test_the_cache_evicts_as_a_scan_of_every_slot_would() -> None:
    """The victim of a miss comes from a heap of the slots by worth, not a scan of every
    slot per miss (0.6 s per tree pass over 2,293 slots): on skewed random routing over 6
    layers of 16 experts, with aging, its choices are a scan's, slot for slot."""
    from offload.experts import ExpertCache
    from scripts.bench_expert_cache import Scanning  # the former rule

    layers = [[nn.Linear(4, 4, bias=False) for _ in range(16)] for _ in range(6)]
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(16, generator=gen) ** 4  # a few experts routed far more often
    for slots in (3, 20, 60):
        heap, scan = ExpertCache(layers, "cpu", slots), Scanning(layers, "cpu", slots)
        heap.AGE_EVERY = scan.AGE_EVERY = 1  # ages every 96 requests: often
        for _ in range(400):
            layer = int(torch.randint(6, (), generator=gen))
            wanted = torch.multinomial(weights, int(torch.randint(1, 9, (), generator=gen)),
                                       generator=gen).tolist()  # fmt: skip
            for cache in (heap, scan):
                cache.prepare(layer, wanted)
                for e in wanted:
                    cache.expert(layer, e)
            assert heap.holder == scan.holder
        assert heap.stats.copies == scan.stats.copies and heap.stats.hits > 0


@pytest.mark.parametrize("budget", ["8GiB", "12GiB", "16GiB", "24GiB"])
def test_the_plan_of_qwen3_30b_a3b_by_routing(tmp_path: Path, budget: str) -> None:
    """A Qwen3-30B-A3B shape on a desktop card: attention, norms and routers resident, the
    experts in RAM with a device cache of what room is left, and a pass expected to move
    far less than whole layers streamed."""
    import json

    from daemon.cli import main

    folder = tmp_path / "qwen3-30b-a3b"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({**REAL_SHAPES["qwen3-30b-a3b"], "torch_dtype": "bfloat16"})
    )
    argv = ["plan", "--model", str(folder), "--device", "cuda", "--gpu-budget", budget,
            "--ram-budget", "64GiB", "--bandwidth", "25GB/s", "--draft", "none",
            "--context", "8192", "--json"]  # fmt: skip
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--experts", "stream"]) == 0
    plan = json.loads(out.getvalue())
    assert plan["experts"] == "stream" and plan["expert_slots"] > 0
    assert any(k.startswith("expert cache") for k in plan["device_parts"])
    assert plan["streamed_layers"] == 0 and plan["resident_layers"] == 48
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--experts", "device", "--offload", "stream"]) == 0
    layers = json.loads(out.getvalue())
    assert plan["seconds_per_pass"] < layers["seconds_per_pass"] / 5


def test_routing_is_reported(tiny_checkpoint) -> None:
    """What routing cost is in each generation's stats (experts woken per layer pass, the
    bytes copied, the cache's hit rate: what /metrics exports) and in the status."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.sampling import SamplingParams

    path = tiny_checkpoint("qwen3_moe", vocab_size=96, num_layers=2)
    rt = Runtime(RuntimeOptions(model=str(path), device="cpu", experts="stream", expert_slots=2,
                                context=96, draft=None))  # fmt: skip
    rt.generation([5, 9, 17, 33], SamplingParams(temperature=0.0), 12, ignore_eos=True).run()
    stats = rt.offload_stats()
    assert 1 <= stats["experts_woken_per_layer_pass"] <= 4
    assert stats["expert_bytes_copied"] > 0 and 0 <= stats["expert_hit_rate"] < 1
    assert rt.offload_stats()["expert_bytes_copied"] == 0  # since the last call: nothing
    status = rt.expert_status()
    assert status is not None and status["mode"] == "stream" and status["slots"] == 2
    assert status["experts"] == 8 and status["expert_copies"] > 0
    dense = Runtime(
        RuntimeOptions(model=str(tiny_checkpoint("llama", vocab_size=96)), device="cpu")
    )
    assert dense.expert_status() is None and "expert_bytes_copied" not in dense.offload_stats()


def test_auto_trees_over_streamed_experts_are_priced_by_experts_woken(tiny_checkpoint) -> None:
    """`--budget auto` over a target whose experts stream (or compute on the CPU) fits its
    pass cost against the experts a pass is expected to wake (4 experts, 2 a token: 2 at
    one token, 3.5 at three, never past 4); with the experts in their layers, against
    tokens."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime

    path = tiny_checkpoint("qwen3_moe", vocab_size=96)
    for mode, priced in (("stream", True), ("cpu", True), ("device", False)):
        rt = Runtime(RuntimeOptions(model=str(path), device="cpu", experts=mode, context=96,
                                    draft="ngram", budget="auto"))  # fmt: skip
        planner = rt.strategy("tree", budget="auto").planner
        feature = planner.target.feature  # type: ignore[attr-defined]
        assert (feature is not None) == priced, mode
        if priced:
            assert [feature(n) for n in (1, 3, 64)] == pytest.approx([2.0, 3.5, 4.0])


def test_gpt_oss_checkpoints_it_cannot_run_are_refused_by_name(tiny_checkpoint, tmp_path) -> None:
    """A quantization gpt-oss's loader does not read is refused naming its quant_method,
    and a stacked expert tensor of another shape is named before its bytes are read."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from modeling.checkpoints.folder_files import CheckpointError
    from modeling.weights.quant import UnsupportedQuantizationError

    source = tiny_checkpoint("gpt_oss", vocab_size=96)
    raw = json.loads((source / "config.json").read_text())
    with pytest.raises(UnsupportedQuantizationError, match="bitsandbytes"):
        config_from_hf({**raw, "quantization_config": {"quant_method": "bitsandbytes"}})
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    tensors[name] = tensors[name][:3].contiguous()  # 3 experts where the config says 4
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.down_proj \(3, 128, 64\)"):
        load(bad)
    # Stacked experts stored as integers: each expert is named, never cast to floats.
    tensors[name] = torch.ones(4, 128, 64, dtype=torch.int16)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"down_proj: .*torch\.int16 \(expected a float\)"):
        load(bad)


def _mxfp4_release(folder: Path, out: Path, reference: Path) -> None:
    """`folder`'s gpt-oss checkpoint as OpenAI's release stores it (experts as MXFP4
    `*_blocks` and `*_scales` by output row, two codes a byte low nibble first, the rest
    as it was, `quantization_config` mxfp4) in `out`, and in `reference` the same weights
    dense (each expert through MXFP4 and back, by gguf-py) for transformers to read."""
    import json
    import shutil

    import gguf
    import numpy as np
    from safetensors.numpy import load_file, save_file

    kind = gguf.GGMLQuantizationType.MXFP4
    packed, dense = {}, {}
    for name, value in load_file(folder / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (E, in, out)
            rows = np.ascontiguousarray(value.transpose(0, 2, 1), dtype=np.float32)
            blocks = gguf.quants.quantize(rows, kind).reshape(*rows.shape[:2], -1, 17)
            codes = np.stack([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], -2).reshape(
                *blocks.shape[:3], 32
            )  # ggml's order: 16 low nibbles, then 16 high ones
            packed[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
            packed[name + "_scales"] = np.ascontiguousarray(blocks[..., 0])
            back = gguf.quants.dequantize(gguf.quants.quantize(rows, kind), kind)
            dense[name] = np.ascontiguousarray(back.transpose(0, 2, 1))
        else:
            packed[name] = dense[name] = value
    for where, tensors in ((out, packed), (reference, dense)):
        where.mkdir(parents=True)
        for item in folder.iterdir():
            if item.name != "model.safetensors":
                shutil.copy(item, where / item.name)
        save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))


def test_gpt_oss_mxfp4_release_keeps_its_experts_packed(tiny_checkpoint, tmp_path: Path) -> None:
    """OpenAI's MXFP4 layout: each expert's blocks re-laid losslessly as ggml's MXFP4 (its
    codes and scale as stored), multiplied from them; logits equal transformers' on the
    decoded weights, and experts streamed give the resident model's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from modeling.weights.gguf_modules import GGUFLinear
    from modeling.weights.hqq import HQQLinear
    from speculative.sampling import SamplingParams

    _mxfp4_release(tiny_checkpoint("gpt_oss", vocab_size=96), tmp_path / "m", tmp_path / "ref")
    model, _, ckpt = load(tmp_path / "m")
    assert ckpt.config.moe is not None and ckpt.config.moe.expert_blocks == 39
    expert = model.layers[1].mlp.experts[2]
    assert isinstance(expert.up_proj, GGUFLinear) and expert.up_proj.ggml_type == 39
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    ids = torch.randint(3, 96, (19,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = model(ids, torch.arange(19), model.new_cache(20))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    prompt, greedy = [5, 9, 17, 33, 2, 8, 40, 11], SamplingParams(temperature=0.0)
    runs = [
        Runtime(RuntimeOptions(model=str(tmp_path / "m"), device="cpu", experts=mode,
                               expert_slots=slots, context=64, draft=None))
        .generation(prompt, greedy, 16, ignore_eos=True).run().token_ids
        for mode, slots in (("device", None), ("stream", 2))
    ]  # fmt: skip
    assert runs[0] == runs[1]
    # Its substitute: HQQ copies of the MXFP4 experts (decoded, then quantized), drafting
    # on the CPU beside the experts the target computes there.
    rt = Runtime(RuntimeOptions(model=str(tmp_path / "m"), device="cpu", experts="cpu",
                                context=64, draft="substitute", substitute_bits=4, budget=6))  # fmt: skip
    assert rt.draft is not None
    assert isinstance(rt.draft.layers[1].mlp.experts[2].up_proj, HQQLinear)
    out = rt.generation(prompt, greedy, 16, ignore_eos=True).run()
    assert out.token_ids == runs[0] and out.stats.accepted > 0


@pytest.mark.parametrize(("family", "mode"), [("qwen3_moe", "stream"), ("gpt_oss", "cpu")])
def test_the_substitute_of_a_mixture_in_ram_copies_its_experts(
    tiny_checkpoint, tmp_path: Path, family: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--draft substitute` of a target whose experts live in RAM: every layer's routed
    experts get resident 4-bit copies, the rest
    of each layer is the target's own module, the plan counts the copies, and a draft pass
    asks the target's expert source for nothing (only target passes route through it).
    Greedy output is the target's; a second start reads the stored copies."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from daemon.target_loading import expert_source
    from modeling.weights.hqq import HQQLinear
    from speculative.sampling import SamplingParams

    path = tiny_checkpoint(family, vocab_size=96, num_layers=3)
    prompt = [5, 9, 17, 33, 2, 8, 40, 11, 5, 9, 17]
    greedy = SamplingParams(temperature=0.0)
    plain = Runtime(RuntimeOptions(model=str(path), device="cpu", context=96, draft=None))
    expected = plain.generation(prompt, greedy, 24, ignore_eos=True).run().token_ids
    options = RuntimeOptions(
        model=str(path), device="cpu", context=96, draft="substitute", substitute_bits=4,
        experts=mode, expert_slots=3 if mode == "stream" else None, budget=8,
        substitute_cache=str(tmp_path),
    )  # fmt: skip
    rt = Runtime(options)
    assert rt.plan.expert_mode == mode and rt.draft is not None
    assert rt.substitute_layers == 3
    sub_layers, layers = list(rt.draft.layers), list(rt.target.layers)
    for own, theirs in zip(sub_layers, layers, strict=True):
        assert own.self_attn is theirs.self_attn and own.mlp.gate is theirs.mlp.gate
        assert own.input_layernorm is theirs.input_layernorm
        assert len(own.mlp.experts) == 4 and not len(theirs.mlp.experts)  # the source's
        projections = [m for m in own.mlp.experts.modules() if isinstance(m, nn.Linear | HQQLinear)]
        assert projections and all(isinstance(m, HQQLinear) for m in projections)
    expert = sub_layers[0].mlp.experts[0]
    copies = rt.plan.device_parts["draft weights"]
    assert copies == 3 * 4 * FlatLayout.of(expert).nbytes
    assert any("copies of the routed experts of all 3 layers" in n for n in rt.plan.notes)

    source = expert_source(rt.target)
    assert source is not None
    generation = rt.generation(prompt, greedy, 24, ignore_eos=True)
    out = generation.run()
    assert out.token_ids == expected
    stats = out.stats
    assert stats.draft_passes > 0 and stats.accepted > 0
    # The target's passes alone route through the source (its 3 layers each); the draft's
    # dozens of passes, none.
    assert source.stats.layer_passes == 3 * stats.target_passes

    monkeypatch.setattr(HQQLinear, "quantize_from", _no_quantizing)
    again = Runtime(options)
    assert again.draft is not None
    for a, b in zip(rt.draft.layers, again.draft.layers, strict=True):
        for (name, x), (_, y) in zip(
            a.mlp.experts.state_dict().items(), b.mlp.experts.state_dict().items(), strict=True
        ):
            assert torch.equal(x, y), name
    assert again.generation(prompt, greedy, 24, ignore_eos=True).run().token_ids == expected


def _no_quantizing(self, weight: torch.Tensor) -> None:
    raise AssertionError("the stored substitute was quantized again")


def test_the_substitute_of_streamed_mixture_layers(tiny_checkpoint) -> None:
    """Whole mixture layers streamed (`--experts device --offload stream`): each gets a
    low-bit copy whose router and shared-expert gate are the target's exactly (only the
    projections are quantized), and greedy output is the target's."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.sampling import SamplingParams

    path = tiny_checkpoint("qwen2_moe", vocab_size=96, num_layers=3)
    prompt, greedy = [5, 9, 17, 33, 2, 8, 40, 11, 5, 9, 17], SamplingParams(temperature=0.0)
    plain = Runtime(RuntimeOptions(model=str(path), device="cpu", context=96, draft=None))
    expected = plain.generation(prompt, greedy, 24, ignore_eos=True).run().token_ids
    rt = Runtime(RuntimeOptions(model=str(path), device="cpu", context=96, draft="substitute",
                                substitute_bits=4, experts="device", offload="stream",
                                resident_layers=0, budget=8))  # fmt: skip
    assert rt.draft is not None and rt.plan.streamed_layers == 3
    model = load(path)[0]
    for own, theirs in zip(rt.draft.layers, model.layers, strict=True):
        assert torch.equal(own.mlp.gate.weight, theirs.mlp.gate.weight)
        assert torch.equal(own.mlp.shared_expert_gate.weight, theirs.mlp.shared_expert_gate.weight)
    out = rt.generation(prompt, greedy, 24, ignore_eos=True).run()
    assert out.token_ids == expected and out.stats.accepted > 0


def _plan_json(folder: Path, *flags: str) -> dict:
    import contextlib
    import io
    import json

    from daemon.cli import main

    argv = ["plan", "--model", str(folder), "--device", "cuda", "--ram-budget", "64GiB",
            "--bandwidth", "25GB/s", "--draft", "none", "--context", "8192", "--json", *flags]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def test_experts_auto_weighs_the_cpu_against_the_bus(tmp_path: Path) -> None:
    """`--experts auto` for a Qwen3-30B-A3B shape on 16 GB (bus 25 GB/s): with a CPU that
    multiplies at 40 GB/s, the experts of as many whole layers as fit stay on the card
    and the other layers compute theirs on the CPU (a token's 2.7 GiB there costs less
    than the 2.6 GiB a pass copies); at 10 GB/s they stream by routing; on 4.5 GB, where
    no layer's experts fit beside the rest, all compute on the CPU; with no CPU rate
    known, they stream and the plan says why."""
    import json

    folder = tmp_path / "qwen3-30b-a3b"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({**REAL_SHAPES["qwen3-30b-a3b"], "torch_dtype": "bfloat16"})
    )
    fast = _plan_json(folder, "--gpu-budget", "16GiB", "--cpu-rate", "40GB/s")
    assert fast["experts"] == "mixed" and fast["expert_layers"] == {"device": 10, "cpu": 38}
    assert fast["device_parts"]["routed experts of layers 0-9 (resident)"] == 10 * 128 * (
        3 * 2048 * 768 * 2
    )
    assert fast["device_bytes"] <= 16 * 2**30 and fast["streamed_bytes_per_pass"] == 0
    assert any("71.7 ms" in n and "112 ms" in n for n in fast["notes"]), fast["notes"]
    slow = _plan_json(folder, "--gpu-budget", "16GiB", "--cpu-rate", "10GB/s")
    assert slow["experts"] == "stream" and slow["expert_layers"] == {"stream": 48}
    assert any("streamed by routing: " in n and "287 ms" in n for n in slow["notes"])
    small = _plan_json(folder, "--gpu-budget", "4.5GiB", "--cpu-rate", "40GB/s")
    assert small["experts"] == "cpu" and small["expert_layers"] == {"cpu": 48}
    unknown = _plan_json(folder, "--gpu-budget", "16GiB")
    assert unknown["experts"] == "stream" and unknown["budget"]["cpu_rates"] == []
    assert any("is not measured: --cpu-rate gives it" in n for n in unknown["notes"])


def test_experts_kept_per_layer_decode_as_with_their_layers(tiny_checkpoint) -> None:
    """A per-layer plan (`auto` with a fast CPU and room for one layer's experts): layer 0
    keeps its experts, layers 1 and 2 compute theirs from host RAM; greedy tokens, alone
    and under an n-gram tree, are the resident model's, and only those two layers route
    through the source."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from daemon.target_loading import expert_source
    from speculative.sampling import SamplingParams

    path = tiny_checkpoint("qwen3_moe", vocab_size=96, num_layers=3)
    prompt, greedy = [5, 9, 17, 33, 2, 8, 40, 11, 5, 9, 17], SamplingParams(temperature=0.0)
    plain = Runtime(RuntimeOptions(model=str(path), device="cpu", context=96, draft=None))
    expected = plain.generation(prompt, greedy, 24, ignore_eos=True).run().token_ids
    for draft in (None, "ngram"):
        rt = Runtime(RuntimeOptions(model=str(path), device="cpu", context=96, draft=draft,
                                    budget=8, gpu_budget="900KiB", bandwidth="1GB/s",
                                    cpu_rate="100GB/s"))  # fmt: skip
        assert rt.plan.expert_layers == ("device", "cpu", "cpu")
        assert rt.expert_status()["layers"] == {"device": 1, "cpu": 2}
        layers = list(rt.target.layers)
        assert len(layers[0].mlp.experts) == 4 and layers[0].mlp.source is None
        assert not len(layers[1].mlp.experts) and layers[2].mlp.source is not None
        out = rt.generation(prompt, greedy, 24, ignore_eos=True).run()
        assert out.token_ids == expected
        source = expert_source(rt.target)
        assert source is not None and source.stats.layer_passes == 2 * out.stats.target_passes


def test_the_cpu_rates_are_measured_per_dtype() -> None:
    from offload.machine import measure_cpu_rates

    rates = dict(measure_cpu_rates(side=512))
    assert set(rates) == {"bfloat16", "float16", "float32"}
    assert all(rate > 1e6 for rate in rates.values())
