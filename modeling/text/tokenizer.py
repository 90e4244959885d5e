"""Tokenizer (`tokenizer.json` via `tokenizers`), BOS/EOS policy and chat templates.

Chat templates come from the checkpoint (`tokenizer_config.json` or `chat_template.jinja`:
modeling/text/model_template.py) and are rendered in a sandboxed Jinja environment (modeling/text/chat_template.py): a template
is code shipped by whoever published the model, so it may not touch attributes or call
anything unsafe. Jinja is imported only when a template is compiled: a checkpoint's own
template at load (so a broken one fails there), the fallback at its first use, so that
`specd generate` on a base model never pays for Jinja.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer

from modeling.checkpoints.folder_files import (
    DAMAGED,
    CheckpointError,
)
from modeling.checkpoints.gguf_file import short_repr
from modeling.config import ModelConfig
from modeling.errors import RequestError, tokenizer_failure
from modeling.text import harmony, thinking
from modeling.text.byte_level import BYTE_LEVEL, BYTE_LEVEL_INDEX, PROBE_BYTES
from modeling.text.control_text import ControlTokens, request_chars
from modeling.text.model_template import (
    FALLBACK_CHAT_TEMPLATE,
    ChatTemplateError,
    compile_chat_template,
    folder_chat_template,
    tokenizer_config,
)
from modeling.text.tokenizer_file import read_backend

if TYPE_CHECKING:
    from jinja2 import Template

# specd's own writing of a request's tools into its messages (`Tokenizer.encode_chat`).
Arrange = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[dict[str, Any]]]


def _token_text(tc: dict[str, Any], key: str, file: Path) -> str | None:
    """tokenizer_config.json's `key` (bos_token, eos_token): a token's text, or an object
    with its text as `content` (an AddedToken as transformers writes it), or none."""
    value = tc.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise CheckpointError(
            f"{file}: {key} is {short_repr(value)}; it must be a token's text or an object "
            f"with it as `content`: {DAMAGED}"
        )
    return text


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        template_source: str = "",
    ) -> None:
        """`template_source`: where the chat template came from (a file and its key), for
        the messages that blame it."""
        self.backend = tokenizer
        self.template_source = template_source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.add_bos = add_bos  # None: whatever tokenizer.json's post-processor does
        # OpenAI's harmony format (gpt-oss): its message markers stay in decoded text, for
        # the answer to be read from it (modeling/text/harmony.py), and its turn ends at
        # `<|return|>` or `<|call|>`.
        markers = {m: tokenizer.token_to_id(m) for m in harmony.MARKERS}
        self.harmony = markers[harmony.CHANNEL] is not None and markers[harmony.MESSAGE] is not None
        self.shown_specials: dict[int, str] = {}
        if self.harmony:
            self.shown_specials = {i: m for m, i in markers.items() if i is not None}
            stops = [i for m in harmony.STOPS if (i := markers[m]) is not None]
            eos_token_ids = [*eos_token_ids, *stops]
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        # A reasoning model's think blocks (modeling/text/thinking.py): its tags stay in the
        # decoded text, special tokens or not, for the reasoning to be read from it.
        tags = {t: tokenizer.token_to_id(t) for t in (thinking.OPEN, thinking.CLOSE)}
        self.thinks = (
            not self.harmony
            and chat_template is not None
            and thinking.CLOSE in chat_template
            and None not in tags.values()
        )
        if self.thinks:
            special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
            self.shown_specials.update({i: t for t, i in tags.items() if i in special})
        # The control tokens a request's text may not write (`encode_chat`): the special
        # added tokens and those the template writes, a reasoning model's think tags aside.
        self._controls = ControlTokens(
            tokenizer, (thinking.OPEN, thinking.CLOSE) if self.thinks else (), chat_template
        )
        self.chat_template = chat_template
        self.has_chat_template = chat_template is not None
        self._template: Template | None = None  # compiled by _compiled_template
        if chat_template is not None:
            self._compiled_template()

    @classmethod
    def from_folder(
        cls, path: Path, config: ModelConfig, generation_defaults: dict[str, Any] | None = None
    ) -> Tokenizer:
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json (specd reads tokenizers in the `tokenizers` format)"
            )
        backend = read_backend(file)
        tc = tokenizer_config(path)
        tc_file = path / "tokenizer_config.json"
        bos = _token_text(tc, "bos_token", tc_file)
        eos = _token_text(tc, "eos_token", tc_file)
        # EOS ids: the generation config's (may be a list) and the model config's, plus the
        # tokenizer's eos token; any of them ends a generation.
        eos_ids: list[int] = []
        gen_eos = (generation_defaults or {}).get("eos_token_id")
        if isinstance(gen_eos, list):
            eos_ids += gen_eos
        elif gen_eos is not None:
            eos_ids.append(gen_eos)
        eos_ids += list(config.eos_token_ids)
        eos_id = backend.token_to_id(eos) if eos else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        if bos is None and config.bos_token_id is not None:
            bos = backend.id_to_token(config.bos_token_id)
        template, source = folder_chat_template(path, tc)
        add_bos = tc.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise CheckpointError(
                f"{tc_file}: add_bos_token is {short_repr(add_bos)}; it must be true, false "
                f"or null: {DAMAGED}"
            )
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            add_bos=add_bos,
            eos_token_ids=eos_ids,
            chat_template=template,
            template_source=source,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def vocabulary(self) -> dict[str, int]:
        """Every token string → its id, added tokens included. Read once: at a vocabulary of
        128k, building the dict takes ~0.1 s."""
        return self.backend.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def byte_tokens(self) -> dict[int, int] | None:
        """Byte value → the id of the token of that lone byte, for the bytes the detokenizer
        probes with (modeling/text/detok.py: continuation bytes, and the lead and tail of
        one character to check them with): a byte-fallback `<0xNN>` piece or a byte-level
        token (GPT-2's alphabet). None where the vocabulary has no such tokens or they do
        not decode as bytes (a tokenizer that never splits a character)."""
        wanted = (*PROBE_BYTES, 0xE2, 0x82, 0xAC)
        found: dict[int, int] = {}
        for value in wanted:
            token = self.backend.token_to_id(self._byte_piece(value))
            if token is None:
                return None
            found[value] = token
        try:
            euro = self.backend.decode([found[0xE2], found[0x82], found[0xAC]])
            lone = [self.backend.decode([found[b]]) for b in PROBE_BYTES]
        except BaseException:
            return None
        if euro != "\u20ac" or any(text != "\ufffd" for text in lone):
            return None
        return found

    @functools.cached_property
    def _byte_fallback(self) -> bool:
        """Whether lone bytes are `<0xNN>` pieces (SentencePiece's byte fallback), not
        characters of GPT-2's byte-level alphabet."""
        return self.backend.token_to_id("<0x80>") is not None

    @functools.cached_property
    def fallback_bytes(self) -> frozenset[int]:
        """The ids of byte fallback's 256 `<0xNN>` pieces (empty for other tokenizers): a
        run of them decodes all or nothing, so the detokenizer never decodes bytes it has
        shown together with new ones (modeling/text/detok.py)."""
        if self.byte_tokens is None or not self._byte_fallback:
            return frozenset()
        found = (self.backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(t for t in found if t is not None)

    @functools.cached_property
    def anchor(self) -> int | None:
        """A token that decodes to text of its own (a letter), put before new tokens where
        the text already shown is all bytes: what follows it reads as mid-text (a
        SentencePiece word keeps its space). Never a byte piece (a vocabulary without
        "a" spells it `<0x61>`, which would join the new bytes' run)."""
        ids = self._ids("a", False)
        if not ids or ids[-1] in self.fallback_bytes:
            return None
        return ids[-1] if self.backend.decode(ids[-1:]) else None

    def _byte_piece(self, value: int) -> str:
        return f"<0x{value:02X}>" if self._byte_fallback else BYTE_LEVEL[value]

    def raw_bytes(self, token: int) -> bytes | None:
        """The bytes a token stands for, where its piece spells them (a byte-level token, a
        byte-fallback `<0xNN>` piece, a SentencePiece piece with `▁` for a space); None for
        a tokenizer with no byte tokens or a piece outside them (a special token). What a
        piece of a character is, where its text alone reads U+FFFD."""
        piece = self.backend.id_to_token(token)
        if piece is None or self.byte_tokens is None:
            return None
        if self._byte_fallback:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    return None
            return piece.replace("\u2581", " ").encode()
        try:
            return bytes(BYTE_LEVEL_INDEX[c] for c in piece)
        except KeyError:
            return None

    @property
    def id_limit(self) -> int:
        """One past the largest id the tokenizer can produce, added tokens included: the
        embedding rows a model needs (ids may have gaps, so not always `vocab_size`)."""
        # (a post-processor's special tokens are ids of their own: none past the model's)
        special = self.backend.encode("", add_special_tokens=True).ids
        return max(max(self.vocabulary.values(), default=-1), max(special, default=-1)) + 1

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its string's length (a
        byte-level token's characters are its bytes, a SentencePiece piece's are its text,
        byte fallback's `<0x..>` is one byte), so a text of n characters has at least
        n / max_token_chars tokens, short of a normaliser contracting it."""
        return max(1, max((len(piece) for piece in self.vocabulary), default=1))

    def _ids(self, text: str, add_special_tokens: bool, at_most: int | None = None) -> list[int]:
        self._probe(text, at_most, add_special_tokens)
        try:
            # `encode_batch` releases the GIL while it works (`encode` holds it: 0.6 s for
            # a megabyte, with the event loop frozen meanwhile); same ids.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except BaseException as err:
            raise tokenizer_failure(err, "tokenize this text") from None

    def _probe(self, text: str, at_most: int | None, add_special_tokens: bool = False) -> None:
        if at_most is not None and len(text) > PROBE_CHARS * at_most:
            # A text that may be far longer than `at_most` tokens: its start is counted
            # first (a megabyte of digits, a token each, took 3.3 s to tokenize before
            # being refused for the context). Cut anywhere, a text's start has its
            # tokens, give or take a few at the cut.
            probe = self._ids(text[: PROBE_CHARS * at_most], add_special_tokens)
            if len(probe) - PROBE_MARGIN > at_most:
                raise TextTooLong(len(probe) - PROBE_MARGIN)

    def encode(
        self, text: str, add_special_tokens: bool = True, at_most: int | None = None
    ) -> list[int]:
        """Token ids for `text`; with `add_special_tokens`, BOS as the tokenizer config asks.
        `at_most`: a text whose start alone has more tokens is refused (`TextTooLong`)
        without tokenizing the rest; one of fewer may still have more."""
        if not add_special_tokens:
            return self._ids(text, False, at_most)
        if self.add_bos is None:
            return self._ids(text, True, at_most)
        ids = self._ids(text, False, at_most)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        shown = self.shown_specials
        if not (skip_special_tokens and shown) or not any(i in shown for i in ids):
            try:
                return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
            except BaseException as err:
                raise tokenizer_failure(err, "decode these tokens") from None
        # Harmony's markers spelled out between the runs decoded as usual.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in shown:
                parts += [self.backend.decode(run, skip_special_tokens=True), shown[i]]
                run = []
            else:
                run.append(i)
        parts.append(self.backend.decode(run, skip_special_tokens=True))
        return "".join(parts)

    def piece(self, token: int, after: int | None = None) -> str:
        """One token's text as it reads after the token `after` (None: on its own), special
        tokens spelled out: what log-probabilities and traces name a token. Decoded with the
        token before it and that one's text cut off, because a SentencePiece word's leading
        space is lost when the piece is decoded alone; a piece of a multi-byte character
        still reads U+FFFD."""
        if after is None:
            return self.decode([token], skip_special_tokens=False)
        before = self.decode([after], skip_special_tokens=False)
        return self.decode([after, token], skip_special_tokens=False)[len(before) :]

    def _whose_template(self) -> str:
        """The template, for a request's error (which names no server path)."""
        return "the model's chat template" if self.chat_template else "specd's fallback template"

    def _compiled_template(self) -> Template:
        if self._template is None:
            source = self.template_source if self.chat_template else ""
            self._template = compile_chat_template(
                self.chat_template or FALLBACK_CHAT_TEMPLATE, source
            )
        return self._template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the chat template renders it; `variables` are more of the
        template's (Qwen3's `enable_thinking`, gpt-oss's `reasoning_effort`), never one of
        the names set here (those win)."""
        from modeling.text.chat_template import TemplateError, TemplateLimitError

        template = self._compiled_template()
        try:
            own = dict(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                # As transformers renders: defined but None (`tools is not none` is False).
                tools=tools,
                documents=None,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
            return template.render({**(variables or {}), **own})
        except TemplateLimitError as exc:
            # A template is code from the model file; one that loops or grows without end
            # is stopped (modeling/text/chat_template.py), and the request says so.
            raise ChatTemplateError(f"{self._whose_template()} was stopped: {exc}") from exc
        except TemplateError as exc:
            raise ChatTemplateError(f"{self._whose_template()} failed: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        at_most: int | None = None,
        variables: dict[str, Any] | None = None,
        arrange: Arrange | None = None,
    ) -> list[int]:
        """Prompt ids for a conversation, ready for the assistant's turn; `tools` (OpenAI's
        shape) go to a template that renders them (speculative/tool_calls.py), or to
        `arrange`, specd's own writing of them into the messages for a template that does
        not (its markup is not the request's: it comes after the request's spelled control
        tokens are found). `at_most` as `encode`'s, `variables` as `render_chat`'s."""
        # (a template writes BOS itself)
        bos = not self.has_chat_template
        # Control tokens spelled in the request's text are read as that text
        # (modeling/text/control_text.py). Their search tokenizes the strings whole: a
        # request long enough to be refused for the context has the start of its
        # rendering counted first (a megabyte that held one near its end took 3 times as
        # long to refuse). Its spelled tokens count one each there, fewer than as text.
        if (
            at_most is not None
            and request_chars(messages, tools, variables) > PROBE_CHARS * at_most
        ):
            self._probe(self._rendered(messages, tools, variables, arrange), at_most)
        guarded = self._controls.guard((messages, tools, variables))
        if guarded is not None:
            messages, tools, variables = guarded.values
        text = self._rendered(messages, tools, variables, arrange)
        if guarded is None:
            return self.encode(text, add_special_tokens=bos, at_most=at_most)
        # The rendering with the spelled tokens put back is held to the template's output
        # bound, as if the template had written them: one longer than its placeholder,
        # repeated by the template, grew a request of a kilobyte to 16 MB (3.2 GB to read).
        from modeling.text.template_budget import MAX_OUTPUT_SIZE, OUTPUT_SIZE_PER_INPUT

        size = guarded.restored_size(text)
        limit = max(
            MAX_OUTPUT_SIZE, OUTPUT_SIZE_PER_INPUT * request_chars(messages, tools, variables)
        )
        if size > limit:
            raise ChatTemplateError(
                f"{self._whose_template()} was stopped: it wrote more than {limit:,} "
                "characters (the limit on one rendering)"
            )
        if at_most is not None and size > PROBE_CHARS * at_most:
            # Its start counted first, as `_probe` counts a text's, the spelled tokens as
            # text (the tokenizer would count each as one).
            start = self._controls.encode(text, guarded, PROBE_CHARS * at_most)
            if len(start) - PROBE_MARGIN > at_most:
                raise TextTooLong(len(start) - PROBE_MARGIN)
        ids = self._controls.encode(text, guarded)
        return self._framed(ids) if bos else ids

    def _rendered(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        variables: dict[str, Any] | None,
        arrange: Arrange | None,
    ) -> str:
        if arrange is not None:
            messages, tools = arrange(messages, tools), None
        return self.render_chat(messages, tools=tools, variables=variables)

    def _framed(self, ids: list[int]) -> list[int]:
        """`ids` with what `encode` adds with `add_special_tokens` (BOS, or what the
        post-processor writes around a text)."""
        if self.add_bos is None:
            head, tail = self._post_frame
            return [*head, *ids, *tail]
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            return [self.bos_id, *ids]
        return ids

    @functools.cached_property
    def _post_frame(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor writes before and after a text."""
        bare, framed = self._ids("a", False), self._ids("a", True)
        for i in range(len(framed) - len(bare) + 1):
            if framed[i : i + len(bare)] == bare:
                return framed[:i], framed[i + len(bare) :]
        return [], []


# A text longer than this many characters per token allowed has its start counted first
# (`Tokenizer._ids`): 8 is twice an English token's, eight times a digit's; and the tokens a
# cut may add to that count.
PROBE_CHARS = 8
PROBE_MARGIN = 16


class TextTooLong(RequestError):
    """A text whose start alone has more tokens than were allowed (`tokens` of them, at
    least): the rest was not tokenized."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"the text has at least {tokens} tokens", None, "context_length_exceeded")
        self.tokens = tokens
