"""`--draft substitute`: the target's own HQQ-quantized layers as its draft, sharing its
embedding, head and KV cache. Greedy parity through the daemon's runtime (a streamed
target, so its layers really are quantized), what is shared and what is not, the cache
left exactly as the target's own commit leaves it, building one layer at a time, and the
plans the issue asks for. Losslessness at T > 0 is tests/test_lossless.py's."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.footprint import footprint
from daemon.memory_plan import OffloadOptions
from daemon.options import RuntimeOptions
from daemon.pair_plan import plan_with_draft
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load
from modeling.substitute import build_substitute, share_placed
from modeling.weights.hqq import HQQLinear
from offload.plan import MemoryBudget
from offload.planning import PlanError
from scripts.real_shapes import build_model, full_config, model_config
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "Once upon a time"


def streamed_runtime(target: Path, bits: int | str, strategy: str = "tree") -> Runtime:
    """The stories target streamed layer by layer (none resident): every layer gets a
    quantized substitute."""
    return Runtime(
        RuntimeOptions(
            model=str(target), draft="substitute", substitute_bits=bits, strategy=strategy,
            offload="stream", resident_layers=0, budget=32, device="cpu", context=512,
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(stories_target: Path) -> list[int]:
    target, tok, _ = load(stories_target)
    ar = Autoregressive(target)
    gen = Generation(ar, ar.new_session(512), tok, tok.encode(PROMPT), GREEDY, 120, ignore_eos=True)
    return gen.run().token_ids


@pytest.mark.parametrize("strategy", ["tree", "linear"])
@pytest.mark.parametrize("bits", [4, 2])
def test_greedy_output_is_the_targets(
    stories_target: Path, reference: list[int], strategy: str, bits: int
) -> None:
    rt = streamed_runtime(stories_target, bits, strategy)
    assert rt.draft_kind == "substitute" and rt.substitute_bits == bits
    layers = rt.target.config.num_layers
    assert rt.draft_stats()["substitute_layers"] == layers  # every layer streams: all copies
    gen = rt.generation(rt.tokenizer.encode(PROMPT), GREEDY, 120, ignore_eos=True).run()
    assert gen.token_ids == reference
    if bits == 4:  # a 4-bit copy of the target agrees with it: many tokens per pass
        assert gen.stats.to_dict()["tokens_per_target_pass"] > 4.0


def test_what_is_shared_and_what_is_not(stories_target: Path) -> None:
    rt = streamed_runtime(stories_target, 4)
    sub, target = rt.draft, rt.target
    assert sub is not None and sub is not target
    assert sub.embed_tokens is target.embed_tokens and sub.lm_head is target.lm_head
    assert sub.norm is target.norm and sub.inv_freq is target.inv_freq
    packed = [m for m in sub.modules() if isinstance(m, HQQLinear)]
    assert len(packed) == 7 * target.config.num_layers and {m.bits for m in packed} == {4}
    # No cache of its own: a session holds the target's only.
    strategy = rt.strategy("tree")
    session = rt.new_session(strategy)
    assert session.draft_cache is None
    # After every round the target's cache holds exactly the committed tokens: the draft's
    # rows past them were dropped before the target wrote its own.
    gen = Generation(strategy, session, rt.tokenizer, rt.tokenizer.encode(PROMPT), GREEDY, 60)
    for _ in gen:
        assert session.target_cache.length == len(session.target_tokens)


def test_resident_layers_are_their_own_substitutes(stories_target: Path) -> None:
    """A target that fits: every layer resident, nothing quantized, the draft computes
    with the target's own modules (which `auto` judges on the CPU like any draft)."""
    rt = Runtime(RuntimeOptions(model=str(stories_target), draft="substitute", device="cpu"))
    assert rt.draft is not None and rt.streamer is None
    assert not [m for m in rt.draft.modules() if isinstance(m, HQQLinear)]
    target_layers = list(rt.target.layers)  # type: ignore[arg-type]
    assert all(a is b for a, b in zip(rt.draft.layers, target_layers, strict=True))  # type: ignore[arg-type]


