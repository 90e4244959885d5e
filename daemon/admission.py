"""Admission: a request checked once against the runtime that is to serve it.

A generation is asked for through three doors: the HTTP API, `specd generate` and
`specd bench`. Each parses what it received by its own rules (the OpenAI wire format's
types and ranges in daemon/http/openai_wire.py, the command line's in its argument
types) into an `Ask`. What depends on the models is decided here, by `admit`, for all
three alike: the `Ask` becomes a `GenerationRequest` (daemon/jobs.py) holding the prompt's
token ids and every parameter settled (the strategy named, `max_tokens` within the room
the context leaves, the grammar compiled into the request's own `Constraint`), or a
`RequestError` naming the field at fault. The engine serves a `GenerationRequest` as it
is: what it still refuses is load (memory pressure, a full queue), never the request.

The checks run in this order, and the first that fails is the one reported:

1. the strategy is one this runtime can build (speculation needs a draft);
2. the prompt: refused before tokenizing when no tokenization of it could fit the context;
   then a conversation is rendered by the chat template and tokenized, text is tokenized
   with the tokenizer's BOS policy, token ids are taken as they are but must be in the
   vocabulary; the prompt must not be empty and must leave room for one new token;
3. `max_tokens` fits the room the prompt leaves, or is cut to it (a default, or
   `clamp_max_tokens`);
4. `logit_bias` names tokens of the vocabulary;
5. the tree budget is within the largest tree the memory plan holds;
6. the grammar (`response_format`, `--json-schema`, or the tools in the model's own call
   format) compiles against the vocabulary, its first mask included: on a thread of the
   grammar compiler's (speculative/grammar_compiler.py: a stack the engine's recursion
   cannot overflow, a time limit), never on the engine's that serves every generation.
   `settle` does the first five; the HTTP door compiles the grammar after it, in a lane
   of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daemon.jobs import GenerationRequest
from daemon.runtime import Runtime, RuntimeSetupError
from modeling.errors import RequestError, TokenizerFailure
from modeling.text.model_template import ChatTemplateError
from modeling.text.thinking import CLOSE, OPEN, Thinking, opened
from modeling.text.tokenizer import TextTooLong, Tokenizer
from speculative.grammar import Grammar
from speculative.grammar_compiler import GrammarCompiler
from speculative.harmony import harmony_call_grammar
from speculative.sampling import SamplingParams
from speculative.thinking import thinking_first
from speculative.tool_calls import (
    HERMES,
    CallFormat,
    Tool,
    native_format,
    render_tool_messages,
    tool_grammar,
)

# A normaliser may contract text before tokenizing (NFKC composes up to three characters
# into one): the refusal before tokenizing allows for it.
CONTRACTION = 4
# limits.grammar_compile_seconds' default, for callers without settings (tests, scripts).
DEFAULT_COMPILE_SECONDS = 5.0


@dataclass
class Ask:
    """A generation as asked: parsed by its door, not yet checked against the models.
    Exactly one of `prompt` and `messages` is set."""

    prompt: str | list[int] | None  # text, or token ids fed exactly
    messages: list[dict[str, Any]] | None  # a conversation, for the chat template
    params: SamplingParams
    max_tokens: int
    max_tokens_given: bool = True  # False: a default, cut to the room left without a word
    max_tokens_field: str = "max_tokens"  # the field that gave it (max_completion_tokens)
    stop: list[str] = field(default_factory=list)
    strategy: str | None = None  # None: the runtime's default
    budget: int | None = None  # tree budget for this request only
    tree_verification: str | None = None  # auto | walk | rejection: the tree's, this request
    ignore_eos: bool = False
    trace: bool = False  # chunks carry each round's draft tree
    grammar: Grammar | None = None  # response_format json_object / json_schema, --json-schema
    tools: list[Tool] | None = None  # offered to the model (rendered in its prompt)
    # The answer may call `tools` (tool_choice not none): "auto", "required" or a name.
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    # More variables for the chat template (chat_template_kwargs, reasoning_effort): Qwen3's
    # `enable_thinking`, gpt-oss's `reasoning_effort`; names specd sets are refused earlier.
    template_vars: dict[str, Any] = field(default_factory=dict)


def admit(
    runtime: Runtime,
    ask: Ask,
    *,
    clamp_max_tokens: bool = False,
    compiler: GrammarCompiler | None = None,
) -> GenerationRequest:
    """`ask` as the engine serves it, or the `RequestError` that refuses it, naming its field
    (the OpenAI field names: the HTTP API answers it as a 400 with that `param`).
    `clamp_max_tokens`: a `max_tokens` the context cannot hold after the prompt is cut to
    what fits (the response then says so) instead of refused (limits.clamp_max_tokens).
    The grammar is compiled by `compiler` (a one-off one at the default time limit if
    none is given), waiting for it here."""
    settled = settle(runtime, ask, clamp_max_tokens=clamp_max_tokens)
    if settled.grammar is None:
        return settled.request
    own = compiler or GrammarCompiler(DEFAULT_COMPILE_SECONDS)
    try:
        width = runtime.target.vocab_width
        settled.request.constraint = own.constraint(settled.grammar, runtime.tokenizer, width)
    finally:
        if own is not compiler:
            own.close()
    return settled.request


@dataclass
class Settled:
    """An admitted request whose grammar (if any) is still to be compiled into its
    `Constraint` (`request.constraint`): the HTTP door compiles it in a lane of its own
    (daemon/http/completions.py), so that requests without a grammar never wait behind
    one being compiled."""

    request: GenerationRequest
    grammar: Grammar | None


def settle(runtime: Runtime, ask: Ask, *, clamp_max_tokens: bool = False) -> Settled:
    """Every check of `admit` but the grammar's compile (the grammar itself is made: the
    tools' in the model's own call format)."""
    strategy = _strategy(runtime, ask.strategy)
    effort = ask.template_vars.get("reasoning_effort")
    if runtime.tokenizer.harmony and effort in ("none", "minimal"):
        # (OpenAI's newer efforts: gpt-oss's template would write "Reasoning: minimal" into
        # its system message, an effort the model was never trained on)
        raise RequestError(
            f"reasoning_effort {effort!r} (the field or chat_template_kwargs'): this model "
            "(OpenAI's harmony format, gpt-oss) reasons at low, medium or high",
            "reasoning_effort",
        )
    prompt_ids = _prompt_ids(runtime, ask)
    max_tokens = _max_tokens(ask, len(prompt_ids), runtime.context, clamp_max_tokens)
    width = runtime.target.vocab_width
    outside = [i for i, _ in ask.params.logit_bias if i >= width]
    if outside:
        raise RequestError(
            f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {width})",
            "logit_bias",
        )
    # A tree bigger than the plan's largest pass would allocate past the memory budget (its
    # ancestor mask alone is budget² bytes).
    if ask.budget is not None and ask.budget > runtime.max_tree_budget:
        most, configured = runtime.max_tree_budget, runtime.options.budget
        source = (
            f"auto's largest tree, speculation.budget being {configured}"
            if configured == "auto"
            else "speculation.budget"
        )
        raise RequestError(
            f"budget {ask.budget} is above the largest tree this daemon planned memory for "
            f"({most} nodes: {source}): ask for at most {most}",
            "budget",
            "budget_too_large",
        )
    thinking = _thinking(runtime.tokenizer, ask, prompt_ids)
    grammar, calls, stop = ask.grammar, None, ask.stop
    if grammar is not None:
        grammar = thinking_first(grammar, thinking)
    if ask.tools is not None and runtime.tokenizer.harmony:
        # A harmony model (gpt-oss) names the function in a message's header and writes its
        # arguments as the body: read back from its text (speculative/harmony.py); a call
        # required (or one named) is generated under a grammar of that format, a turn with
        # no content for a stop string to end (it cut the call's arguments).
        if ask.tool_choice not in (None, "auto", "none"):
            grammar = harmony_call_grammar(
                ask.tools, ask.tool_choice, runtime.tokenizer.vocabulary, "tools"
            )
            stop = []
    elif ask.tools is not None:
        calls = call_format(runtime.tokenizer)
        vocabulary = runtime.tokenizer.vocabulary
        choice, parallel = ask.tool_choice, ask.parallel_tool_calls
        grammar = tool_grammar(
            calls, ask.tools, choice, parallel, "tools", vocabulary, thinking=thinking
        )
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        params=ask.params,
        max_tokens=max_tokens,
        stop=stop,
        strategy=strategy,
        budget=ask.budget,
        tree_verification=ask.tree_verification,
        ignore_eos=ask.ignore_eos,
        trace=ask.trace,
        calls=calls,
        thinking=thinking,
    )
    return Settled(request, grammar)


def _thinking(tok: Tokenizer, ask: Ask, prompt_ids: list[int]) -> Thinking | None:
    """How a conversation's turn may think (modeling/text/thinking.py), where the model
    writes think blocks: inside one already where the prompt opened it. None for a text
    prompt, and where the tags are special tokens under a grammar, which can then not
    spell them (its answer comes at once: nothing of it is reasoning)."""
    if ask.messages is None or not tok.thinks:
        return None
    constrained = ask.grammar is not None or ask.tools is not None
    if constrained and any(t in (OPEN, CLOSE) for t in tok.shown_specials.values()):
        return None
    tail = tok.decode(prompt_ids[-8:], skip_special_tokens=False)
    return Thinking(started=opened(tail))


def call_format(tok: Tokenizer) -> CallFormat:
    """The model's own call format where its template has one, else the fallback's."""
    return native_format(tok.chat_template, tok.vocabulary) or HERMES


def _strategy(runtime: Runtime, name: str | None) -> str:
    """The strategy's name, the runtime's default when none was asked for. One this runtime
    cannot build (speculation without a draft) is the request's fault, not a failure of the
    engine's."""
    if name is None:
        return runtime.default_strategy
    try:
        runtime.check_strategy(name)
    except RuntimeSetupError as exc:
        raise RequestError(str(exc), "strategy") from None
    return name


