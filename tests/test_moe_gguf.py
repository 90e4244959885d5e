"""Mixtures of experts from GGUF (issue 37): Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` with
`llama.expert_count`) written as llama.cpp's converter writes them (tests/gguf_writers.py:
each layer's experts stacked into `ffn_*_exps`, the router F32, Mixtral's q/k permuted),
F32 and with Q8_0 projections kept as their blocks per expert. The reference is
transformers on the same weights (the Q8_0 values decoded by gguf-py); experts with their
layers, streamed through the device cache and computed on the CPU give one greedy output;
a file whose expert metadata and tensors disagree is refused by name before anything is
split or built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeling.checkpoints.checkpoint import load
from modeling.checkpoints.gguf_model import GGUFError
from modeling.config import UnsupportedModelError
from modeling.layers.moe import MoEDecoderLayer
from modeling.weights.gguf_modules import GGUFLinear
from tests.gguf_writers import (
    SPM_VOCABULARY,
    as_stored,
    as_stored_gpt_oss,
    write_gpt_oss,
    write_moe,
)

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module")
def files(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(family, quantized) → (the GGUF file, the checkpoint transformers reads as its
    reference)."""
    made: dict[tuple[str, bool], tuple[Path, Path]] = {}

    def get(family: str, quantized: bool) -> tuple[Path, Path]:
        if (family, quantized) not in made:
            folder = tiny_checkpoint(family, vocab_size=SPM_VOCABULARY, num_layers=3)
            out = tmp_path_factory.mktemp(f"{family}-gguf")
            path = write_moe(folder, out / f"{family}.gguf", quantize=quantized)
            reference = as_stored(folder, out / "reference") if quantized else folder
            made[(family, quantized)] = (path, reference)
        return made[(family, quantized)]

    return get


