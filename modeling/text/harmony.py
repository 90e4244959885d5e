"""OpenAI's harmony format (gpt-oss): its message markers, special tokens that a harmony
tokenizer keeps in its decoded text (`Tokenizer.harmony`) and whose turn ends at
`<|return|>` or `<|call|>`. speculative/harmony.py reads a turn's text into its answer,
reasoning and tool calls.
"""

from __future__ import annotations

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL, RETURN)
STOPS = (RETURN, CALL)  # what ends an assistant's turn