def _prompt_ids(runtime: Runtime, ask: Ask) -> list[int]:
    tok = runtime.tokenizer
    param = "messages" if ask.messages is not None else "prompt"
    _refuse_what_cannot_fit(ask, param, runtime.context, tok.max_token_chars)
    room = runtime.context - 1  # (the prompt plus at least one new token)
    try:
        if ask.messages is not None:
            ids = _encode_conversation(tok, ask.messages, ask.tools, room, ask.template_vars)
        elif isinstance(ask.prompt, str):
            ids = tok.encode(ask.prompt, at_most=room)
    except TextTooLong as exc:
        raise RequestError(
            f"the prompt has at least {exc.tokens} tokens but the context holds "
            f"{runtime.context} (prompt plus at least one new token must fit); shorten the "
            f"prompt or {RAISE_CONTEXT}",
            param,
            "context_length_exceeded",
        ) from None
    except (ChatTemplateError, TokenizerFailure) as exc:
        raise RequestError(str(exc), param) from None
    if ask.messages is None and not isinstance(ask.prompt, str):
        assert ask.prompt is not None
        vocab = runtime.target.config.vocab_size
        bad = [t for t in ask.prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt"
            )
        ids = list(ask.prompt)
    if not ids:
        raise RequestError("the prompt is empty: at least one token is needed", param)
    if len(ids) + 1 > runtime.context:
        raise RequestError(
            f"the prompt has {len(ids)} tokens but the context holds {runtime.context} "
            f"(prompt plus at least one new token must fit); shorten the prompt or "
            f"{RAISE_CONTEXT}",
            param,
            "context_length_exceeded",
        )
    return ids


