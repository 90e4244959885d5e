"""`specd generate`: one generation streamed to the terminal (or printed as JSON), from a
runtime built as the daemon builds one and a request admitted as the daemon admits one.
Its flags are a contract scripts rely on (docs/cli.md). Nothing here imports torch at
module level (daemon/cli/commands.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from daemon import strict_json
from daemon.cli import plan, serve
from daemon.cli.argtypes import (
    DRAFT_HELP,
    MAX_THREADS,
    MODEL_HELP,
    count,
    count_or_auto,
    temperature,
    text,
)
from daemon.options import RuntimeOptions
from daemon.settings import (
    COMPILE_CHOICES,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    STRATEGY_CHOICES,
    learned_cache_dir,
    no_draft,
    substitute_cache_dir,
)
from daemon.startup import collector_paused
from modeling.errors import RequestError

if TYPE_CHECKING:
    from daemon.jobs import GenerationRequest
    from speculative.generation import Generation
    from speculative.grammar import Grammar
    from speculative.sampling import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a generation to the terminal")
    add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)


def _prompt_ids(text: str) -> list[int]:
    """`1,2,3`: every item an integer (`1,,2` is a typo, not [1, 2]); `""` is no ids."""
    if not text.strip():
        return []
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers, got {text[:80]!r}"
        ) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="auto: the checkpoint's dtype on CUDA; fp32 on a CPU when the model fits in fp32",
    )
    plan.add_quantize_args(p, default=None)
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    p.add_argument(
        "--threads",
        type=count_or_auto("--threads", 1, MAX_THREADS),
        default="auto",
        help="CPU compute threads, or auto (1 for tiny models, else the physical cores)",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="auto",
        help="compiled passes: auto (the daemon only, where measured to pay), off, on",
    )
    plan.add_context_arg(p, default="auto")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt",
        type=text("--prompt"),
        default=None,
        help="text, tokenized as the model's tokenizer says",
    )
    src.add_argument("--prompt-ids", type=_prompt_ids, default=None, help="ids fed exactly: 1,2,3")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send --prompt as a user message through the model's chat template (the answer "
        "ends at its end of turn), as `specd chat --once` does",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--temperature", type=temperature, default=0.0, help="0 = greedy (default), up to 2"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--stop", type=text("--stop"), action="append", default=[], help="stop string (repeatable)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS tokens")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with JSON valid against the JSON Schema in FILE (exactly lossless "
        "constrained decoding, every strategy)",
    )
    shape.add_argument("--json-object", action="store_true", help="answer with a JSON object")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="N independent samples (seeds S, S+1, …), one JSON line each",
    )
    add_speculation_args(p)
    plan.add_offload_args(p)


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default="auto", help=DRAFT_HELP)
    p.add_argument(
        "--strategy",
        choices=STRATEGY_CHOICES,
        default=None,
        help="default: tree with a draft, autoregressive without",
    )
    p.add_argument(
        "--spec-length",
        type=count("--spec-length", 1),
        default=4,
        help="linear: tokens drafted per round",
    )
    p.add_argument(
        "--budget",
        type=count_or_auto("--budget", 1),
        default="auto",
        help="tree: node budget or 'auto'",
    )
    p.add_argument(
        "--max-depth", type=count("--max-depth", 1), default=None, help="tree: depth limit"
    )
    serve.add_tree_verification_arg(p, default="auto")
    plan.add_prefix_cache_arg(p)


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:

    return plan.apply_offload_args(_base_runtime_options(args), args)


class LoadingNotes:
    """What loading is doing while it takes long (the CPU kernels' first build, the
    substitute draft's layers), on stderr: a note of a new kind at once, the same kind's
    next at most every NOTE_SECONDS (a substitute of 30 layers is not 30 lines)."""

    def __init__(self) -> None:
        self._kind: str | None = None
        self._shown = 0.0

    def __call__(self, note: str) -> None:
        kind, now = note.split(":")[0], time.monotonic()
        if kind != self._kind or now - self._shown >= NOTE_SECONDS:
            print(f"specd: {note}", file=sys.stderr, flush=True)
            self._kind, self._shown = kind, now


NOTE_SECONDS = 5.0


def _base_runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    return RuntimeOptions(
        model=args.model,
        draft=no_draft(args.draft),
        strategy=args.strategy,
        spec_length=args.spec_length,
        budget=args.budget,
        max_depth=args.max_depth,
        tree_verification=args.tree_verification,
        dtype=args.dtype,
        quantize=args.quantize,
        draft_quantize=args.draft_quantize,
        substitute_bits=args.substitute_bits or "auto",
        substitute_cache=substitute_cache_dir("auto"),
        learned_cache=learned_cache_dir("auto"),
        device=args.device,
        context=args.context,
        threads=args.threads,
        compile=args.compile,
    )


def sampling_params(args: argparse.Namespace, seed: int | None) -> SamplingParams:
    from speculative.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise RequestError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.samples < 1:
        raise RequestError(f"--samples must be at least 1, got {args.samples}")
    if args.chat and args.prompt_ids is not None:
        raise RequestError(
            "--chat sends --prompt text as a user message; --prompt-ids are fed as they are"
        )
    if args.chat and args.prompt is None:  # (an empty message was sent, and answered)
        raise RequestError("--chat sends --prompt TEXT as a user message: give --prompt")
    with collector_paused():
        from daemon.admission import Ask, admit
        from daemon.compiling import print_progress
        from daemon.runtime import Runtime
        from speculative.generation import Generation

        runtime = Runtime(replace(runtime_options(args), on_progress=LoadingNotes()))
    runtime.compile(serving=False).warm(print_progress)  # --compile on: before the first token
    prompt = list(args.prompt_ids) if args.prompt_ids is not None else args.prompt or ""
    # --chat: an instruct model given a raw question often ends its text at once.
    messages = [{"role": "user", "content": prompt}] if args.chat else None
    grammar = output_grammar(args)

    def admitted(seed: int | None) -> GenerationRequest:
        """The request of one sample (its seed, its own grammar state), admitted as the
        daemon admits one; a --max-tokens past the context is cut to what fits."""
        ask = Ask(
            prompt=None if messages else prompt,
            messages=messages,
            params=sampling_params(args, seed),
            max_tokens=args.max_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            grammar=grammar,
        )
        return admit(runtime, ask, clamp_max_tokens=True)

    request = admitted(args.seed)  # a bad prompt or grammar is refused before any pass
    strategy = runtime.strategy(request.strategy)
    session = runtime.new_session(strategy)

    def generation(request: GenerationRequest) -> Generation:
        return Generation(
            strategy,
            session,
            runtime.tokenizer,
            request.prompt_ids,
            request.params,
            max_tokens=request.max_tokens,
            stop=request.stop,
            ignore_eos=request.ignore_eos,
            constraint=request.constraint,
            thinking=request.thinking,
        )

    if args.samples > 1:
        # One loaded runtime and one session for all samples: the session keeps the
        # prompt's KV entries, so only the first sample pays the prefill. Without --seed
        # every sample draws its own OS seed, which keeps them independent too.
        for i in range(args.samples):
            if i:
                request = admitted(None if args.seed is None else args.seed + i)
            gen = generation(request).run()
            gen.stats.extra.update({**runtime.offload_stats(), **runtime.draft_stats()})
            print(json.dumps(generation_record(gen)), flush=True)
        runtime.save_learned()  # for the next run of this pair (daemon/learned_store.py)
        return 0
    gen = generation(request)
    if args.json:
        gen.run()
        gen.stats.extra.update({**runtime.offload_stats(), **runtime.draft_stats()})
        print(json.dumps(generation_record(gen)))
    else:
        from speculative.harmony import HarmonyReader
        from speculative.thinking import ThinkReader

        # A harmony model's (gpt-oss) turn, or a reasoning model's (Qwen3): the answer on
        # stdout, its reasoning on stderr.
        turn: HarmonyReader | ThinkReader | None = None
        if args.chat and runtime.tokenizer.harmony:
            turn = HarmonyReader()
        elif request.thinking is not None:
            turn = ThinkReader(request.thinking)
        wrote = False
        for chunk in gen:
            wrote = wrote or bool(chunk.text)
            if turn is None:
                sys.stdout.write(chunk.text)
            else:
                for kind, text in turn.feed(chunk.text):
                    (sys.stdout if kind == "content" else sys.stderr).write(text)
                sys.stderr.flush()
            sys.stdout.flush()
        for kind, text in turn.finish() if turn is not None else []:
            (sys.stdout if kind == "content" else sys.stderr).write(text)
        sys.stdout.write("\n")
        if gen.finish_reason == "length":
            # (as `specd chat` marks it: a cut answer, JSON under a schema most of all, read
            # as a finished one)
            full = len(gen.token_ids) < args.max_tokens
            cut = "cut: the context is full" if full else f"cut at --max-tokens {args.max_tokens}"
            print(f"specd: [{cut}]", file=sys.stderr)
        if not wrote and not args.chat and runtime.tokenizer.has_chat_template:
            # (an instruct model given a raw question often ends its text at once)
            print(
                "specd: the model ended its text at once; it has a chat template: "
                "--chat sends --prompt as a user message",
                file=sys.stderr,
            )
    runtime.save_learned()
    return 0


# The most a file named on the command line for a request's field may hold (the daemon's
# request bodies: limits.max_body_bytes' default).
MAX_ARGUMENT_FILE_BYTES = 1 << 20


def output_grammar(args: argparse.Namespace) -> Grammar | None:
    """--json-schema FILE / --json-object as a grammar (None: free text)."""
    from speculative.grammar import Grammar
    from speculative.schema_limits import SchemaLimits, check_schema

    if args.json_object:
        return Grammar.json_object("--json-object")
    if args.json_schema is None:
        return None
    from daemon.small_files import SmallFileError, read_small

    try:  # (a FIFO or /dev/zero named here hung, or filled the memory)
        text = read_small(Path(args.json_schema).expanduser(), MAX_ARGUMENT_FILE_BYTES)
        schema = strict_json.loads(text.decode("utf-8"))
    except SmallFileError as err:
        raise RequestError(f"--json-schema {err}") from None
    except OSError as err:
        raise RequestError(f"--json-schema {args.json_schema}: {err.strerror}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        said = "nested too deep" if isinstance(err, RecursionError) else str(err)
        raise RequestError(f"--json-schema {args.json_schema} is not JSON: {said}") from None
    # Measured as the daemon measures a request's (limits.schema_*, at their defaults);
    # compiled when the request is admitted, on a grammar compiler's thread.
    field = f"--json-schema {args.json_schema}"
    check_schema(schema, field, SchemaLimits())
    return Grammar.json_schema(schema, field)


def generation_record(gen: Generation) -> dict:
    return {
        "prompt_ids": gen.prompt_ids,
        "token_ids": gen.token_ids,
        "text": gen.text,
        "finish_reason": gen.finish_reason,
        "stats": gen.stats.to_dict(),
    }
