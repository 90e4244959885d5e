"""A model's chat template: where a folder keeps it (`folder_chat_template`), bounded
and compiled in the sandbox (`compile_chat_template`, modeling/text/chat_template.py),
specd's fallback for a base model, and the names specd gives every render
(`TEMPLATE_NAMES`), which a request's template variables may not set."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeling.checkpoints.folder_files import read_json_object, read_text
from modeling.errors import RequestError

if TYPE_CHECKING:
    from jinja2 import Template


class ChatTemplateError(RequestError):
    """The chat template failed to render the given messages, or went past a limit of a
    render (modeling/text/chat_template.py)."""


def tokenizer_config(path: Path) -> dict[str, Any]:
    """A model folder's tokenizer_config.json ({} where there is none), or CheckpointError
    naming the file where it is no JSON object (read_json_object)."""
    file = path / "tokenizer_config.json"
    return read_json_object(file) if file.is_file() else {}


def folder_chat_template(path: Path, tc: dict[str, Any]) -> tuple[str | None, str]:
    """A model folder's chat template and where it came from: tokenizer_config.json's
    `chat_template` (a text, or named ones: the default's), else chat_template.jinja.
    ChatTemplateError naming the file and key for one of another type."""
    source = f"{path / 'tokenizer_config.json'}: chat_template"
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise ChatTemplateError(f"{source} is a list, but not of named templates")
        named = {t.get("name"): t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{source} is a {type(template).__name__}, not a template")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template, source = read_text(jinja_file), str(jinja_file)
    return template, source


# The longest chat template compiled: a 500 KB one took 13.7 s and 1.2 GB to compile, and a
# file may hold 32 MiB of them (GGUF metadata, 128 MiB).
MAX_TEMPLATE_CHARS = 128 << 10


def compile_chat_template(template: str, source: str) -> Template:
    """A model's chat template compiled (sandboxed: modeling/text/chat_template.py), or
    ChatTemplateError naming `source` (the file and key it came from; "" for specd's own)."""
    from modeling.text.chat_template import TemplateError, compile_template

    if len(template) > MAX_TEMPLATE_CHARS:  # (compiling costs ~30 ms and 2.5 MB a KB)
        whose = f"{source}, the model's chat template," if source else "the chat template"
        raise ChatTemplateError(
            f"{whose} is {len(template):,} characters; at most {MAX_TEMPLATE_CHARS:,} "
            "(real ones are under 20,000)"
        )
    try:
        return compile_template(template)
    except TemplateError as exc:
        whose = f"{source}, the model's chat template," if source else "the chat template"
        raise ChatTemplateError(f"{whose} does not compile: {exc}") from exc


# For base models without a template: a plain transcript the model can continue.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


# The names a chat template's render has from specd (`Tokenizer.render_chat`'s variables and
# the environment's globals, modeling/text/chat_template.py): a request's variables may not
# set them (tests/test_template_vars.py holds the globals to the environment's own).
TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token"}
    | {"range", "dict", "cycler", "joiner", "lipsum", "namespace", "raise_exception"}
    | {"strftime_now"}
)
