"""Text: tokenizers (`tokenizer`; a GGUF file's, `gguf_tokenizer`, `gguf_spm`,
`gguf_merges`, `gguf_pretokenizers`), sandboxed chat templates (`chat_template`, `template_budget`,
`template_checks`) and incremental detokenization with stop strings (`detok`)."""
