"""Resident layers joining the stream at run time and coming back (offload/stream.py's
`demote`, `promote` and `over_resident`, the memory-pressure step `resident_layers`): the
logits stay bit-identical across the switch, in the middle of a sequence, and the demoted
layers' modules hold no memory of their own while streamed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from modeling.checkpoints.checkpoint import load
from offload.stream import LayerStreamer
from tests.test_stream import PROMPT, TREE_TOKENS, streamed_model, tree_mask


def steps(model: nn.Module, cache: object, between: object = None) -> list[torch.Tensor]:
    """The passes of tests/test_stream.py's `passes`, calling `between()` after the first
    two (so the switch happens with a filled cache, as it does in the daemon)."""
    n = len(PROMPT)
    out = [model(torch.tensor(PROMPT), torch.arange(n), cache)]
    out.append(model(torch.tensor([300]), torch.tensor([n]), cache))
    if callable(between):
        between()
    cached = cache.length  # type: ignore[attr-defined]
    mask, positions = tree_mask(cached)
    out.append(model(torch.tensor(TREE_TOKENS), positions, cache, mask=mask))
    cache.keep([*range(cached), cached, cached + 1, cached + 3])  # type: ignore[attr-defined]
    out.append(model(torch.tensor([5]), torch.tensor([cached + 3]), cache))
    return out


def reference(path: Path) -> list[torch.Tensor]:
    model, _, _ = load(path, "fp32", "cpu")
    return steps(model, model.new_cache(64))


def held_bytes(module: nn.Module) -> int:
    """Bytes the module's tensors hold outside the meta device."""
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()] if not t.is_meta)


@pytest.mark.parametrize(("resident", "tier"), [([0, 1, 3], "ram"), ([1, 2, 4], "disk")])
def test_demoted_layers_stream_and_come_back_exactly(
    stories_target: Path, resident: list[int], tier: str
) -> None:
    want = reference(stories_target)
    model, streamer, layers = streamed_model(stories_target, resident, 2, tier)
    demote = resident[:2]
    layer_bytes = streamer.layout.nbytes
    base_host = streamer.host_bytes
    freed: list[int] = []

    cache = model.new_cache(64)
    got = steps(model, cache, lambda: freed.append(streamer.demote(demote)))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert freed == [layer_bytes * 2]
    assert sorted(streamer.resident) == resident[2:]
    assert streamer.streamed_layers == len(layers) - 1
    assert all(held_bytes(layers[i]) == 0 for i in demote)  # their memory went to the host
    assert streamer.host_bytes >= base_host + 2 * layer_bytes
    fetched = set(streamer.fetch_log)
    assert set(demote) <= fetched

    with pytest.raises(RuntimeError, match="promote them first"):
        streamer.demote(resident[2:])

    cache = model.new_cache(64)
    got = steps(model, cache, streamer.promote)  # back between passes, mid-sequence
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert sorted(streamer.resident) == resident and streamer.demoted is None
    assert streamer.host_bytes == base_host
    assert all(held_bytes(layers[i]) == layer_bytes for i in demote)  # one flat buffer each
    streamer.fetch_log.clear()
    steps(model, model.new_cache(64))
    assert not set(streamer.fetch_log) & set(resident)  # resident again: never fetched


def test_a_resident_model_streams_some_layers_and_gets_them_back(stories_target: Path) -> None:
    want = reference(stories_target)
    model, _, _ = load(stories_target, "fp32", "cpu")
    layers = list(model.layers)
    holder: dict[str, LayerStreamer] = {}

    def demote() -> None:
        holder["s"] = LayerStreamer.over_resident(layers, [1, 2, 3], "cpu", slots=2)
        model.set_layers(holder["s"])

    got = steps(model, model.new_cache(64), demote)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    streamer = holder["s"]
    assert streamer.streamed_layers == 3 and streamer.counters.passes == 2
    assert all(held_bytes(layers[i]) == 0 for i in (1, 2, 3))
    with pytest.raises(RuntimeError, match="still streamed"):
        streamer.resident_modules()

    def promote() -> None:
        assert streamer.promote() == [1, 2, 3]
        model.set_layers(nn.ModuleList(streamer.resident_modules()))
        streamer.close()

    got = steps(model, model.new_cache(64), promote)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert isinstance(model.layers, nn.ModuleList)
    assert [id(m) for m in model.layers] == [id(m) for m in layers]  # the same modules


def runtime_of(
    model: nn.Module, streamer: LayerStreamer | None = None, draft: str = "model"
) -> Any:
    """What the relief steps read of a daemon's Runtime."""
    return SimpleNamespace(
        target=model, draft=None, draft_kind=draft, streamer=streamer,
        device=torch.device("cpu"), dtype="fp32",
    )  # fmt: skip