def test_placing_the_target_keeps_its_rope_table_shared(stories_target: Path) -> None:
    """Moving the target to its device replaces its buffers (the RoPE table) but moves its
    shared embedding, norm and head in place: the loader shares the table again after
    placing, else the substitute computes with a table left behind on the CPU (the CUDA
    failure this pins; a cast replaces buffers as a move to `cuda` does)."""
    target, _, _ = load(stories_target)
    layers = list(target.layers)  # type: ignore[arg-type]
    sub = build_substitute(target, 4, layers, lambda i: True, torch.device("cpu"))
    target.to(torch.float64)
    assert sub.inv_freq is not target.inv_freq
    share_placed(sub, target)
    assert sub.inv_freq is target.inv_freq
    assert sub.embed_tokens.weight.dtype == torch.float64


def test_building_holds_one_layer_at_a_time() -> None:
    """The substitute of a real-shaped layer stack is built beside the target with no more
    than its own packed bytes plus one projection's working copies at a time: the target's
    dense weights are never copied whole."""
    from offload.machine import PeakMemory

    config = model_config("llama-3.2-1b", layers=2, hidden_scale=1 / 4)
    target = build_model(config, torch.float32, seed=0)
    layers = list(target.layers)  # type: ignore[arg-type]
    largest = max(m.weight.numel() for m in target.modules() if isinstance(m, torch.nn.Linear))
    with PeakMemory("cpu") as peak:
        sub = build_substitute(target, 4, layers, lambda i: True, torch.device("cpu"))
    if peak.bytes is None:
        pytest.skip("no /proc: peak memory cannot be measured here")
    packed = sum(b.numel() * b.element_size() for b in sub.layers.buffers())  # type: ignore[union-attr]
    # An fp32 block's quantization temporaries are a few copies of one projection (the
    # scaled weights, codes, the residual and its shrinkage, each rows × inputs fp32).
    assert peak.bytes < packed + 8 * largest * 4, (peak.bytes, packed, largest)


def cuda_budget(gpu: float, ram: float) -> MemoryBudget:
    return MemoryBudget("cuda", int(gpu), "test", int(ram), "test", 25e9, "test")


@pytest.mark.parametrize(
    ("name", "gpu", "ram", "bits"),
    [
        ("llama-3.1-8b", 8e9, 32e9, 3),
        ("llama-3.1-8b", 12e9, 32e9, 8),
        ("qwen2.5-32b", 24e9, 64e9, 3),
    ],
)
def test_auto_bits_plans_the_most_that_fit(name: str, gpu: float, ram: float, bits: int) -> None:
    plan, drafting = plan_with_draft(
        full_config(name), "substitute", None, "auto", name, "auto", "auto", "cuda",
        OffloadOptions(prefix_cache_bytes=1 << 30, sequences=12), cuda_budget(gpu, ram),
    )  # fmt: skip
    assert drafting.substitute_bits == bits
    assert drafting.substitute_layers == plan.streamed_layers > 0
    assert plan.device_bytes <= plan.budget.device_bytes
    rendered = plan.render()
    assert f"substitute ({bits}-bit HQQ of the target)" in rendered
    assert "shares the target's embedding, norm, head and KV cache" in rendered
    assert "draft KV cache" not in rendered  # it has none


def test_a_70b_on_24_gb_says_what_would_fit_and_why_not() -> None:
    with pytest.raises(PlanError) as info:
        plan_with_draft(
            full_config("llama-3.1-70b"), "substitute", None, "auto", "70b", "auto", "auto",
            "cuda", OffloadOptions(prefix_cache_bytes=1 << 30), cuda_budget(24e9, 64e9),
        )  # fmt: skip
    message = str(info.value)
    assert "does not fit at 8-bit, 4-bit, 3-bit, 2-bit" in message
    assert "draft weights" in message and "--draft MODEL" in message


