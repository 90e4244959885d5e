"""The decoder: embedding, the layers its architecture module builds (modeling/models/),
the final norm and the head; what the algorithms drive through modeling/protocol.py.

`forward_batch(segments)` serves prefill, decode, linear verification and tree verification
alike, for one sequence or many in one pass: each `Segment` carries a sequence's new tokens,
their explicit positions (tree nodes share positions), its own KV cache and the boolean
mask of which cache slots each new token may attend to. Weights apply once to all
segments' tokens; attention is per segment (ragged). `forward(tokens, positions, cache,
...)` is the one-sequence call. Blocks are visited with `for layer in self.layers`, so the
offloader can swap in a streaming list.

The attention math, its memory bound and the per-sequence `Slots` a pass's layers see are in
modeling/layers/attention.py; how a projection is built, applied and stacked
(`FusedLinear`), with the mapping to a checkpoint's stored names, in
modeling/weights/projections.py; a layer's own code in its architecture's module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from modeling.config import ModelConfig, RopeConfig
from modeling.errors import ModelOutputError
from modeling.kv_cache import KVCache
from modeling.layers.attention import SequenceSlots, Slots, full_mask, query_scales
from modeling.layers.norms import RMSNorm
from modeling.layers.rope import rope_attention_factor, rope_inv_freq, rotary_dim
from modeling.models import architecture, windowed
from modeling.protocol import HiddenStatesPass, LayerSequence, Segment
from modeling.weights.packed import PackedLinear, RebuildScratch
from modeling.weights.projections import dequantize_projections
from modeling.weights.quant import specialise


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding(rows, dim), drawn as it draws (normal_) except on the meta device: there
    normal_ runs through torch._refs, whose first call imports torch._dynamo (about 1 s of
    every start-up), and a meta model's weights come from the checkpoint anyway."""
    weight = torch.empty(rows, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(rows, dim, _weight=weight)


class Transformer(nn.Module):
    """Parameter names follow the Hugging Face layout minus the `model.` prefix of the
    decoder stack (each architecture's `hf_name`), except that dense q/k/v and gate/up are
    stacked (`qkv_proj`,
    `gate_up_proj`, see FusedLinear): safetensors_model.py loads each stored part into its
    rows."""

    # registered buffers (nn.Module's __getattr__ types them loosely)
    inv_freq: torch.Tensor
    inv_freq_long: torch.Tensor
    inv_freq_local: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        arch = architecture(cfg)
        # Some layer attends through a window: caches keep their slots' positions.
        self.windowed = windowed(cfg)
        # The largest pass the caller plans (a window layer's ring is sized for it, see
        # modeling/kv_cache.py; 0: the ring's default room)
        self.max_pass_tokens = 0
        # (a GGUF file's quantized table is a GGUFEmbedding: modeling/weights/quant.py)
        self.embed_tokens: nn.Module = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers: nn.ModuleList | LayerSequence = nn.ModuleList(
            arch.block(cfg, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if cfg.quantization is not None and cfg.quantization.tensor_types:
            specialise(self, cfg.quantization)  # a GGUF file's types, per tensor
        # (a GGUFLinear where the CPU kernels compute a GGUF head: gguf_model.pack_head)
        self.lm_head: nn.Module = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Packed projections rebuild their weights into one shared scratch (modeling/weights/packed.py).
        self.rebuild_scratch = RebuildScratch()
        for module in self.layers.modules():
            if isinstance(module, PackedLinear):
                module.scratch = self.rebuild_scratch
        # On the meta device only the shape counts (loading recomputes the table), and
        # computing it there runs torch._refs, which imports torch._dynamo (see _embedding).
        # Sliding layers with a RoPE of their own (Gemma 3's local base) read a second table.
        self.local_layers = tuple(
            cfg.local_rope is not None and cfg.layer_window(i) is not None
            for i in range(cfg.num_layers)
        )
        for name, rope, long in self._rope_configs():
            table = torch.empty((rotary_dim(cfg.head_dim, rope) + 1) // 2)  # (hd/2,)
            if not table.is_meta:
                table = rope_inv_freq(cfg.head_dim, rope, long)
            self.register_buffer(name, table, persistent=False)
        self.rope_factor = rope_attention_factor(cfg.rope)
        # Token ids `forward` speaks: its logits are (T, vocab_width). Equal to the embedding
        # rows unless this model drafts for a target of another width (`set_vocab_width`).
        self.vocab_width = cfg.vocab_size
        # Compiled single-sequence passes, when enabled (modeling/compiled.py).
        self.compiled: HiddenStatesPass | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's: an embedding may be kept as GGUF blocks)."""
        return self.norm.weight.dtype

    def _check_not_compiled(self, change: str) -> None:
        # Compiled passes check no guard on the model (modeling/compiled.py: they would
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
        return KVCache(
            self.config, capacity, dtype=self.dtype, device=self.device,
            positions=self.windowed, pass_tokens=self.max_pass_tokens,
        )  # fmt: skip

    def _rope_configs(self) -> list[tuple[str, RopeConfig, bool]]:
        """The RoPE tables: buffer name, config, whether it is LongRoPE's long table.
        `inv_freq` for every layer's, `inv_freq_long` for LongRoPE's positions from the
        original context on, `inv_freq_local` for sliding layers with a RoPE of their own."""
        cfg = self.config
        tables = [("inv_freq", cfg.rope, False)]
        if cfg.rope.kind == "longrope":
            tables.append(("inv_freq_long", cfg.rope, True))
        if cfg.local_rope is not None and any(self.local_layers):
            tables.append(("inv_freq_local", cfg.local_rope, False))
        return tables

    def set_rope(self, device: torch.device | str, factors: torch.Tensor | None = None) -> None:
        """Compute the RoPE tables on `device` (a model built on the meta device has their
        shapes only); `factors` divide the global table's frequencies (a GGUF file's
        rope_freqs, Llama 3.1's scaling as llama.cpp stores it)."""
        for name, rope, long in self._rope_configs():
            table = rope_inv_freq(self.config.head_dim, rope, long)
            if factors is not None and name == "inv_freq":
                table = table / factors
            setattr(self, name, table.to(device))

    def share_rope(self, other: Transformer) -> None:
        """Use `other`'s RoPE tables (the substitute draft and its target: one copy)."""
        for name, _, _ in self._rope_configs():
            self.register_buffer(name, getattr(other, name), persistent=False)

    def rope(
        self, positions: torch.Tensor, local: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), each (T, rotary_dim), for `apply_rope`: the global table's, or
        the sliding layers' own (`local`)."""
        table = self.inv_freq_local if local else self.inv_freq
        freqs = positions.float()[:, None] * table.float()[None, :]  # (T, hd/2)
        if self.config.rope.kind == "longrope" and not local:
            # Each position by its own table: the long one from the original context on.
            far = positions[:, None] >= self.config.rope.original_max_position_embeddings
            long = positions.float()[:, None] * self.inv_freq_long.float()[None, :]
            freqs = torch.where(far, long, freqs)
        sin = freqs.sin()
        cos = freqs.cos()
        if self.rope_factor != 1.0 and not local:  # YaRN's, LongRoPE's; fp32 as the reference
            sin, cos = sin * self.rope_factor, cos * self.rope_factor
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
                seg = segments[0]
                seg.cache.write_positions(seg.cache.length, seg.positions)
                seg.cache.commit_append(seg.length)
                return [self._head(fixed[segments[0].logits_from :])]
        slots: list[SequenceSlots] = []
        row = 0
        for seg in segments:
            t = seg.length
            start = seg.cache.reserve(t)
            seg.cache.write_positions(start, seg.positions)
            mask = full_mask(seg.mask, start, t, self.device)
            scale = None
            if self.config.query_scale is not None:
                positions = seg.positions.to(self.device)
                scale = query_scales(self.config.query_scale, positions, self.dtype)
            slots.append(SequenceSlots(row, t, seg.cache, start, mask, seg.positions, scale))
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
        compiled one (modeling/compiled.py, which traces this) share it."""
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        cos, sin = self.rope(positions)
        local = self.rope(positions, local=True) if any(self.local_layers) else (cos, sin)
        rows = self.config.vocab_size
        if self.vocab_width > rows:  # a target's padding id has no row here (set_vocab_width)
            tokens = torch.where(tokens < rows, tokens, 0)
        x = self.embed_tokens(tokens).to(self.dtype)  # (T, hidden); GGUF blocks decode fp32
        if self.config.embedding_scale is not None:
            # In the model dtype, as the reference multiplies (the lookup's output is fresh).
            x = x.mul_(torch.tensor(self.config.embedding_scale).to(x.dtype))
        # A ModuleList's modules and a LayerSequence's layers are both callable blocks.
        blocks: Iterable[Callable[..., torch.Tensor]] = self.layers
        for i, layer in enumerate(blocks):
            table = local if self.local_layers[i] else (cos, sin)
            x = layer(x, *table, sequences, i)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head over the rows that want logits: fp32 (R, vocab_width).
        Logits with a NaN or +inf (damaged weights: every draw would be token 0) are a
        ModelOutputError; one sum finds them (-inf is an id past the model's rows)."""
        logits = self._to_vocab_width(self.lm_head(self.norm(x)))
        total = logits.sum()
        if bool(torch.isnan(total) | (total == float("inf"))):
            raise ModelOutputError(
                "the model computed NaN or infinite logits: its weights hold NaN or inf (the file is damaged: download or convert it "
                "again) or its configuration's values overflow"
            )
        return logits

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
