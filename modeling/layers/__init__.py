"""The layers every architecture module builds from: norms, RoPE tables and
attention over a sequence's KV cache."""
