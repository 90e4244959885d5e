"""What one forward pass allocates besides weights and KV cache, as a function of the pass's
shape: its tokens T, the logit rows R it returns, and the keys S it attends to (the cache
length after the pass, at most the context).

The figures follow the model code step by step (`daemon/footprint.py::footprint` derives
them from a config and a dtype; `tests/test_attention_memory.py` holds them against the
measured peak of real passes). This module only does the arithmetic, so `offload` stays
ignorant of Llama.

A pass's peak is

    T * persistent + mask(T, S) + max(layer phase, logits phase, draw phase)

- persistent: what lives for the whole pass per token (RoPE cos/sin);
- mask: the (T, S) boolean mask the model builds, and a tree pass's caller-held masks,
  alive from the pass until the walk is done: the (T, T) verification mask and the draft
  tree's (R, R) ancestor matrix it was made from (R logit rows, one per node);
- layer phase: a decoder layer's peak, which is either outside attention (RoPE
  temporaries, the MLP's gate/up/product: `layer_bytes_per_token` per token) or during
  attention (residual, norm, q/k/v, output per token plus the score working set of one
  query chunk, bounded by `chunk_bytes`);
- logits phase: the final hidden state of every token plus, per logit row, the head's
  output in the model dtype and its fp32 copy;
- draw phase: after the pass, its fp32 logits while the caller draws from them one row at
  a time (the tree walk; `speculative.sampling.DRAW_BYTES_PER_ENTRY` per vocabulary
  entry for the row being drawn).

The draft's passes while it grows a tree are smaller passes of the same model (at most
half the tree's nodes at once: see
`speculative.draft_tree.grow_tree`), whose logits and log-probabilities together take no more
than the tree-sized pass this figure is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationFootprint:
    """Per-token and per-pair byte counts of a pass (see the module docstring)."""

    persistent_bytes_per_token: int  # RoPE cos/sin, alive for the whole pass
    layer_bytes_per_token: int  # a layer's peak outside attention
    attention_bytes_per_token: int  # what lives per token while attention runs
    mask_bytes_per_pair: int  # the boolean mask, per (query, key) pair
    score_bytes_per_key: int  # one query row's score working set, per key (all heads)
    score_bytes_per_query: int  # per query of a chunk: its q copy and its output
    chunk_bytes: int  # the bound on one query chunk's scores (the model's constant)
    hidden_bytes_per_token: int  # the final hidden state, alive while logits are made
    logit_bytes_per_row: int  # one row's head output in the model dtype, then fp32
    fp32_row_bytes: int  # one returned row of fp32 logits, alive while drawn from
    draw_bytes_per_row: int  # drawing one token from such a row (its temporaries)

    def query_chunk(self, keys: int) -> int:
        """Queries per attention chunk, as the model computes it (modeling.layers.attention)."""
        return max(1, self.chunk_bytes // max(keys * self.score_bytes_per_key, 1))

    def attention_bytes(self, tokens: int, keys: int) -> int:
        """The score working set of the largest query chunk of a `tokens`-query pass over at
        most `keys` keys. A pass over fewer keys (a cache not yet full) may hold MORE: its
        chunks have more rows, and rows are rounded down, so a chunk's scores come closer
        to `chunk_bytes` and its per-query part grows. The maximum over every key count
        from `tokens` (a pass attends at least to itself) is at the largest key count of
        each chunk size, which this visits."""
        per_key, per_query = self.score_bytes_per_key, self.score_bytes_per_query
        first = self.query_chunk(keys)
        best = min(tokens, first) * (keys * per_key + per_query)
        for rows in range(first + 1, min(tokens, self.query_chunk(tokens)) + 1):
            most = self.chunk_bytes // (rows * per_key)  # keys at which `rows` rows fit
            best = max(best, rows * (most * per_key + per_query))
        return best

    def pass_bytes(self, tokens: int, logit_rows: int, keys: int) -> int:
        """Peak bytes of a pass of `tokens` new tokens over `keys` slots returning
        `logit_rows` rows of logits."""
        layer = max(
            tokens * self.layer_bytes_per_token,
            tokens * self.attention_bytes_per_token + self.attention_bytes(tokens, keys),
        )
        logits = tokens * self.hidden_bytes_per_token + logit_rows * self.logit_bytes_per_row
        drawn = logit_rows * self.fp32_row_bytes + self.draw_bytes_per_row
        # The model's (T, S) mask; the caller's (T, T) verification mask and, for a tree of
        # `logit_rows` nodes, the draft tree's (N, N) ancestor matrix it was made from.
        mask = (tokens * (keys + tokens) + logit_rows**2) * self.mask_bytes_per_pair
        return tokens * self.persistent_bytes_per_token + mask + max(layer, logits, drawn)