def _logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    cache = model.new_cache(len(ids) + 1)
    with torch.no_grad():
        return model(torch.tensor(ids), torch.arange(len(ids)), cache)


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_written_file_is_transformers_on_its_weights(files, family: str, quantized: bool) -> None:
    """Every position's logits equal transformers' on the file's weights, and greedy ids
    too; quantized experts stay their blocks, one `GGUFLinear` per expert."""
    from transformers import AutoModelForCausalLM

    path, reference = files(family, quantized)
    model, _, ckpt = load(path, "fp32")
    cfg = ckpt.config
    assert cfg.model_type == family and cfg.moe is not None and cfg.moe.experts == 4
    # qwen3moe: llama.cpp's fixed choice; Mixtral's own; Qwen2-MoE's releases do not
    assert cfg.moe.normalize == (family != "qwen2_moe")
    layer = model.layers[1]
    assert isinstance(layer, MoEDecoderLayer)
    expert = layer.mlp.experts[3]
    assert isinstance(expert.down_proj, GGUFLinear) == quantized
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    ids = torch.randint(3, SPM_VOCABULARY, (23,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids.tolist()), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_by_routing_from_a_file_decode_alike(files, family: str) -> None:
    """The Q8_0 file with its experts in their layers, streamed through a device cache of 2
    and computed on the CPU: one greedy output, alone, under an n-gram tree and drafted by
    its substitute (low-bit copies of the file's packed experts)."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.sampling import SamplingParams

    path, _ = files(family, True)
    prompt = [5, 9, 17, 33, 2, 8, 40, 11, 5, 9, 17]
    greedy = SamplingParams(temperature=0.0)
    runs = {}
    for mode, slots in (("device", None), ("stream", 2), ("cpu", None)):
        for draft in (None, "ngram", "substitute"):
            rt = Runtime(RuntimeOptions(model=str(path), device="cpu", experts=mode,
                                        expert_slots=slots, context=96, draft=draft,
                                        substitute_bits=4, budget=8))  # fmt: skip
            assert rt.plan.expert_mode == mode
            runs[(mode, draft)] = rt.generation(prompt, greedy, 20, ignore_eos=True).run().token_ids
    # Whole layers, every expert with them, read from the file at every pass (each expert's
    # rows of the stacked `ffn_*_exps` tensors).
    rt = Runtime(RuntimeOptions(model=str(path), device="cpu", experts="device", context=96,
                                offload="stream", resident_layers=0, host_tier="disk", slots=2))  # fmt: skip
    assert rt.streamer is not None and rt.streamer.storage.tier == "disk"
    runs[("disk", None)] = rt.generation(prompt, greedy, 20, ignore_eos=True).run().token_ids
    assert len({tuple(ids) for ids in runs.values()}) == 1, runs


def test_the_plan_counts_a_files_packed_experts(files) -> None:
    """The plan's bytes per routed expert are the file's blocks (Q8_0: 34 bytes per 32
    values, plus the streamer's alignment per tensor), not a float expert's."""
    from daemon.footprint import footprint
    from modeling.checkpoints.checkpoint import open_checkpoint

    cfg = open_checkpoint(files("qwen3_moe", True)[0]).config
    assert cfg.moe is not None and cfg.quantization is not None
    blocks = 3 * cfg.hidden_size * cfg.moe.intermediate_size // 32 * 34
    planned = footprint(cfg, torch.float32, "target", device_type="cpu").expert_bytes
    assert blocks <= planned < blocks + 3 * 256
    assert planned < 3 * cfg.hidden_size * cfg.moe.intermediate_size * 4 // 3


@pytest.mark.parametrize(
    ("keys", "error", "words"),
    [
        ({"expert_count": 6}, GGUFError, r"expert_count make it \[.*6\]"),
        ({"expert_count": 0}, GGUFError, "expert_count is missing"),
        ({"expert_used_count": 9}, GGUFError, "expert_used_count"),
        ({"expert_feed_forward_length": 48}, GGUFError, "expert_feed_forward_length"),
        ({"expert_gating_func": 2}, UnsupportedModelError, "expert_gating_func"),
    ],
    ids=["count", "no-count", "used", "width", "sigmoid"],
)
def test_expert_metadata_the_tensors_deny_is_refused_by_name(
    tiny_checkpoint, tmp_path: Path, keys: dict, error: type, words: str
) -> None:
    folder = tiny_checkpoint("qwen3_moe", vocab_size=SPM_VOCABULARY, num_layers=3)
    path = write_moe(folder, tmp_path / "bad.gguf", quantize=True, keys=keys)
    with pytest.raises(error, match=words) as caught:
        load(path, "fp32")
    assert str(path) in str(caught.value)


def test_a_dense_architecture_with_experts_is_refused(tiny_checkpoint, tmp_path: Path) -> None:
    """A mixture's tensors and expert keys under a dense architecture's name (qwen3): refused
    by the key, not read as a mixture it is not."""
    folder = tiny_checkpoint("qwen3_moe", vocab_size=SPM_VOCABULARY, num_layers=3)
    path = write_moe(folder, tmp_path / "qwen3.gguf", quantize=False, arch="qwen3")
    with pytest.raises(UnsupportedModelError, match=r"qwen3\.expert_count"):
        load(path, "fp32")


@pytest.fixture(scope="module")
def gpt_oss_files(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """quantized → (a gpt-oss GGUF file, the checkpoint transformers reads as its reference)."""
    folder = tiny_checkpoint("gpt_oss", vocab_size=SPM_VOCABULARY, num_layers=3)
    out = tmp_path_factory.mktemp("gpt-oss-gguf")
    return {
        False: (write_gpt_oss(folder, out / "f32.gguf", quantize=False), folder),
        True: (write_gpt_oss(folder, out / "mxfp4.gguf"), as_stored_gpt_oss(folder, out / "ref")),
    }


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "mxfp4"])
def test_a_gpt_oss_file_is_transformers_on_its_weights(gpt_oss_files, quantized: bool) -> None:
    """gpt-oss as llama.cpp writes it (MXFP4 experts kept as their blocks, one `GGUFLinear`
    each; sinks, biases, the window, YaRN untruncated): every position's logits equal
    transformers' on the file's weights, past the window."""
    from transformers import AutoModelForCausalLM

    path, reference = gpt_oss_files[quantized]
    model, _, ckpt = load(path, "fp32")
    cfg = ckpt.config
    assert cfg.model_type == "gpt_oss" and cfg.moe is not None and cfg.moe.softmax_topk
    assert cfg.layer_window(0) == 6 and cfg.layer_window(1) is None and not cfg.rope.truncate
    expert = model.layers[2].mlp.experts[3]
    assert isinstance(expert.down_proj, GGUFLinear) == quantized
    if quantized:
        assert expert.down_proj.ggml_type == 39  # MXFP4
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    ids = torch.randint(3, SPM_VOCABULARY, (23,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids.tolist()), expected, atol=2e-4, rtol=1e-4)


def test_a_gpt_oss_file_speculates_and_streams_its_experts(gpt_oss_files) -> None:
    """The MXFP4 file under an n-gram tree, with its experts streamed through a cache of 2
    and on the CPU: plain greedy decoding's tokens."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.sampling import SamplingParams

    path, _ = gpt_oss_files[True]
    prompt = [5, 9, 17, 33, 2, 8, 40, 11, 5, 9, 17]
    greedy = SamplingParams(temperature=0.0)
    runs = {}
    for mode, slots, draft in (("device", None, None), ("device", None, "ngram"),
                               ("stream", 2, "ngram"), ("cpu", None, None)):  # fmt: skip
        rt = Runtime(RuntimeOptions(model=str(path), device="cpu", experts=mode,
                                    expert_slots=slots, context=96, draft=draft))  # fmt: skip
        runs[(mode, draft)] = rt.generation(prompt, greedy, 20, ignore_eos=True).run().token_ids
    # Whole layers read from the file at every pass: each expert's MXFP4 rows and biases.
    rt = Runtime(RuntimeOptions(model=str(path), device="cpu", context=96, offload="stream",
                                resident_layers=0, host_tier="disk", slots=2))  # fmt: skip
    assert rt.streamer is not None and rt.streamer.storage.tier == "disk"
    runs[("disk", None)] = rt.generation(prompt, greedy, 20, ignore_eos=True).run().token_ids
    assert len({tuple(ids) for ids in runs.values()}) == 1, runs


def test_shared_experts_where_the_architecture_has_none_are_refused(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """A Mixtral file (llama) stating a shared expert: refused by the key, not run without
    it (Qwen2-MoE's are read: its tensors say)."""
    folder = tiny_checkpoint("mixtral", vocab_size=SPM_VOCABULARY, num_layers=3)
    path = write_moe(folder, tmp_path / "bad.gguf", keys={"expert_shared_count": 1})
    with pytest.raises(UnsupportedModelError, match="expert_shared_count"):
        load(path, "fp32")
