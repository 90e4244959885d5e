"""`specd chat`: an interactive streaming client of the daemon's REST endpoint.

It talks to the daemon as any OpenAI client would, through daemon/cli/chat_client.py
(plain HTTP + SSE from the standard library).

The conversation outlives the context: when the daemon answers that the prompt does not
fit, the oldest turns are dropped (the system prompt is kept) and the turn is sent again.
With --tools the answer may be tool calls: each is shown as `[tool call] name(arguments)`
while its arguments stream, and goes back to the daemon with the next turn.
Ctrl-C stops the answer being written by closing its connection, which is how the daemon
learns to cancel the generation; the chat goes on."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from daemon import service
from daemon.addresses import daemon_url
from daemon.cli.argtypes import count, temperature
from daemon.cli.chat_client import (
    Answer,
    ChatError,
    ChatStream,
    Thought,
    ToolCall,
    daemon_address,
    probe,
)
from daemon.cli.serve import (
    add_address_args,
    add_tree_verification_arg,
    configured_api_key,
    names_address,
    read_api_key,
    settings_from_args,
)
from daemon.small_files import SmallFileError, read_small

# The daemon's error code for a prompt longer than its context (daemon/admission.py).
CONTEXT_FULL = "context_length_exceeded"
COMMANDS = "/reset starts the conversation over, /exit (or Ctrl-D) quits, /help shows this"


class Conversation:
    """The messages sent with each turn: the system prompt, always, then the turns."""

    def __init__(self, system: str | None) -> None:
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[list[dict[str, Any]]] = []  # [user, assistant] pairs, oldest first

    def messages(self, user_text: str) -> list[dict[str, Any]]:
        turns = [message for turn in self.turns for message in turn]
        return [*self.system, *turns, {"role": "user", "content": user_text}]

    def add(self, user_text: str, answer: Answer) -> None:
        self.turns.append([{"role": "user", "content": user_text}, answer.message()])

    def drop_oldest(self) -> bool:
        """Forget the oldest turn; False when there is none left to forget."""
        if not self.turns:
            return False
        del self.turns[0]
        return True

    def reset(self) -> None:
        self.turns.clear()


class Screen:
    """The chat's output: answers as they stream and notes, one dim line each. It tracks
    whether the cursor is at the start of a line, so that nothing (a note, the next prompt,
    the shell's prompt after exit) is glued to the end of an answer."""

    def __init__(self, out: TextIO, aside: TextIO | None = None) -> None:
        self.out = out
        self.aside = aside  # where reasoning goes when `out` is no terminal (none: dropped)
        self.at_line_start = True
        self.styled = out.isatty()
        self.thinking = False  # the last thing written was reasoning

    def write(self, text: str) -> None:
        if text:
            if self.thinking:  # the answer begins on a line of its own
                self.thinking = False
                self.end_line()
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")

    def thought(self, text: str) -> None:
        """A piece of the answer's reasoning: dim on a terminal, else on `aside` (stderr),
        so that what is piped is the answer alone."""
        if not self.styled:
            if self.aside is not None:
                self.aside.write(text)
                self.aside.flush()
            return
        self.out.write(self._dim(text))
        self.out.flush()
        self.at_line_start = text.endswith("\n")
        self.thinking = True

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")

    def note(self, text: str) -> None:
        self.end_line()
        self.write(f"{self._dim(text)}\n")

    def begin_call(self, call: ToolCall) -> None:
        """A tool call on a line of its own: its name now, its arguments as they stream."""
        self.end_line()
        self.write(f"{self._dim('[tool call]')} {call.name}(")

    def _dim(self, text: str) -> str:
        return f"\033[2m{text}\033[0m" if self.styled else text


@dataclass
class ChatOptions:
    url: str
    api_key: str | None
    request: dict[str, Any]  # max_tokens, temperature, seed
    stats: bool = False


def ask(options: ChatOptions, conversation: Conversation, user_text: str, screen: Screen) -> Answer:
    """One turn: stream the answer to `screen` and add the turn to the conversation.
    Ctrl-C (KeyboardInterrupt) stops the answer; the part already written is kept."""
    dropped = 0
    try:
        while True:
            body = {**options.request, "messages": conversation.messages(user_text)}
            try:
                stream = ChatStream(options.url, body, options.api_key)
                break
            except ChatError as exc:
                if exc.code != CONTEXT_FULL or not conversation.drop_oldest():
                    raise
                dropped += 1
    except KeyboardInterrupt:  # before the first token: nothing to keep
        screen.note("[stopped]")
        return Answer(stopped=True)
    if dropped:
        turns = "turn" if dropped == 1 else "turns"
        screen.note(f"[context full: dropped the oldest {dropped} {turns} of the conversation]")
    answer = stream.answer
    with stream:
        try:
            for piece in stream:
                if isinstance(piece, ToolCall):
                    _end_call(screen, answer.tool_calls[:-1])
                    screen.begin_call(piece)
                elif isinstance(piece, Thought):
                    screen.thought(piece)
                else:
                    screen.write(piece)
        except KeyboardInterrupt:
            answer.stopped = True
    _end_call(screen, answer.tool_calls)
    conversation.add(user_text, answer)
    screen.end_line()
    if answer.stopped:
        screen.note("[stopped]")
    elif answer.finish_reason == "length":
        max_tokens = options.request["max_tokens"]
        if answer.completion_tokens is not None and answer.completion_tokens < max_tokens:
            screen.note("[cut: the context is full]")
        else:
            screen.note(f"[cut at --max-tokens {max_tokens}]")
    if options.stats and not answer.stopped:
        screen.note(stats_line(answer.stats))
    return answer


def _end_call(screen: Screen, calls: list[ToolCall]) -> None:
    """Closes the last call shown once its arguments are whole; one stopped or cut stays
    open, as it is (the note after it says why)."""
    if calls and calls[-1].whole():
        screen.write(")")


def stats_line(stats: dict[str, Any]) -> str:
    """The answer's speed, from the daemon's `specd` figures. An answer for which no target
    pass ran (every token replayed from the prefix cache, or forced by the response
    format) has no speed to speak of: its tokens/s would be the cost of a table look-up."""
    hits = stats.get("prefix_cache_hits") or 0
    if stats.get("target_passes") == 0:
        if hits:
            return f"[replayed from the prefix cache: {hits} tokens, no target pass]"
        return "[no target pass ran for this answer]"
    tps = stats.get("tokens_per_second")
    per_pass = stats.get("tokens_per_target_pass")
    shown_tps = "-" if tps is None else f"{tps:.1f}"
    shown_pass = "-" if per_pass is None else f"{per_pass:.2f}"
    replayed = f", {hits} tokens from the prefix cache" if hits else ""
    return f"[{shown_tps} tokens/s, {shown_pass} tokens per target pass{replayed}]"


def _default_url(args: argparse.Namespace) -> str:
    """The daemon the command line names (--host, --port, --config), else the background
    one if it runs, else the configured address."""
    record = None if names_address(args) else service.DaemonRecord.read(service.default_paths())
    if record is not None and service.alive(record):
        return record.url
    settings = settings_from_args(args)
    return daemon_url(settings.server.host, settings.server.port)


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key-file's key, else the configuration's (`server.api_key_file`), as `status`
    reads it."""
    if args.api_key_file is None:
        return configured_api_key(args)
    try:
        return read_api_key(args.api_key_file)
    except (OSError, ValueError) as exc:
        raise ChatError(f"--api-key-file {args.api_key_file}: {exc}") from None


def _tools(path: str | None, choice: str | None) -> dict[str, Any]:
    """--tools FILE (the API's `tools`: a JSON list of functions) and --tool-choice as
    request fields. The daemon checks the functions themselves (a 400 naming the field)."""
    if path is None:
        if choice is not None:
            raise ChatError("--tool-choice needs --tools FILE")
        return {}
    from daemon.cli.generate import MAX_ARGUMENT_FILE_BYTES

    try:  # (a FIFO or /dev/zero named here hung, or filled the memory)
        tools = json.loads(read_small(Path(path).expanduser(), MAX_ARGUMENT_FILE_BYTES))
    except SmallFileError as exc:
        raise ChatError(f"--tools {exc}") from None
    except OSError as exc:
        raise ChatError(f"--tools {path}: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:
        said = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise ChatError(f"--tools {path} is not JSON: {said}") from None
    if not isinstance(tools, list):
        raise ChatError(f'--tools {path} must hold a JSON list: [{{"type": "function", ...}}]')
    if choice in (None, "auto", "required", "none"):
        return {"tools": tools, "tool_choice": choice or "auto"}
    return {"tools": tools, "tool_choice": {"type": "function", "function": {"name": choice}}}


@contextlib.contextmanager
def line_editing() -> Iterator[None]:
    """Editing keys and history for input(): importing readline turns them on. On a
    terminal the history is kept between chats in the state directory."""
    try:
        import readline
    except ImportError:  # no readline on this platform: plain input()
        yield
        return
    if not sys.stdin.isatty():
        yield
        return
    history = service.default_paths().state_dir / "chat_history"
    with contextlib.suppress(OSError, ValueError):
        # read as specd's other state files are: a regular file of a bounded size (a FIFO
        # there hung `specd chat`, a 3 GB file took 2.1 GB of memory)
        read_small(history, MAX_HISTORY_BYTES)
        readline.read_history_file(history)
    readline.set_history_length(1000)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history)


# The most chat history read back (1,000 lines of input are kept).
MAX_HISTORY_BYTES = 4 << 20


def cmd_chat(args: argparse.Namespace) -> int:
    screen = Screen(sys.stdout, sys.stderr)
    try:
        url = args.url or _default_url(args)
        daemon_address(url)  # a bad --url fails now, not after the first message is typed
        request: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
        if args.seed is not None:
            request["seed"] = args.seed
        if args.tree_verification is not None:
            request["tree_verification"] = args.tree_verification
        request.update(_tools(args.tools, args.tool_choice))
        options = ChatOptions(url, _api_key(args), request, args.stats)
    except ChatError as exc:  # (a flag that cannot be used: a user's mistake, as argparse's)
        print(f"specd: error: {exc}", file=sys.stderr)
        return 2
    conversation = Conversation(args.system)
    if args.once is not None:
        try:
            answer = ask(options, conversation, args.once, screen)
        except ChatError as exc:
            screen.end_line()
            print(f"specd: error: {exc}", file=sys.stderr)
            return 1
        return 130 if answer.stopped else 0
    try:
        probe(url)  # before the prompt: not after the first message is typed
    except ChatError as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 1
    print(f"specd chat at {url} ({COMMANDS})")
    with line_editing():
        return _loop(options, conversation, screen)


def _loop(options: ChatOptions, conversation: Conversation, screen: Screen) -> int:
    """The conversation, until /exit or the end of input: 0, or 1 where the last message
    got an error instead of an answer (piped input whose daemon went away)."""
    failed = False
    while True:
        try:
            line = input("> ")
        except EOFError:
            screen.at_line_start = False  # the cursor is after the prompt
            screen.end_line()
            return 1 if failed else 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            screen.at_line_start = False
            screen.note(f"[{COMMANDS}]")
            continue
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text in ("/help", "/?"):  # (it went to the model as a message)
            screen.note(f"[{COMMANDS}]")
            continue
        if text == "/reset":
            conversation.reset()
            screen.note("[conversation reset]")
            continue
        if not text:
            continue
        try:
            ask(options, conversation, line, screen)  # Ctrl-C stops the answer, not the chat
            failed = False
        except ChatError as exc:
            # The daemon refused this turn or is gone: say so, keep the conversation.
            screen.end_line()
            print(f"specd: error: {exc}", file=sys.stderr)
            failed = True


def register(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat with the running daemon (streams the answer)")
    add_address_args(chat)
    chat.add_argument("--url", default=None, help="daemon URL (default: the running one)")
    chat.add_argument("--api-key-file", default=None, help="file holding the daemon's API key")
    chat.add_argument("--once", default=None, help="send one message, print the answer, exit")
    chat.add_argument("--system", default=None, help="system prompt (kept when turns are dropped)")
    chat.add_argument(
        "--max-tokens", type=count("--max-tokens", 1), default=256, help="per answer (default 256)"
    )
    chat.add_argument(
        "--temperature", type=temperature, default=0.0, help="0 = greedy (default), up to 2"
    )
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="JSON list of functions the model may call (the API's `tools`)",
    )
    chat.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (default), required, none, or a function's name (needs --tools)",
    )
    add_tree_verification_arg(chat, default=None)
    chat.add_argument(
        "--stats", action="store_true", help="tokens/s and tokens per target pass after each answer"
    )
    chat.set_defaults(func=cmd_chat)
