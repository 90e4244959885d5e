"""Grammars under speculation: which tokens may come next, at every node of a draft tree.

The reference a constrained request samples from is constrained autoregressive decoding:
at each position, the target's logits with the tokens the grammar forbids set to -inf,
then the request's processing (penalties, temperature, top-k/p, min-p) as for any
request. Masking before the processing, not after, means a truncation (top-k, top-p) is
taken among the allowed tokens and never leaves a position with nothing to draw; without
truncation the two orders are the same distribution, the target's restricted to the
allowed tokens and renormalised. Every strategy samples exactly that (speculative/
strategies/): the draft's distributions are masked by the state of their own node, the
target's row at each verified node by the state of that node, and a token is committed to
the grammar only once it is emitted.

The engine is llguidance (its matcher: a token mask per state, consume, rollback): it
has no dependency at run time and computes a mask at a 128k vocabulary in tens of
microseconds; xgrammar needs transformers at run time, which specd does not ship
(scripts/bench_grammar_engines.py measured both). A `Constraint` is one request's matcher
at its committed state; it visits tree nodes by rolling back to the common prefix and
consuming the rest of the node's path (consecutive nodes of best-first growth share most
of their paths), never re-parsing from the start.

Where the grammar allows exactly one token the constrained distribution is one-hot and
the token is emitted without a model pass (`take_forced`, counted as `forced_tokens`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from speculative.grammar_errors import (
    LIMIT_PHRASES,
    REFUSED_TOKEN,
    GrammarError,
    engine_line,
    engine_message,
    engine_stopped,
)
from speculative.grammar_masks import bit, expand, spellable
from speculative.grammar_vocabulary import vocabulary

# JSON output: compact separators and no free whitespace. A small model allowed free
# whitespace between tokens can emit newlines until max_tokens (docs/structured-output.md);
# compact JSON parses the same.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
# Tokens emitted without a pass in one go (a long const string, a key list): the pass
# that feeds them with the next round stays far inside the planned largest pass.
MAX_FORCED = 256
# The engine's own bounds on the work a grammar may cause, at their defaults, except that
# its errors must not quote the grammar or the parser's state: they go back to the
# client that sent the schema, and into the log.
ENGINE_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


@dataclass(frozen=True)
class Grammar:
    """A grammar in the engine's form, and the request field it came from (errors name
    it). Compiled against a vocabulary by `check` (the daemon does it before queueing)."""

    text: str
    field: str
    description: str  # for logs and stats: "json_object", "json_schema:NAME"
    # A Lark grammar's lines that embed a schema from another field (a tool's parameters):
    # (line, counted from 1, and that field), so that an error in one names it.
    schema_lines: tuple[tuple[int, str], ...] = ()
    # The JSON Schema a response_format's grammar was made from (speculative/thinking.py
    # embeds it after a think block); None for other grammars.
    schema: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def json_schema(cls, schema: Any, field: str, name: str = "") -> Grammar:
        if not isinstance(schema, dict):
            raise GrammarError(f"{field} must be a JSON Schema object", field)
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(
                schema,
                defaults=JSON_OPTIONS,  # type: ignore[arg-type]  # a TypedDict in its stub
            )
        except (ValueError, TypeError) as err:
            raise GrammarError(f"{field}: {engine_message(str(err))}", field) from None
        return cls(text, field, f"json_schema:{name}" if name else "json_schema", schema=schema)

    @classmethod
    def lark(
        cls,
        rules: Sequence[str],
        schemas: Sequence[tuple[str, dict[str, Any], str]],
        field: str,
        description: str,
    ) -> Grammar:
        """A Lark grammar of `rules`, one a line, then for each `(name, schema, its field)`
        of `schemas` the rule `name: %json schema`. The schema is that rule's root, as a
        response_format's is its grammar's: its local `$ref`s ("#", "#/$defs/Point",
        "#/definitions/...") resolve against it, never against a schema around it. An
        error the engine finds in one names its field rather than `field`."""
        embedded = [
            f"{name}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"
            for name, schema, _ in schemas
        ]
        text = llguidance.LLMatcher.grammar_from_lark("\n".join([*rules, *embedded]))
        lines = tuple((len(rules) + i + 1, where) for i, (_, _, where) in enumerate(schemas))
        return cls(text, field, description, lines)

    @classmethod
    def regex(cls, pattern: str, field: str) -> Grammar:
        """Text matching `pattern` (the engine's regex dialect)."""
        return cls(llguidance.LLMatcher.grammar_from_regex(pattern), field, "regex")

    @classmethod
    def json_object(cls, field: str) -> Grammar:
        """Any JSON object (OpenAI's `json_object` mode)."""
        grammar = cls.json_schema({"type": "object"}, field)
        return cls(grammar.text, field, "json_object", schema=grammar.schema)

    def validate(self, vocab: llguidance.LLTokenizer | None = None) -> None:
        """Raise GrammarError (naming the field) unless the grammar compiles and uses only
        what the engine implements (a schema keyword it does not: "Unimplemented keys")."""
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self.text, vocab, limits=ENGINE_LIMITS
        )
        if failed:
            raise self.refused("; ".join(messages))

    def refused(self, message: str) -> GrammarError:
        """The request error for the engine's `message` on compiling this grammar, naming
        the field whose schema it is about, without the grammar's text."""
        field = dict(self.schema_lines).get(engine_line(message) or 0, self.field)
        return GrammarError(
            f"{field} cannot be used: {engine_message(message)}", field, "unsupported_grammar"
        )

    def check(self, tokenizer: Any) -> None:
        """`validate`, and that the grammar can be spelled with the tokenizer's pieces."""
        vocab = vocabulary(tokenizer, self.field)
        self.validate(vocab)
        matcher = llguidance.LLMatcher(vocab, self.text, log_level=0, limits=ENGINE_LIMITS)
        if matcher.is_error():
            raise self.refused(matcher.get_error())
        words = torch.empty((vocab.vocab_size + 31) // 32, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if matcher.is_error():
            raise engine_stopped(self.field, matcher.get_error())
        if not spellable(matcher, words, vocab.eos_tokens):
            raise GrammarError(
                f"{self.field}: the model's vocabulary cannot spell the start of this "
                "grammar (no token, and no byte fallback, for its first character)",
                self.field,
                "unsupported_grammar",
            )


def json_schema_from(value: Any) -> str:
    """The schema as the engine reads it: a JSON string."""
    return value if isinstance(value, str) else json.dumps(value)


class Constraint:
    """One request's grammar state: the matcher holds the committed tokens (those emitted
    so far), and visits draft nodes past them (`masks`) by rolling back to the common
    prefix and consuming the rest of the node's path."""

    def __init__(self, grammar: Grammar, tokenizer: Any, width: int) -> None:
        """`width`: the model's logit rows (a padded embedding may be wider than the
        tokenizer; ids past the tokenizer are never allowed). Raises GrammarError (naming
        the field) when the grammar cannot start with this vocabulary; the first mask is
        computed here, so a caller that makes it off the engine's thread pays for it
        there: speculative/grammar_compiler.py, on a thread whose stack the engine's
        recursion cannot overflow, within a time limit."""
        self.grammar = grammar
        self.vocab = vocabulary(tokenizer, grammar.field)
        grammar.validate(self.vocab)
        self.matcher = llguidance.LLMatcher(
            self.vocab, grammar.text, log_level=0, limits=ENGINE_LIMITS
        )
        if self.matcher.is_error():
            raise grammar.refused(self.matcher.get_error())
        self.width = width
        self.words_per_row = (self.vocab.vocab_size + 31) // 32
        self._explored: list[int] = []  # tokens consumed past the committed state
        # The committed state's mask, once computed (a round asks for it up to three
        # times: forced tokens, the root's draft row, the first draw); a commit drops it.
        self._committed_words: torch.Tensor | None = None
        self.forced = 0  # tokens emitted because they were the only one allowed
        self._end = torch.zeros(self.words_per_row, dtype=torch.int32)  # the ends alone
        for eos in self.vocab.eos_tokens:
            self._end[eos // 32] |= bit(eos % 32)
        self.words()  # the start state: spellable, and its mask ready for the first draw

    def twin(self) -> Constraint:
        """Another state of the same grammar, where this one is committed (another choice
        of the same request, `n` > 1): the engine's state copied, nothing compiled again."""
        self._home()
        twin = object.__new__(Constraint)
        twin.__dict__.update(self.__dict__)
        twin.matcher = self.matcher.deep_copy()
        twin._explored = []
        twin._committed_words = None
        return twin

    # -- the committed state -------------------------------------------------------------

    def _home(self) -> None:
        if self._explored:
            self.matcher.rollback(len(self._explored))
            self._explored.clear()

    def words(self) -> torch.Tensor:
        """(W,) int32 mask words of the next token at the committed state."""
        words = self._at_home()
        if self.matcher.is_error() or not spellable(self.matcher, words, self.vocab.eos_tokens):
            self._unspellable()
        return words

    def _at_home(self) -> torch.Tensor:
        """The committed state's mask words (computed once per committed state)."""
        self._home()
        if self._committed_words is None:
            self._committed_words = self._compute()
        return self._committed_words

    def _unspellable(self) -> None:
        field = self.grammar.field
        said = self.matcher.get_error()
        if engine_message(said):  # the engine stopped (one of its limits), not the vocabulary
            raise engine_stopped(field, said)
        raise GrammarError(
            f"{field}: the model's vocabulary has no token for what the grammar requires "
            "next (no piece, and no byte fallback)",
            field,
            "unsupported_grammar",
        )

    def commit(self, tokens: Sequence[int]) -> None:
        """Emitted tokens, in order. Each was drawn under this state's mask, so the
        matcher takes it; if not, the mask and the draw disagreed, a bug worth stopping.
        Nothing is taken past an end of sequence (a chain verified beyond one: the
        generation stops there, those tokens are never emitted)."""
        self._home()
        self._committed_words = None
        for token in tokens:
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(int(token)):
                said = self.matcher.get_error()
                limit = any(phrase in said for phrase in LIMIT_PHRASES)
                if limit and REFUSED_TOKEN not in said:
                    # The mask allowed it, but taking it reaches one of the engine's limits
                    # (500 optional properties: a row of 2,007 items, where 2,000 is the
                    # most): this grammar is beyond the engine, which is the request's.
                    raise engine_stopped(self.grammar.field, said)
                raise RuntimeError(
                    f"the grammar refused token {token} that was drawn under its mask: {said}"
                )

    def take_forced(self, limit: int) -> list[int]:
        """Tokens the grammar allows alone, one after another from the committed state (at
        most `limit`), committed: the constrained distribution there is one-hot whatever
        the model says, so they need no pass."""
        self._home()
        taken: list[int] = []
        while len(taken) < limit:
            if self.matcher.is_error():  # stopped by the engine, not at the grammar's end
                self._unspellable()
            if self.matcher.is_stopped():
                # The text completes the grammar and nothing may follow: an end of
                # sequence is all its mask allows (the one the tokenizer names first).
                taken.append(self.vocab.eos_token)
                break
            allowed = expand(self._at_home(), self.width)
            count = int(allowed.sum())
            if count == 0:
                self._unspellable()
            if count != 1:
                break
            token = int(allowed.nonzero()[0, 0])
            if not self.matcher.consume_token(token):  # the engine's "nothing" sentinel
                self._unspellable()
            self._committed_words = None
            taken.append(token)
            if token in self.vocab.eos_tokens:
                break
        self.forced += len(taken)
        return taken

    def ends(self, tokens: Sequence[int]) -> bool:
        """`tokens` (forced ones) end the sequence."""
        return bool(tokens) and tokens[-1] in self.vocab.eos_tokens

    # -- nodes past the committed state --------------------------------------------------

    def masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """(len(paths), W) mask words after each path of tokens past the committed state
        (a draft node's). A path the grammar refuses (an n-gram guess, a sampled child
        offered past the draft's support) leads nowhere verification can go: its row
        allows everything, so masking it changes nothing."""
        out = torch.empty(len(paths), self.words_per_row, dtype=torch.int32)
        # Visited in the order of their paths (depth first): each move then rolls back
        # and consumes only where two neighbouring paths differ.
        order = sorted(range(len(paths)), key=lambda i: list(paths[i]))
        for i in order:
            path = paths[i]
            if not path:
                out[i] = self._at_home()
            else:
                words = self._compute() if self._goto(path) else None
                # A path the grammar refuses, or a state nothing can follow: no mask.
                if words is not None and spellable(self.matcher, words, self.vocab.eos_tokens):
                    out[i] = words
                else:
                    out[i] = -1
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, after the committed state, the grammar accepts in turn."""
        self._home()
        return self.matcher.validate_tokens(list(tokens))

    def _goto(self, path: Sequence[int]) -> bool:
        """Move the matcher to the state after `path`; False if the grammar refuses it
        (the matcher then stands at the longest accepted prefix)."""
        shared = 0
        for a, b in zip(self._explored, path, strict=False):
            if a != b:
                break
            shared += 1
        if shared < len(self._explored):
            self.matcher.rollback(len(self._explored) - shared)
            del self._explored[shared:]
        rest = [int(t) for t in path[shared:]]
        if not rest:
            return True
        taken = self.matcher.try_consume_tokens(rest)
        self._explored.extend(rest[:taken])
        return taken == len(rest)

    def _compute(self) -> torch.Tensor:
        """The mask words at the matcher's state; past an end of sequence, the end of
        sequence alone (nothing else can follow it)."""
        if self.matcher.is_stopped():
            return self._end.clone()
        words = torch.empty(self.words_per_row, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        return words