def _refuse_what_cannot_fit(ask: Ask, param: str, context: int, max_token_chars: int) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit whatever its tokens: n token ids,
    or text of more characters than the context's tokens can stand for. A conversation's
    text is all that its template may render: contents, earlier calls' names and
    arguments, and the tools offered (names, descriptions, parameters)."""
    if isinstance(ask.prompt, list):
        tokens = len(ask.prompt)
    elif isinstance(ask.prompt, str):
        tokens = len(ask.prompt) // (max_token_chars * CONTRACTION)
    else:
        parts = _conversation_chars(ask)
        tokens = sum(parts.values()) // (max_token_chars * CONTRACTION)
        if tokens + 1 > context:
            # (what the template may render, not what it will: named by its largest part)
            param = max(parts, key=lambda part: parts[part])
            raise RequestError(
                f"the messages, tools and template variables hold "
                f"{sum(parts.values()):,} characters, which a template may render as "
                f"{tokens} tokens or more, but the context holds {context}; shorten the "
                f"{param} or {RAISE_CONTEXT}",
                param,
                "context_length_exceeded",
            )
    if tokens + 1 > context:
        raise RequestError(
            f"the prompt has at least {tokens} tokens but the context holds {context} "
            f"(prompt plus at least one new token must fit); shorten the prompt or "
            f"{RAISE_CONTEXT}",
            param,
            "context_length_exceeded",
        )


def _conversation_chars(ask: Ask) -> dict[str, int]:
    """Characters of every string (and key) in the messages, the tools offered and the
    template's own variables, by the field that holds them, walked without recursion (the
    wire format bounded how deep they nest)."""
    tools = [t.as_openai() for t in ask.tools or []]
    parts = {"messages": ask.messages or [], "tools": tools,
             "chat_template_kwargs": ask.template_vars}  # fmt: skip
    out = {}
    for part, held in parts.items():
        chars = 0
        stack: list[Any] = [held]
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                chars += len(value)
            elif isinstance(value, dict):
                chars += sum(len(k) for k in value if isinstance(k, str))
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        out[part] = chars
    return out


def _encode_conversation(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[Tool] | None,
    at_most: int | None = None,
    variables: dict[str, Any] | None = None,
) -> list[int]:
    """A conversation's prompt ids: the tools, earlier calls and their results rendered by
    the model's template where it has a tool format (Qwen's, Llama 3's, Mistral's,
    harmony's), else in specd's fallback format (speculative/tool_calls.py); `variables`
    are the template's besides (`Ask.template_vars`)."""
    if tok.harmony:  # its template tests `"..." in message.content`: a call's None is absent
        messages = [_harmony_message(m) for m in messages]
    offered = [t.as_openai() for t in tools] if tools else None
    native = tok.harmony or native_format(tok.chat_template, tok.vocabulary) is not None
    return tok.encode_chat(
        messages,
        tools=offered,
        at_most=at_most,
        variables=variables,
        arrange=None if native else render_tool_messages,
    )


