"""The model runtime: everything that defines or loads a model, and nothing that decides
what to generate.

    protocol.py     what the decoding algorithms (speculative/) see of a model
    architecture.py the architecture contract; models/ one module per architecture and
                    the registry by model_type / GGUF architecture
    decoder.py      the decoder every architecture is run by (`Transformer`)
    config.py       `ModelConfig`; kv_cache.py the per-sequence KV cache; errors.py the
                    caller's mistakes (`RequestError`)
    layers/         norms, RoPE tables, attention over a sequence's cache
    weights/        how weights are stored and applied: packed formats, GGUF blocks, HQQ,
                    quantization on load, projections
    checkpoints/    reading checkpoints and stores: safetensors, GGUF, Ollama, LM Studio, hub
    text/           tokenizers, chat templates, detokenization
    compiled.py, graphs.py, substitute.py: compiled passes, CUDA graphs, the substitute draft

It imports nothing from speculative, offload or daemon (tests/test_layering.py)."""