def test_a_second_start_reads_the_stored_substitute(
    stories_target: Path, tmp_path: Path, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start builds the substitute and stores it; the second reads it (nothing
    is quantized: HQQ would fail here) and drafts the same; other bits are another file."""
    options = RuntimeOptions(
        model=str(stories_target), draft="substitute", substitute_bits=4, offload="stream",
        resident_layers=0, budget=32, device="cpu", context=512, substitute_cache=str(tmp_path),
    )  # fmt: skip
    first = Runtime(options)
    stored = list(tmp_path.glob("*/manifest.json"))
    assert len(stored) == 1 and not list(tmp_path.glob("*.partial"))
    assert len(list(stored[0].parent.glob("layer-*.safetensors"))) == 5

    def no_quantizing(self: HQQLinear, weight: torch.Tensor) -> None:
        raise AssertionError("the stored substitute was quantized again")

    monkeypatch.setattr(HQQLinear, "quantize_from", no_quantizing)
    second = Runtime(options)
    assert first.draft is not None and second.draft is not None
    for a, b in zip(
        first.draft.state_dict().items(), second.draft.state_dict().items(), strict=True
    ):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    ids = second.tokenizer.encode(PROMPT)
    assert second.generation(ids, GREEDY, 120, ignore_eos=True).run().token_ids == reference
    monkeypatch.undo()
    Runtime(replace(options, substitute_bits=8))
    assert len(list(tmp_path.glob("*/manifest.json"))) == 2


@pytest.mark.parametrize(
    "damage", ["truncated", "garbage", "a wrong shape", "not finite", "fifo", "a sparse giant"]
)
def test_a_damaged_stored_substitute_is_built_again(
    damage: str,
    stories_target: Path,
    tmp_path: Path,
    reference: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stored layer that does not read back (cut short, garbage, other shapes, a NaN, a
    FIFO) crashed every start until the user deleted the folder, or hung: now it is one
    line, the substitute is built, and the next complete build replaces the folder."""
    from safetensors.torch import load_file, save_file

    options = RuntimeOptions(
        model=str(stories_target), draft="substitute", substitute_bits=4, offload="stream",
        resident_layers=0, budget=32, device="cpu", context=512, substitute_cache=str(tmp_path),
    )  # fmt: skip
    Runtime(options)
    (folder,) = (m.parent for m in tmp_path.glob("*/manifest.json"))
    layer = folder / "layer-2.safetensors"
    if damage == "truncated":
        layer.write_bytes(layer.read_bytes()[:100])
    elif damage == "garbage":
        layer.write_bytes(b"\xff" * 4096)
    elif damage == "fifo":
        layer.unlink()
        os.mkfifo(layer)
    elif damage == "a sparse giant":  # a norm claiming 2^28 values (1 GiB, sparse on disk)
        _claim_a_giant(layer, 1 << 28)
    else:
        tensors = load_file(layer)
        name = next(k for k, v in tensors.items() if v.is_floating_point() and v.ndim == 1)
        bad = tensors[name].clone()
        tensors[name] = bad[:-1] if damage == "a wrong shape" else bad.fill_(float("nan"))
        save_file(tensors, layer)
    with caplog.at_level(logging.WARNING, logger="specd.loading"):
        again = Runtime(options)
    assert "layer-2.safetensors does not read back" in caplog.text
    said = [r.getMessage() for r in caplog.records if "does not read back" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]
    if damage == "a sparse giant":  # refused by its shape before it was read (46 s, 11.8 GB)
        assert "is stored as [268435456]" in said[0]
    ids = again.tokenizer.encode(PROMPT)
    assert again.generation(ids, GREEDY, 120, ignore_eos=True).run().token_ids == reference
    assert not folder.exists()  # read in part: dropped, for the next start to build whole
    Runtime(options)
    assert (
        len(list(folder.glob("layer-*.safetensors"))) == 5 and (folder / "manifest.json").is_file()
    )


def test_a_substitute_cache_that_cannot_be_written_is_skipped(
    stories_target: Path, tmp_path: Path, reference: list[int]
) -> None:
    """`substitutes` being a file (or a folder not writable) crashed the build."""
    blocked = tmp_path / "substitutes"
    blocked.write_text("not a folder")
    options = RuntimeOptions(
        model=str(stories_target), draft="substitute", substitute_bits=4, offload="stream",
        resident_layers=0, budget=32, device="cpu", context=512, substitute_cache=str(blocked),
    )  # fmt: skip
    rt = Runtime(options)
    ids = rt.tokenizer.encode(PROMPT)
    assert rt.generation(ids, GREEDY, 120, ignore_eos=True).run().token_ids == reference
    assert blocked.read_text() == "not a folder"


def test_the_engine_says_how_far_the_build_is(stories_target: Path) -> None:
    """What /health and /v1/specd/status show while the models load: the substitute's
    build, layer by layer (here read once it is done)."""
    from daemon.engine import Engine, EngineLimits
    from daemon.metrics import Metrics

    options = RuntimeOptions(
        model=str(stories_target), draft="substitute", substitute_bits=4, offload="stream",
        resident_layers=0, budget=8, device="cpu", context=512,
    )  # fmt: skip
    seen: list[str] = []
    engine = Engine(options, EngineLimits(), Metrics())
    engine._loading = seen.append  # type: ignore[method-assign]
    engine.start()
    try:
        assert engine.loaded.wait(60) and engine.load_error is None
    finally:
        engine.shutdown()
    assert seen == [f"building the 4-bit substitute draft: {i} of 5 layers" for i in range(1, 6)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_substitute_is_built_there_and_exact(
    stories_target: Path, reference: list[int]
) -> None:
    """Streamed from pinned RAM to the GPU, the substitute built on the GPU (each
    projection quantized there), greedy output the target's."""
    rt = Runtime(
        RuntimeOptions(
            model=str(stories_target), draft="substitute", substitute_bits=4, device="cuda",
            offload="stream", resident_layers=0, budget=32, context=512, dtype="fp32",
        )
    )  # fmt: skip
    assert rt.draft is not None and rt.streamer is not None
    assert all(m.codes.is_cuda for m in rt.draft.modules() if isinstance(m, HQQLinear))
    gen = rt.generation(rt.tokenizer.encode(PROMPT), GREEDY, 120, ignore_eos=True).run()
    assert gen.token_ids == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compiled_substitute_is_exact(
    stories_target: Path, reference: list[int]
) -> None:
    """Its steps compiled and captured as CUDA graphs (issue 36: the substitute's step at
    its compiled speed), each HQQ projection rebuilt inside the graph: greedy output the
    target's, and the draft's passes ran through the graphs."""
    rt = Runtime(
        RuntimeOptions(
            model=str(stories_target), draft="substitute", substitute_bits=4, device="cuda",
            offload="stream", resident_layers=0, budget=32, context=512, dtype="fp32",
            prefix_cache=0, compile="on",
        )
    )  # fmt: skip
    assert rt.draft is not None
    compilation = rt.compile(serving=True)  # as the daemon does with --compile on
    compilation.warm()
    state = compilation.to_dict()["draft"]
    assert state["state"] == "ready", state
    prompt = rt.tokenizer.encode(PROMPT)
    gen = rt.generation(prompt, GREEDY, 120, strategy="tree", ignore_eos=True).run()
    assert gen.token_ids == reference
    passes = compilation.states["draft"].passes
    assert passes is not None and 0 < passes.passes <= gen.stats.draft_passes
    assert passes.graphs is not None and passes.graphs.replays > 0


def test_a_short_prompt_rides_in_the_first_tree_pass(
    stories_target: Path, reference: list[int]
) -> None:
    """The substitute drafts over a short prompt itself (in the target's cache, rows it
    drops before the target verifies), so the prompt is prefilled by the first
    verification pass: no plain target pass of its own (every pass verified a tree; the
    first counts as the prompt's prefill pass, which plain decoding spends), output
    unchanged."""
    rt = streamed_runtime(stories_target, 4)
    gen = rt.generation(rt.tokenizer.encode(PROMPT), GREEDY, 120, ignore_eos=True).run()
    assert gen.token_ids == reference
    assert gen.stats.target_passes == sum(gen.stats.verification_rounds.values())
    assert gen.stats.prefill_passes == 1


def test_the_plan_counts_copies_of_the_streamed_layers_only() -> None:
    """A resident target layer is its own substitute: the plan reserves copies of the
    streamed layers alone (an 8B that fits whole on 24 GB needs none; on 12 GB every
    streamed layer has its copy and nothing more)."""
    options = OffloadOptions(prefix_cache_bytes=1 << 30, sequences=12)
    whole, _ = plan_with_draft(
        full_config("llama-3.1-8b"), "substitute", None, "auto", "8b", "auto", "auto", "cuda",
        options, cuda_budget(24e9, 64e9),
    )  # fmt: skip
    assert whole.streamed_layers == 0 and whole.device_parts["draft weights"] == 0
    streamed, drafting = plan_with_draft(
        full_config("llama-3.1-8b"), "substitute", None, 4, "8b", "auto", 8192, "cuda",
        options, cuda_budget(12e9, 64e9),
    )  # fmt: skip
    assert drafting.config is not None
    per_layer = footprint(drafting.config, torch.bfloat16, "substitute").layer_bytes
    assert streamed.streamed_layers > 0
    assert streamed.device_parts["draft weights"] == streamed.streamed_layers * per_layer
    layers = streamed.resident_layers + streamed.streamed_layers
    assert f"{streamed.streamed_layers} of {layers} layers are 4-bit copies" in streamed.render()


def test_a_packed_target_shares_its_layers_at_equal_bits(shared_models: Path) -> None:
    """A 4-bit GPTQ target's 4-bit substitute is its own packed layers copied to the
    device as stored (nothing quantized again: the draft is the target, every drafted token
    is accepted); `auto` tries no more bits than the target has."""
    from modeling.weights.block_layout import BlockQuantizedLinear
    from modeling.weights.packed import GPTQLinear

    path = str(shared_models / "quantized" / "gptq-w4-g32")
    options = RuntimeOptions(
        model=path, draft="substitute", substitute_bits=4, device="cpu", budget=16,
        offload="stream", resident_layers=0, slots=2, dtype="fp32",
    )  # fmt: skip
    runtime = Runtime(options)
    substitute = runtime.draft
    assert substitute is not None
    # (as stored, or as the Q4_0 blocks this CPU lays a symmetric GPTQ out as)
    stored = (GPTQLinear, BlockQuantizedLinear)
    shared = [m for m in substitute.layers.modules() if isinstance(m, stored)]  # type: ignore[union-attr]
    assert shared and not any(isinstance(m, HQQLinear) for m in substitute.modules())
    assert "device copies of its packed layers as stored" in runtime.plan.render()
    ids = runtime.tokenizer.encode("Once upon a time")
    reference = Generation(
        runtime.strategy("autoregressive"),
        runtime.new_session(runtime.strategy("autoregressive")),
        runtime.tokenizer, ids, SamplingParams(temperature=0.0), 48, ignore_eos=True,
    ).run()  # fmt: skip
    tree = runtime.strategy("tree")
    gen = Generation(
        tree, runtime.new_session(tree), runtime.tokenizer, ids,
        SamplingParams(temperature=0.0), 48, ignore_eos=True,
    ).run()  # fmt: skip
    assert gen.token_ids == reference.token_ids
    stats = gen.stats.to_dict()
    # The draft is the target: every pass emits as many tokens as a tree of the budget can
    # give (its chain of 16, the last drafted token's place taken by the target's own): 3
    # passes, the first also the prompt's prefill pass (plain decoding spends one there).
    assert stats["target_passes"] == 3 and stats["prefill_passes"] == 1, stats
    assert stats["tokens_per_target_pass"] == 24.0, stats
    _, drafting = plan_with_draft(
        runtime.target.config, "substitute", None, "auto", path, "fp32", "auto", "cpu",
        OffloadOptions(offload="stream", resident_layers=0), runtime.plan.budget,
    )  # fmt: skip
    assert drafting.substitute_bits == 4  # not 8: no more bits than the target has


def test_a_resident_target_says_its_substitute_is_itself(
    stories_target: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every layer resident (a CPU run): no layer has a low-bit copy, and the stats, the
    status, the plan and the log (what `specd generate` shows) say so rather than only the
    bits asked for."""
    with caplog.at_level("WARNING", logger="specd"):
        rt = Runtime(
            RuntimeOptions(model=str(stories_target), draft="substitute", substitute_bits=2,
                           device="cpu", context=256)
        )  # fmt: skip
    assert any("the target drafts for itself" in r.getMessage() for r in caplog.records)
    assert rt.draft_stats() == {
        "draft_kind": "substitute", "substitute_bits": 2, "substitute_layers": 0,
        "draft_reason": None,  # given, not chosen by `--draft auto`
    }  # fmt: skip
    layers = rt.target.config.num_layers
    assert f"0 of {layers} layers are 2-bit copies" in rt.plan.render()
    assert "the substitute is the target itself" in rt.plan.render()


def _claim_a_giant(layer: Path, values: int) -> None:
    """`layer` rewritten with its first 1-D float tensor claiming `values` F32 values: the
    file is sparse, a few KB on disk."""
    import json as json_
    import struct

    from safetensors.torch import load_file

    tensors = load_file(layer)
    giant = next(k for k, v in tensors.items() if v.is_floating_point() and v.ndim == 1)
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8"}  # fmt: skip
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for key in sorted(k for k in tensors if k != giant):
        data = tensors[key].contiguous().view(torch.uint8).numpy().tobytes()
        header[key] = {"dtype": names[tensors[key].dtype], "shape": list(tensors[key].shape),
                       "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        blobs.append(data)
        offset += len(data)
    header[giant] = {
        "dtype": "F32",
        "shape": [values],
        "data_offsets": [offset, offset + 4 * values],
    }
    head = json_.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with layer.open("wb") as out:
        out.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
        out.truncate(8 + len(head) + offset + 4 * values)
