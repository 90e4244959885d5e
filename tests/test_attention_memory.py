"""Attention memory: query-chunked attention equals one-chunk attention, and the plan's
activation figure is what a real pass allocates (an upper bound within 25%), measured on a
random-weight model with a real-ish shape for a prefill-shaped and a tree-shaped pass."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import modeling.layers.attention as attention_module
from daemon.footprint import activation_footprint
from modeling.config import ModelConfig
from modeling.layers.attention import (
    ATTENTION_CHUNK_BYTES,
    attend,
    attention_row_bytes,
    query_chunk,
)
from offload.machine import gemm_copies_output
from tests.peak_probe import needs_proc, run_child

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Textbook GQA, written independently of `attend`: repeat each kv head for its group."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # (H, S, hd)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # (H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (H, T, hd)


def tree_mask(parents: list[int], prefix: int) -> torch.Tensor:
    """(N, prefix + N): every node sees the prefix, its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, prefix + i] = True
    return mask


def qkv(t: int, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, t, HEAD_DIM, generator=g)
    # The cache is a strided view of a larger buffer, as in the model.
    k = torch.randn(KV_HEADS, s + 7, HEAD_DIM, generator=g)[:, :s]
    v = torch.randn(KV_HEADS, s + 7, HEAD_DIM, generator=g)[:, :s]
    return q, k, v


def causal(t: int, start: int) -> torch.Tensor:
    return torch.arange(start + t)[None, :] <= torch.arange(t)[:, None] + start  # (T, S)


