"""The splits a byte-level BPE GGUF names in `tokenizer.ggml.pre`, as `tokenizers` pipelines.

llama.cpp (src/llama-vocab.cpp) maps each name its converter writes to a pre-tokenizer type,
and each type to a list of regexes applied in turn: every regex cuts each piece the previous
one left into its matches and the text between them ("isolated"), and the pieces are then
spelled in GPT-2's byte alphabet. That is a `Sequence` of `Split(..., "isolated")` followed
by `ByteLevel(use_regex=False)` here. The 90-odd names share a few splits (`GROUPS`): most
files use GPT-2's, Llama 3's or Qwen2's, some first cut digits one at a time (StarCoder,
SmolLM) or in threes (DeepSeek V3), or CJK runs, or text at line breaks.

Where llama.cpp rewrote a model's regex for its own engine (`(?i:'s)` as `'[sS]`, Tekken's and
GPT-4o's letter classes as lookaheads, BailingMoE's possessive quantifiers as greedy ones)
we write the model's own, from its tokenizer.json, as transformers does: `tokenizers` runs
Oniguruma, which has them. llama.cpp's `default` type cuts punctuation first; we give
`default` GPT-2's split, as transformers does (a file without the key is `default` too).

Per name, llama.cpp also sets two flags we follow: `ignore_merges` (a word found whole in the
vocabulary is one token, as Meta's Llama 3 tokenizer.json says) and whether BOS is added when
the file does not say (`tokenizer.ggml.add_bos_token` decides when present).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's with one digit per piece.
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# Qwen2's with combining marks kept with their letters.
QWEN35 = (
    rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Words as an optional capital run then lower case (or a capital run), "/" kept with
# punctuation.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    rf"|\p{{N}}{_TAIL}"
)
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?|\p{{N}}{{1,3}}{_TAIL}"
)
# Kimi K2: GPT-4o's without "/" after punctuation, and Han runs kept apart from words.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KIMI_K2 = (
    rf"[\p{{Han}}]+|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# CJK unified ideographs (U+4E00-9FA5), hiragana, katakana.
_CJK_KANA = r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
# DeepSeek V3: one ASCII punctuation mark may lead an ASCII word; punctuation and symbols
# (\p{P}\p{S}) are what is not a word.
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
)
DEEPSEEK3 = rf"{_DEEPSEEK3_WORDS}| ?[\p{{P}}\p{{S}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPARK = rf"{_DEEPSEEK3_WORDS}| ?[\p{{P}}\p{{S}}]+|[\r\n]|\s+(?!\S)|\s+"
# AFMoE's digits: a run cut in threes from its end (1234567 -> 1 234 567), then runs of CJK,
# kana, half-width forms, Kangxi radicals, Thai, Lao, Khmer, Myanmar and Hangul. (llama.cpp's
# copy starts the compatibility ideographs at U+8C48, U+F900's NFC form: we take U+F900.)
_DIGITS_FROM_END = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_EAST_ASIAN = (
    r"[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
    r"\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
    r"\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+"
)
YOUTU = (
    r"[\uac00-\ud7a3\u3131-\u318e]+"
    r"|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+"
    r"|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
)
YOUTU_WORDS = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?|\p{{N}}{_TAIL}"
)
# Words end at whitespace or sentence punctuation (Latin, CJK, Devanagari, Arabic). The
# parentheses and "|" inside the class are literal characters: BLOOM's regex says so.
BLOOM = r" ?[^(\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
# Llama 3's, a run of whitespace cut into powers of two from 512 down.
JAIS2 = LLAMA3.replace(
    r"\s+(?!\S)|\s+",
    "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    + r"|\s{1,2}(?!\S)|\s{1}",
)


@dataclass(frozen=True)
class PreTokenizerSplit:
    """How a `tokenizer.ggml.pre` name cuts text before byte-level BPE."""

    group: str  # the split's name in GROUPS
    regexes: tuple[str, ...]  # applied in turn, each cutting the last one's pieces
    ignore_merges: bool = False  # a word that is a token is taken whole
    add_bos: bool = False  # BOS when the file has no tokenizer.ggml.add_bos_token

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        splits = [
            pre_tokenizers.Split(Regex(regex), behavior=behavior)  # type: ignore[arg-type]
            for r in self.regexes
            for regex, behavior in LINEAR_FORMS.get(r, ((r, "isolated"),))
        ]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([*splits, byte_level])


# Regexes that cut digit runs in threes from the run's end with a lookahead that reads the
# rest of the run at every digit (quadratic: 131,072 digits took 18-120 s), and the splits
# specd runs for them instead: the same pieces (tests/test_gguf_pretokenizers.py compares
# them on random text), the run isolated first and then cut from its start, `\A` and `\z`
# being the piece's own ends and `\G` where the last cut ended (0.09 s for 131,072 digits).
_GROUPS_FROM_END = r"\A{d}{{1,3}}(?=(?:{d}{{3}})*\z)|(?!\A)\G{d}{{3}}"
LINEAR_FORMS: dict[str, tuple[tuple[str, str], ...]] = {
    _DIGITS_FROM_END: ((r"\p{N}+", "isolated"), (_GROUPS_FROM_END.format(d=r"\p{N}"), "isolated")),
    # (a run followed by a letter or "_", no word boundary after it, is not cut)
    r"\d{1,3}(?=(?:\d{3})*\b)": (
        (r"(?<!\d)\d++\b", "isolated"),
        (_GROUPS_FROM_END.format(d=r"\d"), "isolated"),
    ),
    # cut before every three digits that end a run of them: each such three matched (the
    # first where the run's length less a multiple of three ends, `\K` leaving that out)
    # and merged with what follows it, up to the next
    r"(?=(\d{3})+(?!\d))": (
        (r"(?<!\d)\d{0,2}(?=(?:\d{3})+(?!\d))\K\d{3}|(?<=\d)\G\d{3}", "merged_with_next"),
    ),
}

# Those of LINEAR_FORMS that match nothing but a place to cut: every split behavior cuts
# the same pieces with them.
ZERO_WIDTH = frozenset({r"(?=(\d{3})+(?!\d))"})

# group -> (its regexes, the names llama.cpp writes for it)
GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "gpt-2": (
        (GPT2,),
        "default gpt2 gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum"
        " modern-bert exaone4 mpt olmo jais trillion granite-docling jina-v1-en jina-v2-code"
        " roberta-bpe",
    ),
    "digits, then gpt-2": (
        (r"\p{N}", GPT2),
        "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
    ),
    "llama3": (
        (LLAMA3,),
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano dbrx"
        " smaug-bpe chatglm-bpe glm4 glm5",
    ),
    "jais-2": ((JAIS2,), "jais-2"),
    "qwen2": (
        (QWEN2,),
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2",
    ),
    "qwen35": ((QWEN35,), "qwen35"),
    "lines, then qwen2": ((r"[^\n]+|[\n]+", QWEN2), "laguna"),
    "qwen2 without contractions": ((QWEN2.replace(f"{_CONTRACTIONS}|", ""),), "ufakzeka"),
    "seed-coder": (
        (
            rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1}}"
            r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        "seed-coder",
    ),
    "bailingmoe": (
        (
            r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
        "bailingmoe bailingmoe2 llada-moe",
    ),
    "exaone-moe": (
        (
            rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?(?:\p{{L}}\p{{M}}*(?: \p{{L}}\p{{M}}*)*)+"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
        "exaone-moe",
    ),
    "digits in threes, then qwen2 with digit runs": (
        (r"\p{N}{1,3}", QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")),
        "minicpm5",
    ),
    "tekken": ((TEKKEN,), "tekken"),
    "gpt-4o": ((GPT4O,), "gpt-4o llama4 kanana2 talkie minimax-m2 granite-embed-multi-97m"),
    "digit groups, then gpt-4o": ((r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O), "tiny_aya cohere2moe"),
    "kimi-k2": ((KIMI_K2,), "kimi-k2"),
    "deepseek-v3": (
        (r"\p{N}{1,3}", _CJK_KANA, DEEPSEEK3),
        "deepseek-v3 hunyuan-dense joyai-llm hy_v4",
    ),
    "spark": ((r"\p{N}{1,3}", _CJK_KANA, SPARK, r"\p{N}"), "spark2_5"),
    "afmoe": ((_DIGITS_FROM_END, _EAST_ASIAN, DEEPSEEK3), "afmoe"),
    "youtu": ((YOUTU, YOUTU_WORDS), "youtu"),
    "deepseek-coder": (
        (
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            r"\p{N}",
        ),
        "deepseek-coder",
    ),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"), "falcon"),
    "bloom": ((BLOOM,), "bloom poro-chat gpt3-finnish"),
    "bloom, then digits": ((BLOOM, r"\p{N}"), "viking"),
    "chameleon": (
        (
            r"<sentinel:[0-9]+>",  # its special tokens, kept whole
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            GPT2,
        ),
        "chameleon",
    ),
    "superbpe": ((r"\p{N}+", r"(?=(\d{3})+(?!\d))"), "superbpe"),
}
# llama.cpp's flags per name (llama-vocab.cpp, where it maps the names).
_IGNORE_MERGES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
    | {"jina-v5-nano", "glm4", "glm5", "tekken", "youtu", "minicpm5", "granite-embed-multi-97m"}
)
_ADD_BOS = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
    | {"jina-v5-nano", "tekken", "chameleon"}
)

PRE_TOKENIZERS: dict[str, PreTokenizerSplit] = {
    name: PreTokenizerSplit(group, regexes, name in _IGNORE_MERGES, name in _ADD_BOS)
    for group, (regexes, names) in GROUPS.items()
    for name in names.split()
}

# Names llama.cpp knows whose vocabulary is not spelled in GPT-2's byte alphabet (SentencePiece
# style BPE over raw UTF-8, or WordPiece-like whitespace splitting): no split makes them one.
NOT_BYTE_LEVEL: dict[str, str] = {
    "gemma4": "SentencePiece-style BPE over raw UTF-8 (Gemma 4)",
    "granite-embed-multi-311m": "SentencePiece-style BPE over raw UTF-8",
    "sarvam-moe": "SentencePiece-style BPE over raw UTF-8",
    "whitespace": "whitespace-split words over raw UTF-8 (an embedding model's)",
    # Its letter class is a list of 2,729 code points that matches no Unicode property.
    "deepseek-llm": "a letter class specd does not carry (DeepSeek LLM 7B/67B)",
}
