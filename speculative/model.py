"""One Llama-family decoder: Llama 2/3/3.1/3.2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

`forward_batch(segments)` serves prefill, decode, linear verification and tree verification
alike, for one sequence or many in one pass: each `Segment` carries a sequence's new tokens,
their explicit positions (tree nodes share positions), its own KV cache and the boolean
mask of which cache slots each new token may attend to. Weights apply once to all
segments' tokens; attention is per segment (ragged). `forward(tokens, positions, cache,
...)` is the one-sequence call. Blocks are visited with `for layer in self.layers`, so the
offloader can swap in a streaming list.

The attention math, its memory bound and the per-sequence `Slots` a pass's layers see are in
speculative/attention.py; how a projection is built, applied and stacked (`FusedLinear`),
with the mapping to a checkpoint's stored names, in speculative/projections.py.

This file stays one file past 400 lines, as gpt-fast keeps its decoder: it is the one
decoder, read top to bottom in the order a pass runs it, and its parts that stand alone
(attention, projections) are split off already.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from speculative.attention import SequenceSlots, Slots, attend_sequence, full_mask
from speculative.config import ModelConfig, RopeConfig
from speculative.kv_cache import KVCache
from speculative.packed import PackedLinear, RebuildScratch
from speculative.projections import FusedLinear, dequantize_projections, linear, projection
from speculative.quant import specialise


@dataclass
class Segment:
    """One sequence's share of a model pass: its new tokens, their RoPE positions, the
    sequence's own KV cache, and the mask over that cache (None: causal among the new
    tokens, seeing the whole cache; (T, T): among the new tokens only, each seeing the
    whole cache; (T, cache.length + T): over every slot, e.g. a draft tree growing in
    batches). Logits are returned for rows `logits_from`.. only (T - 1: the last)."""

    tokens: torch.Tensor  # (T,) token ids
    positions: torch.Tensor  # (T,)
    cache: KVCache
    mask: torch.Tensor | None = None
    logits_from: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.logits_from < max(self.length, 1):
            raise ValueError(
                f"logits_from {self.logits_from} is outside a segment of {self.length} tokens"
            )

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def logit_rows(self) -> int:
        return self.length - self.logits_from


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the model dtype, as the reference does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama 3.1's piecewise scaling when asked."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


def apply_rope(
    x: torch.Tensor,  # (heads, T, hd)
    cos: torch.Tensor,  # (T, hd)
    signed_sin: torch.Tensor,  # (T, hd): sin with its first half negated
) -> torch.Tensor:
    """RoPE in the reference's rotate-half form, x * cos + cat(-x2, x1) * sin, bit for bit:
    cat(-x2, x1) * sin equals roll(x, hd/2) * signed_sin (negation is exact), two kernels
    fewer per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding(rows, dim), drawn as it draws (normal_) except on the meta device: there
    normal_ runs through torch._refs, whose first call imports torch._dynamo (about 1 s of
    every start-up), and a meta model's weights come from the checkpoint anyway."""
    weight = torch.empty(rows, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(rows, dim, _weight=weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        # Dense: one stacked projection (see FusedLinear); packed: the checkpoint's three.
        self.qkv_proj: FusedLinear | None = None
        self.q_proj: nn.Linear | PackedLinear | None = None
        self.k_proj: nn.Linear | PackedLinear | None = None
        self.v_proj: nn.Linear | PackedLinear | None = None
        if cfg.quantization is None:
            parts = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
            self.qkv_proj = FusedLinear(d, parts, cfg.qkv_bias)
        else:
            self.q_proj = projection(cfg, d, q, cfg.qkv_bias)
            self.k_proj = projection(cfg, d, kv, cfg.qkv_bias)
            self.v_proj = projection(cfg, d, kv, cfg.qkv_bias)
        self.o_proj = projection(cfg, cfg.num_heads * hd, d, cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden): every sequence's new tokens, concatenated
        cos: torch.Tensor,  # (T, head_dim)
        sin: torch.Tensor,  # (T, head_dim), first half negated (see apply_rope)
        sequences: Sequence[Slots],
        layer: int,
    ) -> torch.Tensor:
        """Projections over all T rows at once; each sequence's rows write its own cache
        and attend to it under its own mask (ragged: no cache is padded to another's)."""
        t = x.shape[0]
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            # One matmul; q, k and v are views of its (T, (H + 2 Hkv) hd) output.
            qkv = linear(self.qkv_proj, x).view(t, -1, hd).transpose(0, 1)  # (H+2Hkv, T, hd)
            qk, v = qkv.split([heads + kv_heads, kv_heads])
            if self.q_norm is None:
                # RoPE is elementwise per head: q's and k's heads rotate in one go.
                q, k = apply_rope(qk, cos, sin).split([heads, kv_heads])  # (H|Hkv, T, hd)
            else:
                q, k = qk.split([heads, kv_heads])
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q = linear(self.q_proj, x).view(t, heads, hd).transpose(0, 1)  # (H, T, hd)
            k = linear(self.k_proj, x).view(t, kv_heads, hd).transpose(0, 1)  # (Hkv, T, hd)
            v = linear(self.v_proj, x).view(t, kv_heads, hd).transpose(0, 1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, after the split
        if self.qkv_proj is None or self.q_norm is not None:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if len(sequences) == 1:  # one sequence (most passes): no row slices
            out = attend_sequence(sequences[0], layer, q, k, v)
        else:
            # Each sequence writes its rows of one output: the plan counts one output per
            # token plus one chunk's (a cat of per-sequence outputs would hold two).
            out = torch.empty_like(q)  # (H, T, hd)
            for seq in sequences:
                rows = slice(seq.row, seq.row + seq.count)
                out[:, rows] = attend_sequence(seq, layer, q[:, rows], k[:, rows], v[:, rows])
        return linear(self.o_proj, out.transpose(0, 1).reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj: FusedLinear | None = None
        self.gate_proj: nn.Linear | PackedLinear | None = None
        self.up_proj: nn.Linear | PackedLinear | None = None
        if cfg.quantization is None:
            self.gate_up_proj = FusedLinear(d, [("gate_proj", f), ("up_proj", f)], cfg.mlp_bias)
        else:
            self.gate_proj = projection(cfg, d, f, cfg.mlp_bias)
            self.up_proj = projection(cfg, d, f, cfg.mlp_bias)
        self.down_proj = projection(cfg, f, d, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = linear(self.gate_up_proj, x).chunk(2, dim=-1)  # (T, f) views each
            # In place: the peak stays gate/up and silu(gate), 3f per token, as unfused.
            return linear(self.down_proj, F.silu(gate).mul_(up))
        assert self.gate_proj is not None and self.up_proj is not None
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        sequences: Sequence[Slots],
        layer: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, sequences, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Parameter names follow the Hugging Face layout minus the `model.` prefix of the
    decoder stack, except that dense q/k/v and gate/up are stacked (`qkv_proj`,
    `gate_up_proj`, see FusedLinear): safetensors_model.py loads each stored part into its
    rows."""

    inv_freq: torch.Tensor  # registered buffer (nn.Module's __getattr__ types it loosely)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers: nn.ModuleList | LayerSequence = nn.ModuleList(
            DecoderLayer(cfg) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.quantization is not None and cfg.quantization.tensor_types:
            specialise(self, cfg.quantization)  # a GGUF file's types, per tensor
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Packed projections rebuild their weights into one shared scratch (speculative/packed.py).
        self.rebuild_scratch = RebuildScratch()
        for module in self.layers.modules():
            if isinstance(module, PackedLinear):
                module.scratch = self.rebuild_scratch
        # On the meta device only the shape counts (loading recomputes the table), and
        # computing it there runs torch._refs, which imports torch._dynamo (see _embedding).
        inv_freq = torch.empty((cfg.head_dim + 1) // 2)  # (hd/2,)
        if not inv_freq.is_meta:
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Token ids `forward` speaks: its logits are (T, vocab_width). Equal to the embedding
        # rows unless this model drafts for a target of another width (`set_vocab_width`).
        self.vocab_width = cfg.vocab_size
        # Compiled single-sequence passes, when enabled (speculative/compiled.py).
        self.compiled: HiddenStatesPass | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's: an embedding may be kept as GGUF blocks)."""
        return self.norm.weight.dtype

    def _check_not_compiled(self, change: str) -> None:
        # Compiled passes check no guard on the model (speculative/compiled.py: they would
        # run stale graphs, or a kernel indexing past a table), so changes come first.
        if self.compiled is not None:
            raise RuntimeError(f"{change} after the model's passes were compiled")

    def _apply(self, *args: Any, **kwargs: Any) -> Transformer:
        # `.to()`, `.half()`, `.cuda()`... move or recast every weight.
        self._check_not_compiled("moving or casting the weights")
        return super()._apply(*args, **kwargs)

    def set_layers(self, layers: nn.ModuleList | LayerSequence) -> None:
        """Replace the block list (e.g. by a streamer that brings each layer's weights to
        the device just in time); `forward` only iterates it."""
        self._check_not_compiled("set_layers")
        self._modules.pop("layers", None)
        self.__dict__.pop("layers", None)
        if isinstance(layers, nn.Module):
            self._modules["layers"] = layers
        else:
            object.__setattr__(self, "layers", layers)

    def set_vocab_width(self, width: int) -> None:
        """Speak a vocabulary of `width` ids, a target's, while this model has
        `config.vocab_size` embedding rows (a Qwen2.5 0.5B draft has 151,936 rows, the 72B
        target 152,064; the tokenizer is the same and both cover it, the rest is padding).

        Logits come back (T, width): columns for ids this model has no row for are -inf and
        its rows beyond `width` are dropped before any softmax, so every distribution built
        from them gives those ids exactly zero probability and nothing drafted can be an id
        the target lacks. An input id without a row (one of the target's padding ids, which
        no tokenizer produces but a target may still sample) is embedded as id 0: what the
        draft guesses after it changes only how much speculation is accepted, never the
        output, which is always the target's."""
        self._check_not_compiled("set_vocab_width")
        self.vocab_width = width

    @torch.no_grad()
    def dequantize_layers(self) -> None:
        """Replace every packed projection of the decoder by a plain Linear holding its
        rebuilt weight (the plan's choice when the dense layers fit: no rebuild per pass),
        q/k/v and gate/up stacked as a dense checkpoint's are (`FusedLinear`): each part is
        rebuilt straight into its rows, so the peak is the dense layers so far plus the
        shared rebuild scratch, never a part twice."""
        self._check_not_compiled("dequantize_layers")
        if not isinstance(self.layers, nn.ModuleList):
            raise ValueError("dequantize_layers needs the model's own layers, not a streamer")
        for owner in list(self.layers.modules()):
            dequantize_projections(owner, self.dtype)

    def prefetch(self) -> None:
        """Hint that a target pass is coming: a streaming layer list starts copying its first
        layers to the device now (strategies call this before drafting). No-op otherwise."""
        hook = getattr(self.layers, "prefetch", None)
        if hook is not None:
            hook()

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.config, capacity, dtype=self.dtype, device=self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), each (T, head_dim), for `apply_rope`."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (T, hd/2)
        sin = freqs.sin()
        cos = freqs.cos()
        return (
            torch.cat((cos, cos), dim=-1).to(self.dtype),  # (T, hd)
            torch.cat((-sin, sin), dim=-1).to(self.dtype),
        )

    def forward(
        self,
        tokens: torch.Tensor,  # (T,) token ids
        positions: torch.Tensor,  # (T,) RoPE positions
        cache: KVCache,
        mask: torch.Tensor | None = None,  # (T, T) among new tokens, or (T, cache.length + T)
        last_only: bool = False,
        logits_from: int = 0,
    ) -> torch.Tensor:
        """One sequence's pass: `forward_batch` with a batch of one (see `Segment` for the
        arguments). Returns fp32 logits (T, V), (1, V) with `last_only`, or
        (T - logits_from, V); V is `vocab_width`."""
        t = int(tokens.shape[0])
        seg = Segment(tokens, positions, cache, mask, t - 1 if last_only else logits_from)
        return self.forward_batch([seg])[0]

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Append each segment's tokens to its own cache and return its fp32 logits,
        (T_i - logits_from_i, V). Weights are applied once to all segments' tokens
        together (embedding, projections, MLP, norms, head): a streamed layer crosses the
        bus once for all of them; attention runs per segment, against its own cache with
        its own mask. Every segment needs its own cache."""
        if len(segments) > 1 and len({id(seg.cache) for seg in segments}) != len(segments):
            raise ValueError("two segments of one pass share a KV cache")
        if self.compiled is not None and len(segments) == 1:
            fixed = self.compiled.hidden_states(segments[0])
            if fixed is not None:
                segments[0].cache.commit_append(segments[0].length)
                return [self._head(fixed[segments[0].logits_from :])]
        slots: list[SequenceSlots] = []
        row = 0
        for seg in segments:
            t = seg.length
            start = seg.cache.reserve(t)
            slots.append(
                SequenceSlots(row, t, seg.cache, start, full_mask(seg.mask, start, t, self.device))
            )
            row += t
        if len(segments) == 1:  # the common case: no concatenation copies
            tokens, positions = segments[0].tokens, segments[0].positions
        else:
            tokens = torch.cat([seg.tokens.to(self.device) for seg in segments])  # (T,)
            positions = torch.cat([seg.positions.to(self.device) for seg in segments])
        x = self.hidden_states(tokens, positions, slots)
        for seg, sl in zip(segments, slots, strict=True):
            sl.cache.commit_append(seg.length)
        # Rows before a segment's `logits_from` only fill its cache (a prompt chunk, the
        # pending tokens folded into a tree pass): no (T, vocab) head for them.
        wanted = [
            x[sl.row + seg.logits_from : sl.row + sl.count]
            for seg, sl in zip(segments, slots, strict=True)
        ]
        head_in = wanted[0] if len(wanted) == 1 else torch.cat(wanted)  # (R, hidden)
        del x, wanted  # several segments: the rows were copied, the rest is not needed
        logits = self._head(head_in)  # (R, V)
        if len(segments) == 1:
            return [logits]
        return list(logits.split([seg.logit_rows for seg in segments]))

    def hidden_states(
        self,
        tokens: torch.Tensor,  # (T,) every sequence's new tokens, concatenated
        positions: torch.Tensor,  # (T,)
        sequences: Sequence[Slots],
    ) -> torch.Tensor:
        """Embedding and every decoder block: the final hidden states (T, hidden), each
        sequence's new keys and values stored as its `Slots` says. The eager pass and the
        compiled one (speculative/compiled.py, which traces this) share it."""
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        cos, sin = self.rope(positions)
        rows = self.config.vocab_size
        if self.vocab_width > rows:  # a target's padding id has no row here (set_vocab_width)
            tokens = torch.where(tokens < rows, tokens, 0)
        x = self.embed_tokens(tokens).to(self.dtype)  # (T, hidden); GGUF blocks decode fp32
        # A ModuleList's modules and a LayerSequence's layers are both callable blocks.
        blocks: Iterable[Callable[..., torch.Tensor]] = self.layers
        for i, layer in enumerate(blocks):
            x = layer(x, cos, sin, sequences, i)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head over the rows that want logits: fp32 (R, vocab_width)."""
        return self._to_vocab_width(self.lm_head(self.norm(x)))

    def _to_vocab_width(self, head: torch.Tensor) -> torch.Tensor:
        """The head's (T, rows) output in the model dtype → fp32 logits (T, vocab_width):
        surplus rows cut before the cast, missing ids at -inf, the cast written straight
        into the result (a cat after `.float()` held two fp32 copies: 8 bytes per entry
        where the plan counts the head's output and one fp32 copy)."""
        rows, width = self.config.vocab_size, self.vocab_width
        if width <= rows:
            return head[:, :width].float()
        out = torch.full(
            (head.shape[0], width), float("-inf"), dtype=torch.float32, device=head.device
        )  # (T, width)
        out[:, :rows].copy_(head)
        return out


class HiddenStatesPass(Protocol):
    """What `Transformer.compiled` holds: another way to run a one-sequence pass up to the
    final hidden states (speculative/compiled.py's `CompiledPasses`, compiled graphs),
    leaving the cache's new entries uncommitted; None where it cannot run that pass, which
    then runs eager."""

    def hidden_states(self, segment: Segment) -> torch.Tensor | None: ...


class LayerSequence(Protocol):
    """What `Transformer.layers` may be replaced with (see `Transformer.set_layers`): an
    iterable over callable layers in order, with a length. The offload streamer is one."""

    def __iter__(self) -> Iterator[Callable[..., torch.Tensor]]: ...

    def __len__(self) -> int: ...
