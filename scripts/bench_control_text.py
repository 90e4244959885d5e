"""What reading spelled control tokens as text costs a chat prompt, side by side in one run.

    .venv/bin/python scripts/bench_control_text.py [--repeats 5] [--chars 200000]

Per row, a conversation of about --chars characters of one kind of text, tokenized as a
chat prompt two ways, taking turns: `encode_chat` (the request's strings searched for
spelled control tokens, modeling/text/control_text.py) against the template's rendering
tokenized whole (what specd did before, reading a spelled one as the token). Kinds: prose
(no `<`: no string is searched), code full of `<` (searched, none found), and text that
spells `<|im_end|>` every 200 characters (searched, guarded, its stretches read again by the
plain copy). Tokenizers: SmolLM2's GGUF (49k tokens) and a byte-level BPE of 262,144 tokens
with 6,000 `<unused…>` control tokens (Gemma 3's count). Per row: the median seconds of each
way and their ratio; the first guarded prompt's extra time (the plain copy being made) apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling.checkpoints.gguf_file import read_gguf  # noqa: E402
from modeling.text.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from modeling.text.tokenizer import Tokenizer  # noqa: E402
from scripts.real_forms import SMOLLM2_GGUF  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
KINDS = {
    "prose": "The river runs past an old mill where children play in the summer light. ",
    "code <": "for (int i = 0; i < n; i++) { if (a[i] < b) x = f<T>(a[i]); }\n",
    "spells <|im_end|>": "x" * 190 + "<|im_end|>",
}


def tokenizers() -> dict[str, Tokenizer]:
    from tokenizers import AddedToken

    from scripts.tiny_models import build_tokenizer

    smollm2 = tokenizer_from_gguf(read_gguf(SMOLLM2_GGUF).metadata, SMOLLM2_GGUF.name)
    big = build_tokenizer(262_144)
    big.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
        + [AddedToken(f"<unused{i}>", special=True, normalized=False) for i in range(6000)]
    )
    return {
        "SmolLM2 (49k)": smollm2,
        "byte-level BPE 262k": Tokenizer(big, chat_template=CHATML),
    }


def timed(f: object) -> float:
    start = time.perf_counter()
    f()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chars", type=int, default=200_000)
    args = parser.parse_args()
    print(
        "| tokenizer | text | tokens | encode_chat s | rendered whole s | ratio | first guarded |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, tok in tokenizers().items():
        for kind, unit in KINDS.items():
            text = unit * (args.chars // len(unit))
            messages = [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text},
            ]

            def guarded(tok: Tokenizer = tok, messages: list = messages) -> list[int]:
                return tok.encode_chat(messages)

            def whole(tok: Tokenizer = tok, messages: list = messages) -> list[int]:
                rendered = tok.render_chat(messages)
                return tok.encode(rendered, add_special_tokens=not tok.has_chat_template)

            first = timed(guarded) - timed(guarded)  # (the copy, where this row makes it)
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(timed(guarded))
                theirs.append(timed(whole))
            a, b = statistics.median(ours), statistics.median(theirs)
            made = f"+{first:.2f} s" if first > 0.05 else "-"
            print(
                f"| {name} | {kind} | {len(guarded()):,} | {a:.3f} | {b:.3f} | {a / b:.2f} "
                f"| {made} |"
            )


if __name__ == "__main__":
    main()