def _harmony_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as gpt-oss's template reads it: without a None content (it tests `"..." in
    message.content`), and the `reasoning_content` of an assistant's turn that called and
    said nothing as its `thinking`, which the template writes back as the analysis before
    the calls (harmony asks for the reasoning of the turn that called to be kept). A turn
    that called and said something (a preamble) has its content written as that analysis,
    and the template refuses both ("Cannot pass both content and thinking"): its
    reasoning is left out, as it is for turns that did not call (the template keeps none)."""
    out = {k: v for k, v in message.items() if not (k == "content" and v is None)}
    reasoning = out.pop("reasoning_content", None)
    if reasoning and out.get("tool_calls") and not out.get("content") and "thinking" not in out:
        out["thinking"] = reasoning
    return out


# How a prompt that does not fit may: the daemon's key, `specd generate`'s flag.
RAISE_CONTEXT = "raise the context (context.length; --context)"


def _max_tokens(ask: Ask, prompt_tokens: int, context: int, clamp: bool) -> int:
    """`max_tokens` within the room the context leaves after the prompt. One that does not
    fit is refused (OpenAI's and vLLM's answer), unless `clamp` cuts it; a default is cut
    to the room left."""
    room = context - prompt_tokens
    if ask.max_tokens > room and ask.max_tokens_given and not clamp:
        name = ask.max_tokens_field
        raise RequestError(
            f"{name} is {ask.max_tokens} but the prompt has {prompt_tokens} tokens and "
            f"the context holds {context}: at most {room} new tokens fit; lower {name} "
            f"to {room} or less, shorten the prompt, or {RAISE_CONTEXT}",
            name,
            "context_length_exceeded",
        )
    return min(ask.max_tokens, room)
