"""Reading models: a folder, a hub id, a GGUF file or a store reference opened as a
`Checkpoint` (`checkpoint`); safetensors weights (`safetensors_model`; a tied head
checked against a stored one, `tied_head`; packed layers checked and laid out as blocks,
`packed_layers`); GGUF files, their config and their tensors (`gguf_file`, `gguf_config`,
`gguf_model`); Ollama's and LM Studio's stores (`model_stores`); the hub cache's repositories
(`hub_cache`)."""
