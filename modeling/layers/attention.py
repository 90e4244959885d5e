"""Attention over one sequence's KV cache, and the bound on its working memory.

A pass's layers see each sequence as its `Slots`: which rows of the pass are its new
tokens, where their keys and values go in its cache, and the boolean mask over the slots
they attend to (`SequenceSlots` in an eager pass, `FixedSlots` in a compiled one,
modeling/compiled.py). `attend` is grouped-query attention over chunks of queries, so
that no pass holds more than ATTENTION_CHUNK_BYTES of scores; the memory plan reserves
exactly that working set (daemon/footprint.py).

Each layer says how it attends (`AttentionOptions`): the scores' scale, a sliding window,
a soft cap on the scores (Gemma 2), and per-head sink logits (gpt-oss) are the layer's own
weights, passed beside. A window is by *position* distance, never by slot: tree nodes
share positions and sit in consecutive slots, so a query sees the keys whose position is
less than `window` before its own (transformers' `kv_idx > q_idx - window`), read from the
positions the cache keeps (`KVCache.positions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from modeling.kv_cache import KVCache
from modeling.weights import cpu_kernels


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer attends: `scale` on the scores (None: head_dim ** -0.5), a sliding
    `window` in positions (None: the whole context), `softcap` (scores become
    softcap * tanh(scores / softcap); None: none)."""

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None


FULL = AttentionOptions()


