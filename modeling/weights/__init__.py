"""How weights are stored and applied: quantization configs (`quant`), projections kept
packed (`packed`: GPTQ, AWQ, compressed-tensors; `hqq`; `gguf_modules` over the block
decoders of `gguf_blocks`), and building, applying and stacking projections
(`projections`)."""
