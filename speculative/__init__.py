"""specd's model runtime and decoding algorithms (knows nothing of HTTP or offload)."""