@dataclass
class SequenceSlots:
    """Where one segment sits inside a pass, as the layers see it: rows [row, row + count)
    of the pass's activations, written to `cache` from slot `start`, attending under
    `mask` ((count, start + count) bool, or None for a single token). `positions`: the
    new tokens' positions (count,), for window layers (the cache keeps every slot's)."""

    row: int
    count: int
    cache: KVCache
    start: int
    mask: torch.Tensor | None
    positions: torch.Tensor | None = None
    query_scale: torch.Tensor | None = None  # (count, 1): `query_scales`, where the model has one
    _windows: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer with this sliding window (None: `mask`), made once per pass
        and window: `mask` and, for each new token, the slots whose position is less than
        `window` before its own; over the ring's indices once the window layers' ring has
        wrapped (`KVCache` module docstring), where each index holds the slot
        `ring_slots` names and a slot past the pass's is an entry rolled back."""
        if window is None:
            return self.mask
        made = self._windows.get(window)
        if made is None:
            if self.positions is None or self.cache.positions is None:
                raise ValueError("a window layer needs the positions of the cache's slots")
            end = self.start + self.count
            queries = self.positions.to(self.cache.positions.device)  # (count,)
            if self.cache.wrapped:
                slots = self.cache.ring_slots()  # (A,)
                keys = self.cache.positions[slots]
                made = (keys[None, :] > queries[:, None] - window) & (slots < end)[None, :]
                if self.mask is not None:
                    made &= self.mask[:, slots.clamp(max=end - 1)]
            else:
                keys = self.cache.positions[:end]  # (S,)
                made = keys[None, :] > queries[:, None] - window  # (count, S)
                if self.mask is not None:
                    made &= self.mask
            self._windows[window] = made
        return made

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values (Hkv, count, hd) to their slots; return the keys and
        values they attend to: slots [0, start + count), or a wrapped ring's every index
        (views of the cache)."""
        k_cache, v_cache, ring = self.cache.layer_kv(layer)  # (Hkv, slots, hd)
        end = self.start + self.count
        if ring and self.cache.wrapped:
            index = torch.arange(self.start, end, device=k_cache.device) % k_cache.shape[1]
            k_cache.index_copy_(1, index, k)
            v_cache.index_copy_(1, index, v)
            return k_cache, v_cache
        k_cache[:, self.start : end] = k
        v_cache[:, self.start : end] = v
        return k_cache[:, :end], v_cache[:, :end]


@dataclass
class FixedSlots:
    """A compiled pass's one sequence (modeling/compiled.py): shapes that do not depend on
    where the sequence stands. New entries go to the slots `write` names, and every new
    token attends over every allocated slot under `mask` ((count, slots) bool), so a
    compiled graph serves any cache length of one allocation."""

    count: int
    k: torch.Tensor  # (layers, Hkv, slots, hd): the cache's whole allocation
    v: torch.Tensor
    write: torch.Tensor  # (count,) slot of each new token
    mask: torch.Tensor  # (count, slots) bool
    row: int = 0
    query_scale: torch.Tensor | None = None  # (count, 1)

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is not None:  # compiled.ineligible keeps window models eager
            raise ValueError("a compiled pass holds no window masks")
        return self.mask

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One opaque mutating operator per write: traced as a plain index_copy_, the
        # compiler made each layer's whole K and V a fresh copy to write a row into (a
        # 30-layer model at 8,192 tokens copied 0.75 GB a decode step: twice as slow).
        torch.ops.specd.write_rows(self.k, self.v, layer, self.write, k, v)
        return self.k[layer], self.v[layer]  # (Hkv, slots, hd)


def write_rows(
    k_cache: torch.Tensor,  # (layers, Hkv, slots, hd)
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,  # (count,)
    k: torch.Tensor,  # (Hkv, count, hd)
    v: torch.Tensor,
) -> None:
    """k_cache[layer][:, slots] = k and the same for v, in place."""
    k_cache[layer].index_copy_(1, slots, k)
    v_cache[layer].index_copy_(1, slots, v)


def _write_rows_fake(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    return None


# Defined with the dispatcher directly, as the kernels' operators are (`cpu_kernels.operator`):
# `torch.library.custom_op`'s wrappers cost a compiled decode step about 70 microseconds a
# layer, more than the write. The schema marks k_cache and v_cache as written (a compiled
# graph functionalizes the op, then writes in place again); one implementation for every
# device (a CUDA graph captures the same index_copy_).
cpu_kernels.operator(
    "write_rows(Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor slots, Tensor k, "
    "Tensor v) -> ()",
    write_rows,
    _write_rows_fake,
    dispatch="CompositeExplicitAutograd",
)


class Slots(Protocol):
    """What the layers need of a sequence in a pass: its rows, its mask, and where its new
    keys and values go (`SequenceSlots` eager, `FixedSlots` compiled)."""

    row: int
    count: int
    query_scale: torch.Tensor | None

    @property
    def mask(self) -> torch.Tensor | None: ...

    def mask_for(self, window: int | None) -> torch.Tensor | None: ...

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def query_scales(
    scale: tuple[float, int] | None, positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """Each query's factor under Llama 4's attention temperature (`ModelConfig.query_scale`,
    (beta, floor)): 1 + beta * ln(1 + floor(position / floor)), computed in fp32 and cast
    to the queries' dtype as the reference does; (T, 1), or None for a model without one.
    It is 1 below `floor` (16,384 for Ministral 3) and grows by beta * ln 2 at the first
    multiple: long contexts only."""
    if scale is None:
        return None
    beta, floor = scale
    steps = torch.div(positions, floor, rounding_mode="floor").float()
    return (1.0 + beta * torch.log(1.0 + steps)).to(dtype)[:, None]


def full_mask(
    mask: torch.Tensor | None, start: int, t: int, device: torch.device
) -> torch.Tensor | None:
    """The (T, start + T) boolean attention mask the layers use, or None when no masking is
    needed (a single new token sees everything)."""
    if mask is None:
        if t == 1:
            return None
        rows = torch.arange(t, device=device)[:, None] + start
        return torch.arange(start + t, device=device)[None, :] <= rows
    mask = mask.to(device=device, dtype=torch.bool)
    if mask.shape == (t, t) and start:
        # Written into one (T, start + T) tensor: a cat would hold a (T, start) prefix too.
        full = torch.ones(t, start + t, dtype=torch.bool, device=device)
        full[:, start:] = mask
        return full
    if mask.shape != (t, start + t):
        raise ValueError(
            f"attention mask has shape {tuple(mask.shape)}; expected ({t}, {t}) or ({t}, {start + t})"
        )
    return mask


def attend_sequence(
    seq: Slots,
    layer: int,
    q: torch.Tensor,  # (H, count, hd) this sequence's queries
    k: torch.Tensor,  # (Hkv, count, hd) its new keys, RoPE applied
    v: torch.Tensor,
    options: AttentionOptions = FULL,
    sinks: torch.Tensor | None = None,  # (H,) the layer's sink logits
) -> torch.Tensor:
    """Write one sequence's new keys and values to its cache and attend to the cache under
    its own mask (and the layer's window), its queries scaled by their positions' factors
    where the model has them (`query_scales`): (H, count, hd)."""
    keys, values = seq.store(layer, k, v)
    if seq.query_scale is not None:  # (in place: the rotated q is this pass's own)
        q = q.mul_(seq.query_scale)  # (H, count, hd) * (count, 1)
    return attend(q, keys, values, seq.mask_for(options.window), options, sinks)


# The most bytes one chunk of queries may hold in attention working memory. Masked passes
# (prefill chunks, tree verification) would otherwise hold (heads, queries, keys) fp32 scores
# per layer: a 2,048-token chunk at context 8,192 is ~4 GB. 128 MiB still holds one query
# row of a 64-head model at 128k context (64 MiB of scores), is ~0.5% of a 24 GB card, and
# one chunk's work (~16M scores, billions of flops on a real model) dwarfs the few kernel
# launches a chunk adds. The plan reserves exactly this working set (daemon/footprint.py).
ATTENTION_CHUNK_BYTES = 128 * 2**20
# Bytes per (head, query, key) at a chunk's peak: the fp32 scores and their fp32 softmax
# live together; the model-dtype matmul output before them and the cast weights after
# them are never alive with both (see `_attend_chunk`).
SCORE_BYTES = 8


def attention_row_bytes(heads: int, keys: int) -> int:
    """Working bytes one query row adds to a chunk: its scores over every key for every
    head (SCORE_BYTES each) and its row of the inverted boolean mask."""
    return keys * (heads * SCORE_BYTES + 1)


def query_chunk(heads: int, keys: int, chunk_bytes: int | None = None) -> int:
    """Queries per chunk so that one chunk's working set stays under `chunk_bytes`
    (ATTENTION_CHUNK_BYTES when None); at least 1 (a single row over a huge context is the
    irreducible minimum)."""
    bound = ATTENTION_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return max(1, bound // attention_row_bytes(heads, keys))


def attend(
    q: torch.Tensor,  # (H, T, hd)
    k: torch.Tensor,  # (Hkv, S, hd), a strided view of the cache
    v: torch.Tensor,  # (Hkv, S, hd)
    mask: torch.Tensor | None,  # (T, S) bool, True = may attend; None = see everything
    options: AttentionOptions = FULL,
    sinks: torch.Tensor | None = None,  # (H,) sink logits: a softmax column per head, no value
) -> torch.Tensor:
    """Grouped-query attention, softmax in fp32, over chunks of queries so that no pass holds
    more than ATTENTION_CHUNK_BYTES of scores. Decoding and verification passes fit in one
    chunk and take the direct path. Each kv head's query group is folded into one matmul:
    on CPU, SDPA's `enable_gqa` path costs milliseconds per call (it copies the strided cache
    views), and with a boolean mask it falls back to the math kernel, which materialises the
    whole (heads, T, S) score matrix, so SDPA would be neither faster nor bounded here."""
    t = q.shape[1]
    if q.dtype == torch.float32 and q.device.type == "cpu":
        # A few rows (a decode step, a short chain): one call of the CPU kernels, whose
        # working set is less than one chunk's scores; in a compiled pass, their operator
        # (modeling/compiled.py builds them before it traces).
        scale = q.shape[2] ** -0.5 if options.scale is None else options.scale
        if torch.compiler.is_compiling():
            if cpu_kernels.loaded():
                return torch.ops.specd.attention(q, k, v, mask, scale, options.softcap, sinks)
        elif t <= cpu_kernels.max_rows():
            out = cpu_kernels.attention(q, k, v, mask, scale, options.softcap, sinks)
            if out is not None:
                return out
    return _attend(q, k, v, mask, options, sinks)


def _attention_operator(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`attend` as one opaque node of a compiled pass (whose token count is symbolic): a
    few rows to the CPU kernels, which read no key past the last one a row sees (a compiled
    pass attends over the cache's whole allocation), more to `_attend`."""
    out = cpu_kernels.attention(q, k, v, mask, scale, softcap, sinks)
    if out is None:  # (contiguous, as the fake says: a chunked output keeps q's strides)
        out = _attend(q, k, v, mask, AttentionOptions(scale, None, softcap), sinks).contiguous()
    return out


