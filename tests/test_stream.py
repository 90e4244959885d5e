"""The layer streamer on the CPU path (host "slots"): exact logits against the resident
model for prefill, decode and tree verification, identical greedy generations, and the ring's
bookkeeping (slot count, fetch order, prefetch, wrap-around)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.target_loading import disk_sources
from modeling.checkpoints.checkpoint import load
from modeling.decoder import Transformer
from offload.placement import build_streamer
from offload.stream import LayerStreamer
from speculative.generation import Generation
from speculative.sampling import SamplingParams

PROMPT = [1, 403, 407, 261, 378, 432, 383]
TREE_PARENTS = [-1, 0, 0, 1, 1, 3]  # root, two children, two grandchildren, one great-grandchild
TREE_TOKENS = [286, 261, 376, 298, 315, 421]


def streamed_model(
    path: Path, resident: list[int], slots: int, tier: str = "ram"
) -> tuple[Transformer, LayerStreamer, list[nn.Module]]:
    model, _, ckpt = load(path, "fp32", "cpu")
    layers = list(model.layers)
    sources = None
    if tier == "disk":
        streamed = [i for i in range(len(layers)) if i not in resident]
        names = [n for n, _ in layers[0].named_parameters()]
        sources = disk_sources(ckpt, streamed, names, "fp32")
    streamer = build_streamer(layers, resident, "cpu", slots, tier, sources)
    model.set_layers(streamer)
    return model, streamer, layers


def tree_mask(cached: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, cached + T) ancestor mask and RoPE positions for TREE_PARENTS after `cached` slots."""
    t = len(TREE_PARENTS)
    mask = torch.zeros(t, cached + t, dtype=torch.bool)
    mask[:, :cached] = True
    depth = [0] * t
    for i, parent in enumerate(TREE_PARENTS):
        if parent >= 0:
            mask[i] |= mask[parent]
            depth[i] = depth[parent] + 1
        mask[i, cached + i] = True
    return mask, cached + torch.tensor(depth)


def passes(model: Transformer) -> list[torch.Tensor]:
    """Prefill, one decode step, one tree verification, and decoding after a compaction."""
    cache = model.new_cache(64)
    n = len(PROMPT)
    out = [model(torch.tensor(PROMPT), torch.arange(n), cache)]
    out.append(model(torch.tensor([300]), torch.tensor([n]), cache))
    cached = cache.length
    mask, positions = tree_mask(cached)
    out.append(model(torch.tensor(TREE_TOKENS), positions, cache, mask=mask))
    cache.keep([*range(cached), cached, cached + 1, cached + 3])  # accept root → 1 → 3
    out.append(model(torch.tensor([5]), torch.tensor([cached + 3]), cache))
    return out


@pytest.fixture(scope="module")
def reference_logits(stories_target: Path) -> list[torch.Tensor]:
    model, _, _ = load(stories_target, "fp32", "cpu")
    return passes(model)


@pytest.mark.parametrize(
    ("slots", "resident", "tier"),
    [
        (2, [], "ram"),
        (3, [], "ram"),
        (2, [0, 1], "ram"),
        (3, [1, 3], "ram"),
        (2, [], "disk"),
        (3, [4], "disk"),
    ],
)
def test_streamed_logits_equal_resident(
    stories_target: Path,
    reference_logits: list[torch.Tensor],
    slots: int,
    resident: list[int],
    tier: str,
) -> None:
    model, streamer, _ = streamed_model(stories_target, resident, slots, tier)
    got = passes(model)
    for ref, out in zip(reference_logits, got, strict=True):
        assert torch.equal(ref, out)
    assert streamer.counters.passes == len(got)


class Recorder:
    """Wraps a layer sequence and records what each iteration yields."""

    def __init__(self, inner: LayerStreamer) -> None:
        self.inner = inner
        self.yielded: list[nn.Module] = []

    def __iter__(self) -> Iterator[nn.Module]:
        for layer in self.inner:
            self.yielded.append(layer)
            yield layer

    def __len__(self) -> int:
        return len(self.inner)