def test_the_step_demotes_half_of_a_streamers_resident_layers(stories_target: Path) -> None:
    from daemon.relief import TargetLayers

    want = reference(stories_target)
    model, streamer, _ = streamed_model(stories_target, [0, 1, 2], 2)
    step = TargetLayers(runtime_of(model, streamer), host_floor=0)
    assert step.possible() is None
    said = step.demote()
    assert "target layers [1, 2] streamed" in said and sorted(streamer.resident) == [0]
    assert all(
        torch.equal(a, b) for a, b in zip(want, steps(model, model.new_cache(64)), strict=True)
    )
    step.promote()
    assert sorted(streamer.resident) == [0, 1, 2] and step.moved == []
    step.promote()  # undoing twice changes nothing


def test_the_step_says_why_it_cannot_move_layers(stories_target: Path) -> None:
    from daemon.relief import TargetLayers

    model, _, _ = load(stories_target, "fp32", "cpu")
    assert TargetLayers(runtime_of(model, draft="substitute"), 0).possible() == (
        "the substitute draft shares the resident layers"
    )
    model.compiled = object()  # type: ignore[assignment]
    assert TargetLayers(runtime_of(model), 0).possible() == "the target's passes are compiled"
    model.compiled = None
    model.set_layers(nn.ModuleList(list(model.layers)[:4]))  # 2 would move: no gain on 2 slots
    assert "too few" in str(TargetLayers(runtime_of(model), 0).possible())
    # Host RAM short: nothing moves, and undoing is a no-op.
    short = TargetLayers(runtime_of(load(stories_target, "fp32", "cpu")[0]), host_floor=1 << 60)
    assert short.demote().startswith("nothing moved:") and short.moved == []
    short.promote()
    assert short.runtime.streamer is None


def test_graph_pools_are_released_and_resumed(stories_draft: Path) -> None:
    from daemon.relief import GraphPools
    from modeling.compiled import CompiledPasses
    from tests.test_step_graphs import Replaying

    model, _, _ = load(stories_draft, "fp32", "cpu")
    passes = CompiledPasses(model, compile=False, graphs=True, capture=Replaying())
    model.compiled = passes
    model.forward(torch.tensor([3]), torch.tensor([0]), model.new_cache(64))
    assert passes.graphs is not None and len(passes.graphs) == 1
    pools = GraphPools(runtime_of(model))
    assert pools.release() == "1 CUDA graphs dropped, none captured until eased"
    assert passes.graphs.held and len(passes.graphs) == 0
    pools.resume()
    assert not passes.graphs.held
    model.compiled = None


@pytest.mark.parametrize("resident", [None, 2])
def test_gguf_layers_of_mixed_types_keep_their_types_when_demoted(resident: int | None) -> None:
    """Q4_K_M keeps some layers' attn_v and ffn_down in other types: a demoted layer
    streams with its own types (the slot takes them on), so greedy decoding still gives
    the reference ids of transformers' GGUF loader, and again once the layers are back."""
    from daemon.options import RuntimeOptions
    from daemon.relief import TargetLayers
    from daemon.runtime import Runtime
    from tests.test_gguf_model import GGUF, assert_greedy_ids_match

    name = "stories260k-Q4_K_M"  # 5 layers; Q5_0 and Q8_0 beside Q4_K
    offload = {"offload": "none"} if resident is None else {"offload": "stream"}
    options = RuntimeOptions(
        model=str(GGUF / f"{name}.gguf"), device="cpu", dtype="fp32", slots=2,
        resident_layers=resident if resident is not None else "auto", **offload,
    )  # fmt: skip
    runtime = Runtime(options)
    step = TargetLayers(runtime, host_floor=0)  # type: ignore[arg-type]
    assert step.possible() is None

    assert "streamed from host RAM" in step.demote()
    assert runtime.streamer is not None and set(step.moved) <= set(runtime.streamer.order)
    assert_greedy_ids_match(runtime, name)
    step.promote()
    assert_greedy_ids_match(runtime, name)