def tree_parents(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


CASES = {
    "prefill": (37, 20, lambda t, start: causal(t, start)),
    "decode": (1, 50, lambda t, start: None),
    "tree": (29, 40, lambda t, start: tree_mask(tree_parents(t, 3), start)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_query_chunked_attention_equals_one_chunk(case: str, monkeypatch) -> None:
    t, start, make_mask = CASES[case]
    s = start + t
    q, k, v = qkv(t, s, seed=len(case))
    mask = make_mask(t, start)
    whole = attend(q, k, v, mask)  # (H, T, hd)
    assert query_chunk(HEADS, s) >= t  # the default bound: one chunk, the direct path
    torch.testing.assert_close(whole, reference_attention(q, k, v, mask), atol=1e-5, rtol=0)
    # A bound that holds 5 query rows: 8 chunks for 37 queries, the last one partial.
    monkeypatch.setattr(
        attention_module, "ATTENTION_CHUNK_BYTES", 5 * attention_row_bytes(HEADS, s)
    )
    assert query_chunk(HEADS, s) == 5
    torch.testing.assert_close(attend(q, k, v, mask), whole, atol=1e-5, rtol=0)
    monkeypatch.setattr(attention_module, "ATTENTION_CHUNK_BYTES", 1)  # one row per chunk
    assert query_chunk(HEADS, s) == 1
    torch.testing.assert_close(attend(q, k, v, mask), whole, atol=1e-5, rtol=0)


def test_the_chunk_bound_holds_a_row_at_128k_for_64_heads() -> None:
    assert attention_row_bytes(64, 131072) <= ATTENTION_CHUNK_BYTES
    assert query_chunk(64, 131072) == 1
    # A 2,048-token prefill chunk at context 8,192 on a 32-head model: chunks, not 4 GB.
    rows = query_chunk(32, 8192)
    assert 1 < rows < 2048 and rows * attention_row_bytes(32, 8192) <= ATTENTION_CHUNK_BYTES


def config(vocab: int, window: int | None = None) -> ModelConfig:
    return ModelConfig(
        model_type="mistral" if window else "llama",
        sliding_window=window,
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=704,
        num_layers=2,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=256 // HEADS,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )


def test_the_plan_follows_the_models_chunking() -> None:
    fp = activation_footprint(config(32000), torch.bfloat16)
    for keys in (1, 100, 3072, 8192, 131072):
        assert fp.query_chunk(keys) == query_chunk(HEADS, keys)
    # Scores are bounded: a bigger pass or context adds per-token terms, not T × S scores.
    assert fp.attention_bytes(2048, 131072) <= ATTENTION_CHUNK_BYTES + 2048 * 2 * 2 * 256


# (name, dtype, vocab, cached tokens before the pass, pass tokens, tree pass?, chunk bound).
# - prefill: one logit row; its attention spans several query chunks, whose working set
#   dominates the peak;
# - tree: the largest auto-budget tree (256 nodes and the root) with Llama 3's vocabulary:
#   a logit row per node dominates; one query chunk (the direct path);
# - layer: a prefill chunk with a small chunk bound, so that the per-token temporaries of
#   a layer (the MLP's) dominate, as they do for 8B-70B models with 128 MiB chunks.
# bf16 adds the fp32 copies (`.float()` of scores, norms and logits) that fp32 skips.
# - batched: one pass over 8 sequences (each its own cache of the stated length): their
#   trees sharing the pass's 264 rows, or 8 prefill chunks (speculative/batching.py).
# - windowed-tree: a sliding-window model (its layers keep a second (T, S) mask, made from
#   the cache's positions) with a small vocabulary and a long context, so the masks count.
SHAPES = [
    ("batched-tree", "bfloat16", 128256, 2048, 264, True, ATTENTION_CHUNK_BYTES, 8),
    ("batched-prefill", "float32", 32000, 512, 1024, False, ATTENTION_CHUNK_BYTES, 8),
    ("prefill", "float32", 32000, 1024, 1024, False, ATTENTION_CHUNK_BYTES),
    ("tree", "float32", 128256, 2048, 257, True, ATTENTION_CHUNK_BYTES),
    ("prefill", "bfloat16", 32000, 1024, 1024, False, ATTENTION_CHUNK_BYTES),
    ("tree", "bfloat16", 128256, 2048, 257, True, ATTENTION_CHUNK_BYTES),
    ("layer", "bfloat16", 32000, 1024, 1024, False, 2 * 2**20),
    ("windowed-tree", "float32", 512, 16384, 1025, True, 2**20, 1, 4096),
]


def measure_pass(
    name: str,
    dtype: str,
    vocab: int,
    start: int,
    t: int,
    is_tree: bool,
    chunk_bytes: int,
    sequences: int = 1,
    window: int | None = None,
) -> dict:
    """In a child process (see the test): the peak one pass shape adds, and the plan's
    figure for it. `sequences` > 1 splits the pass's t tokens evenly among that many
    sequences, each with its own cache (a batched pass)."""
    from modeling.decoder import Transformer
    from modeling.protocol import Segment
    from offload.machine import PeakMemory

    attention_module.ATTENTION_CHUNK_BYTES = chunk_bytes  # this child process only
    torch.manual_seed(0)
    model = Transformer(config(vocab, window)).eval().to(getattr(torch, dtype))
    each = t // sequences
    tokens = torch.randint(0, vocab, (each,))
    positions = torch.arange(start, start + each)
    mask = tree_mask(tree_parents(each, 5), 0) if is_tree else None  # (N, N) tree mask

    def run() -> int:
        segments = []
        for _ in range(sequences):
            cache = model.new_cache(start + each)
            cache.reserve(start + each)  # allocate every slot now, not during the pass
            for store in (cache.k, cache.v, cache.ring_k, cache.ring_v):
                if store is not None:  # its pages committed now: the plan counts them as KV
                    store.zero_()
            cache.commit_append(start)  # a pre-filled context (contents do not matter)
            segments.append(Segment(tokens, positions, cache, mask, 0 if is_tree else each - 1))
        with PeakMemory("cpu") as peak:
            logits = model.forward_batch(segments)
        rows = each if is_tree else 1
        assert [x.shape for x in logits] == [(rows, vocab)] * sequences and peak.bytes is not None
        return peak.bytes

    # The first pass of a shape lets the BLAS library size its workspace once per process
    # (MKL keeps it); later passes allocate only what the model asks for. The resident-set
    # probe can only overstate that (small blocks the heap kept), so the smaller of two
    # identical passes is the closer measurement.
    run()
    measured = min(run(), run())
    fp = activation_footprint(
        model.config, model.dtype, gemm_output_copy=gemm_copies_output(model.dtype, "cpu")
    )
    plan = replace(fp, chunk_bytes=chunk_bytes)
    planned = plan.pass_bytes(t, t if is_tree else sequences, start + t)
    return {"shape": name, "dtype": dtype, "measured": measured, "planned": planned}


@needs_proc
def test_the_plans_activation_figure_matches_what_a_pass_allocates() -> None:
    for r in run_child(__file__):
        print(r)
        assert r["planned"] >= r["measured"], r
        if r["shape"] != "batched-prefill":  # the plan's worst case is one long sequence:
            assert r["planned"] <= 1.25 * r["measured"], r  # 8 short ones attend far less


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([measure_pass(*shape) for shape in SHAPES]))