def storages(module: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


@pytest.mark.parametrize("slots", [2, 3])
def test_at_most_n_layer_buffers_on_the_device(stories_target: Path, slots: int) -> None:
    model, streamer, layers = streamed_model(stories_target, [], slots)
    recorder = Recorder(streamer)
    model.set_layers(recorder)
    passes(model)
    buffers = {b.untyped_storage().data_ptr() for b in streamer.device_buffers()}
    assert len(streamer.device_buffers()) == slots
    assert len({id(m) for m in recorder.yielded}) == slots  # the same N slot modules reused
    for module in recorder.yielded:
        assert len(storages(module)) == 1  # every parameter is a view of one flat buffer
        assert storages(module) <= buffers
    # The original host modules were freed (moved to meta) once packed.
    assert all(p.device.type == "meta" for layer in layers for p in layer.parameters())


def one_pass(model: Transformer) -> None:
    model(torch.tensor([1, 2, 3]), torch.arange(3), model.new_cache(8))


def test_fetch_order_and_wrap_around(stories_target: Path) -> None:
    model, streamer, _ = streamed_model(stories_target, [], 2)
    assert list(streamer.fetch_log) == []
    one_pass(model)
    # Layers in order, then the next pass's first two already on their way.
    assert list(streamer.fetch_log) == [0, 1, 2, 3, 4, 0, 1]
    one_pass(model)
    assert list(streamer.fetch_log) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert streamer.counters.copies == 12
    assert streamer.counters.bytes_copied == 12 * streamer.layout.nbytes


def test_resident_layers_are_not_fetched(stories_target: Path) -> None:
    model, streamer, _ = streamed_model(stories_target, [0, 2], 2)
    one_pass(model)
    assert list(streamer.fetch_log) == [1, 3, 4, 1, 3]
    assert streamer.stats()["streamed_layers"] == 3


def test_prefetch_fills_the_first_slots_once(stories_target: Path) -> None:
    model, streamer, _ = streamed_model(stories_target, [0], 3)
    model.prefetch()  # what strategies call before drafting
    assert list(streamer.fetch_log) == [1, 2, 3]
    model.prefetch()
    assert list(streamer.fetch_log) == [1, 2, 3]  # already under way: no second copy
    one_pass(model)
    assert list(streamer.fetch_log) == [1, 2, 3, 4, 1, 2, 3]  # three slots: three ahead


def test_few_streamed_layers_stay_in_their_slots(stories_target: Path) -> None:
    model, streamer, _ = streamed_model(stories_target, [0, 1], 3)
    one_pass(model)
    one_pass(model)
    assert list(streamer.fetch_log) == [2, 3, 4]  # nothing crosses after the first pass
    assert streamer.stats()["streamed_bytes_per_pass"] == 0


def test_aborted_pass_leaves_a_usable_ring(
    stories_target: Path, reference_logits: list[torch.Tensor]
) -> None:
    model, streamer, _ = streamed_model(stories_target, [], 2)
    it = iter(streamer)
    next(it)
    next(it)
    it.close()  # e.g. an exception inside layer 1
    assert torch.equal(passes(model)[0], reference_logits[0])


def greedy(options: RuntimeOptions, strategy: str, prompt: list[int]) -> list[int]:
    runtime = Runtime(options)
    strat = runtime.strategy(strategy)
    gen = Generation(
        strat,
        runtime.new_session(strat),
        runtime.tokenizer,
        prompt,
        SamplingParams(temperature=0.0),
        max_tokens=24,
        ignore_eos=True,
    ).run()
    if options.offload == "stream":
        stats = runtime.offload_stats()
        assert stats["streamed_layers"] == 5 - int(options.resident_layers)
        assert stats["stream_passes"] > 0
    else:
        assert runtime.streamer is None
    return gen.token_ids


@pytest.mark.parametrize("strategy", ["autoregressive", "tree"])
def test_greedy_generation_identical_with_streaming(
    stories_target: Path, stories_draft: Path, strategy: str
) -> None:
    prompt = PROMPT[:5]
    base = RuntimeOptions(
        model=str(stories_target), draft=str(stories_draft), device="cpu", context=128
    )
    plain = greedy(RuntimeOptions(**{**base.__dict__, "offload": "none"}), strategy, prompt)
    for resident, slots in ((0, 2), (2, 3)):
        options = RuntimeOptions(
            **{**base.__dict__, "offload": "stream", "resident_layers": resident, "slots": slots}
        )
        assert greedy(options, strategy, prompt) == plain


@pytest.mark.parametrize("strategy", ["linear", "tree"])
def test_speculative_rounds_prefetch_the_target_before_drafting(
    stories_target: Path, stories_draft: Path, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the draft works the streamer should already be copying the target's first
    streamed layers: every drafting round starts with `Transformer.prefetch()`."""
    runtime = Runtime(
        RuntimeOptions(
            model=str(stories_target), draft=str(stories_draft), strategy=strategy,
            budget=8, device="cpu", offload="stream", resident_layers=1,
        )
    )  # fmt: skip
    calls: list[int] = []
    real = runtime.target.prefetch
    monkeypatch.setattr(runtime.target, "prefetch", lambda: calls.append(1) or real())
    strat = runtime.strategy()
    gen = Generation(
        strat,
        runtime.new_session(strat),
        runtime.tokenizer,
        runtime.tokenizer.encode("Once upon a time"),
        SamplingParams(temperature=0.0),
        max_tokens=24,
        ignore_eos=True,
    ).run()
    # Every round drafts except, at most, the last (one token left: a plain target step).
    assert gen.stats.rounds > 1 and len(calls) >= gen.stats.rounds - 1