def _attention_fake(q, k, v, mask, scale, softcap, sinks):  # type: ignore[no-untyped-def]
    return torch.empty_like(q, memory_format=torch.contiguous_format)


cpu_kernels.operator(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float? softcap, "
    "Tensor? sinks) -> Tensor",
    _attention_operator,
    _attention_fake,
)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    options: AttentionOptions,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`attend` in PyTorch's operators, over chunks of queries."""
    heads, t = q.shape[0], q.shape[1]
    chunk = query_chunk(heads, k.shape[1])
    if t <= chunk:
        return _attend_chunk(q, k, v, mask, options, sinks)
    out = torch.empty_like(q)  # (H, T, hd)
    for t0 in range(0, t, chunk):
        t1 = min(t0 + chunk, t)
        rows = None if mask is None else mask[t0:t1]  # (c, S)
        out[:, t0:t1] = _attend_chunk(q[:, t0:t1], k, v, rows, options, sinks)
    return out


def _attend_chunk(
    q: torch.Tensor,  # (H, c, hd)
    k: torch.Tensor,  # (Hkv, S, hd)
    v: torch.Tensor,  # (Hkv, S, hd)
    mask: torch.Tensor | None,  # (c, S) bool
    options: AttentionOptions = FULL,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:
    heads, t, hd = q.shape
    kv_heads, s = k.shape[0], k.shape[1]
    group = heads // kv_heads
    # Query heads h = kv * group + g share kv head `kv` (transformers' repeat_kv order). A
    # slice of a longer pass is not contiguous across heads: reshape copies it (c rows only).
    qg = q.reshape(kv_heads, group * t, hd)  # (Hkv, g*c, hd)
    scores = torch.matmul(qg, k.transpose(1, 2)).float()  # (Hkv, g*c, S) fp32
    # In place: the same values as `* scale`, no second fp32 copy.
    scores.mul_(hd**-0.5 if options.scale is None else options.scale)
    if options.softcap is not None:
        scores.div_(options.softcap).tanh_().mul_(options.softcap)
    if mask is not None:
        scores.view(kv_heads, group, t, s).masked_fill_(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)  # (Hkv, g*c, S) fp32
    else:
        weights = _softmax_with_sinks(scores.view(kv_heads, group, t, s), sinks)
    # Free the scores before casting: the peak stays at two fp32 copies (SCORE_BYTES).
    del scores
    return torch.matmul(weights.to(v.dtype), v).view(heads, t, hd)  # (H, c, hd)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over each row's keys and its head's sink logit, the sink's share dropped (it
    has no value): in place over the (Hkv, g, c, S) fp32 scores, no second copy."""
    kv_heads, group = scores.shape[0], scores.shape[1]
    sink = sinks.float().view(kv_heads, group, 1, 1)  # query head h = kv * group + g
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)  # (Hkv, g, c, 1)
    scores.sub_(top).exp_()
    total = scores.sum(dim=-1, keepdim=True) + (sink - top).exp()
    return scores.div_(total).view(kv_heads, group * scores.shape[2], scores.shape[3])
