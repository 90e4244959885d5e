"""Bytes as tokens: GPT-2's byte-level alphabet (the character each byte is written as in
a byte-level BPE token) and the continuation bytes the detokenizer probes a held
character with."""

from __future__ import annotations

# Continuation bytes the detokenizer probes a held character with: every lead byte of
# UTF-8 takes one of them next (E0 needs A0-BF, ED 80-9F, F0 90-BF, F4 80-8F).
PROBE_BYTES = (0x80, 0x90, 0xA0)


def _byte_level() -> list[str]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a token."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_LEVEL = _byte_level()
BYTE_LEVEL_INDEX = {c: b for b, c in enumerate(BYTE_LEVEL)}