def test_the_ram_tier_gives_way_to_the_disk_tier_and_is_read_back(stories_target: Path) -> None:
    """Host pressure's `disk_tier` step: the streamed layers' RAM arena is freed and they
    stream from the checkpoint's files (through staging buffers); eased, they are read back
    into RAM on a thread of their own and the first pass after that streams from RAM.
    Logits stay bit-identical through both switches."""
    from daemon.target_loading import disk_sources
    from offload.storage import DiskStorage

    want = reference(stories_target)
    model, streamer, _ = streamed_model(stories_target, [0], 2)
    _, _, ckpt = load(stories_target, "fp32", "cpu")
    arena = streamer.host_bytes
    names = [e.name for e in streamer.layout.tensors]

    def to_disk() -> None:
        disk = DiskStorage(streamer.layout, disk_sources(ckpt, streamer.order, names, "fp32"))
        assert streamer.to_disk(disk) == arena

    got = steps(model, model.new_cache(64), to_disk)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert streamer.storage.tier == "disk" and streamer.staging is not None
    assert streamer.host_bytes == streamer.staging.nbytes < arena

    streamer.to_ram()
    assert streamer._refill is not None
    streamer._refill[0].result(timeout=60)  # read back; adopted by the next pass
    assert streamer.storage.tier == "disk"
    got = steps(model, model.new_cache(64))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert streamer.storage.tier == "ram" and streamer.staging is None
    assert streamer.host_bytes == arena

    # Pressure back before the read-back finished: it is cancelled, the disk tier stays.
    to_disk()
    streamer.to_ram()
    to_disk_again = DiskStorage(streamer.layout, disk_sources(ckpt, streamer.order, names, "fp32"))
    assert streamer.to_disk(to_disk_again) == 0 and streamer._refill is None
    got = steps(model, model.new_cache(64))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert streamer.storage.tier == "disk"
    streamer.close()


def test_the_disk_tier_step_says_why_it_cannot_move_layers(stories_target: Path) -> None:
    from daemon.relief import HostTier

    model, streamer, _ = streamed_model(stories_target, [0], 2)
    _, _, ckpt = load(stories_target, "fp32", "cpu")
    runtime = runtime_of(model, streamer)
    runtime.checkpoint, runtime.options = ckpt, SimpleNamespace(quantize=None)
    assert HostTier(runtime).possible() is None
    runtime.options.quantize = "int4"
    assert HostTier(runtime).possible() == "the layers were quantized at load (--quantize int4)"
    runtime.options.quantize = None
    runtime.streamer = None
    assert HostTier(runtime).possible() == "no target layers stream from RAM"
    undo = HostTier(runtime)
    assert undo.to_disk().startswith("nothing moved:")
    undo.to_ram()  # nothing was moved: nothing to read back


def test_a_gguf_targets_ram_tier_gives_way_to_its_file() -> None:
    """The `disk_tier` step on a GGUF target (Q4_K_M: Q4_K, Q5_0 and Q8_0 layers in one
    room): its streamed layers are then read from the file at every pass, converted as
    loading converts them, and greedy decoding keeps the ids of transformers' GGUF loader,
    before and after the layers are read back into RAM."""
    from daemon.options import RuntimeOptions
    from daemon.relief import HostTier
    from daemon.runtime import Runtime
    from tests.test_gguf_model import GGUF, assert_greedy_ids_match

    name = "stories260k-Q4_K_M"
    runtime = Runtime(
        RuntimeOptions(model=str(GGUF / f"{name}.gguf"), device="cpu", dtype="fp32",
                       offload="stream", resident_layers=0, slots=2)
    )  # fmt: skip
    step = HostTier(runtime)  # type: ignore[arg-type]
    assert step.possible() is None
    assert "streamed layers read from disk" in step.to_disk()
    assert runtime.streamer is not None and runtime.streamer.storage.tier == "disk"
    assert_greedy_ids_match(runtime, name)
    step.to_ram()
    assert_greedy_ids_match(runtime, name)


def test_the_disk_tier_step_cancels_a_read_back_when_pressure_returns(
    stories_target: Path,
) -> None:
    from daemon.relief import HostTier

    want = reference(stories_target)
    model, streamer, _ = streamed_model(stories_target, [], 2)
    _, _, ckpt = load(stories_target, "fp32", "cpu")
    runtime = runtime_of(model, streamer)
    runtime.checkpoint, runtime.options = ckpt, SimpleNamespace(quantize=None)
    step = HostTier(runtime)
    assert step.to_disk().startswith("5 streamed layers read from disk")
    step.to_ram()
    assert streamer.reading_back and step.possible() is None
    assert "cancelled" in step.to_disk()
    assert not streamer.reading_back and streamer.storage.tier == "disk"
    got = steps(model, model.new_cache(64))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert streamer.storage.tier == "disk"  # nothing was adopted
    step.to_ram()
    assert streamer._refill is not None
    streamer._refill[0].result(timeout=60)
    got = steps(model, model.new_cache(64))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert streamer.storage.tier == "ram"
    streamer.close()
