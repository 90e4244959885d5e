"""Tokenizer policy: BOS as the tokenizer config says, EOS lists, sandboxed chat templates,
and the fallback template for base models."""

from __future__ import annotations

import json
import shutil
from itertools import pairwise
from pathlib import Path

import pytest

from modeling.checkpoints.checkpoint import open_checkpoint
from modeling.text.model_template import FALLBACK_CHAT_TEMPLATE, ChatTemplateError
from modeling.text.tokenizer import Tokenizer

TEXTS = ["Once upon a time", "  two  spaces", "café 😀 naïve", "line\nbreak", ""]


def _tokenizer(folder: Path) -> Tokenizer:
    ckpt = open_checkpoint(folder)
    return Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)


def _with_tokenizer_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return dst


def test_stories_encoding_matches_transformers(stories_target: Path) -> None:
    from transformers import AutoTokenizer

    ours = _tokenizer(stories_target)
    ref = AutoTokenizer.from_pretrained(stories_target)
    assert ours.bos_id == 1 and ours.add_bos is True
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == 1
        assert ours.encode(text, add_special_tokens=False) == ids[1:]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_a_piece_reads_as_it_does_after_the_token_before_it(stories_target: Path) -> None:
    """`Tokenizer.piece`, what log-probabilities and traces name a token: decoded alone a
    SentencePiece word loses its leading space; after the token before it, it keeps it, and
    the pieces of a text after its BOS spell the text. Special tokens are spelled out."""
    tok = _tokenizer(stories_target)
    ids = tok.encode("Once upon a time")
    assert [tok.decode([i]) for i in ids[1:]] == ["Once", "upon", "a", "time"]
    pieces = [tok.piece(token, after) for after, token in pairwise(ids)]
    assert pieces == [" Once", " upon", " a", " time"]
    assert tok.piece(ids[0]) == "<s>" and tok.piece(ids[1], ids[0]) == " Once"


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_bos_policy(tiny_checkpoint, tmp_path: Path, add_bos: bool | None) -> None:
    """add_bos_token true/false decides; absent, tokenizer.json's post-processor does
    (the tiny tokenizer's prepends <s>)."""
    folder = _with_tokenizer_config(tiny_checkpoint("llama"), tmp_path / "t", add_bos_token=add_bos)
    tok = _tokenizer(folder)
    plain = tok.encode("Once upon a time", add_special_tokens=False)
    assert plain and plain[0] != tok.bos_id
    with_specials = tok.encode("Once upon a time")
    if add_bos is False:
        assert with_specials == plain
    else:
        assert with_specials == [1, *plain]
    # BOS is never doubled when the text already starts with it.
    if add_bos:
        assert tok.encode("<s>Once upon a time") == [1, *plain]


def test_bos_from_model_config_when_tokenizer_config_has_none(tiny_checkpoint, tmp_path: Path):
    folder = _with_tokenizer_config(
        tiny_checkpoint("llama"), tmp_path / "t", bos_token=None, add_bos_token=True
    )
    tok = _tokenizer(folder)
    assert tok.bos_token == "<s>" and tok.bos_id == 1
    assert tok.encode("one")[0] == 1


def test_eos_may_be_a_list(tiny_checkpoint, tmp_path: Path) -> None:
    folder = tmp_path / "t"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    tok = _tokenizer(folder)
    assert set(tok.eos_token_ids) == {2, 7, 9}
    assert len(tok.eos_token_ids) == 3  # deduplicated: 2 is also config.json's and </s>


def test_chat_template_from_tokenizer_config(tiny_checkpoint, tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    folder = _with_tokenizer_config(
        tiny_checkpoint("llama"), tmp_path / "t", chat_template=template
    )
    tok = _tokenizer(folder)
    assert tok.has_chat_template
    messages = [{"role": "user", "content": "hi"}]
    text = tok.render_chat(messages)
    assert text == "<s><|user|>hi</s><|assistant|>"
    # The template writes BOS itself: encode_chat must not add a second one.
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids[1] != 1


def test_named_templates_use_the_default(tiny_checkpoint, tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT{{ messages | length }}"},
    ]
    folder = _with_tokenizer_config(tiny_checkpoint("llama"), tmp_path / "t", chat_template=named)
    assert _tokenizer(folder).render_chat([{"role": "user", "content": "x"}]) == "DEFAULT1"


def test_chat_template_jinja_file(tiny_checkpoint, tmp_path: Path) -> None:
    folder = tmp_path / "t"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    assert _tokenizer(folder).render_chat([{"role": "user", "content": "é"}]) == '"é"'


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages.__class__.__init__.__globals__['os'] }}",
        "{% set x = messages.append({'role': 'x'}) %}",
    ],
)
def test_malicious_template_is_refused(template: str) -> None:
    tok = _stub_tokenizer(template)
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_template_can_raise_a_clear_error() -> None:
    tok = _stub_tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def _stub_tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    backend = HFTokenizer(models.WordLevel(vocab={"<unk>": 0, "<s>": 1}, unk_token="<unk>"))
    return Tokenizer(backend, bos_token="<s>", chat_template=template)


def test_fallback_template_for_base_models(stories_target: Path) -> None:
    tok = _tokenizer(stories_target)
    assert not tok.has_chat_template
    messages = [
        {"role": "system", "content": "Tell a story."},
        {"role": "user", "content": "A cat"},
    ]
    text = tok.render_chat(messages)
    assert text == "Tell a story.\n\nUser: A cat\nAssistant:"
    assert tok.chat_template is None and FALLBACK_CHAT_TEMPLATE
    # A base model's prompt starts with BOS, as plain text encoding does.
    assert tok.encode_chat(messages) == tok.encode(text)
    assert tok.encode_chat(messages)[0] == 1


def test_missing_tokenizer_json_is_a_clear_error(tiny_checkpoint, tmp_path: Path) -> None:
    folder = tmp_path / "t"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        _tokenizer(folder)


def test_typical_template_features_still_work() -> None:
    """Refusing underscored attributes must not break what real templates use: methods on
    strings, attribute-style dict access, namespace, loop variables, tojson."""
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.first %}[{{ m.role | upper }}]{% endif %}{{ m['content'].strip() }}|"
        "{% endfor %}{{ ns.n }}{{ {'k': 1} | tojson }}"
    )
    tok = _stub_tokenizer(template)
    messages = [{"role": "user", "content": " a "}, {"role": "assistant", "content": "b"}]
    assert tok.render_chat(messages) == '[USER]a|b|2{"k": 1}'


# Constructs real Hub templates use that transformers' renderer supports (its environment:
# loopcontrols, the {% generation %} block, tools/documents passed as None, full tojson).
HUB_TEMPLATE_FEATURES = [
    # loop controls: {% break %} / {% continue %}
    (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}",
        "a",
    ),
    # assistant-mask training templates wrap the reply in {% generation %}
    (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
        "sabc",
    ),
    # tools is None when the request has none (not undefined: `is not none` must be False)
    ("{% if tools is not none %}TOOLS{% endif %}{% if documents is none %}ok{% endif %}", "ok"),
    # tojson with the keyword arguments transformers exposes
    ("{{ {'b': 1, 'a': [1, 2]} | tojson(separators=(',', ':'), sort_keys=true) }}",
     '{"a":[1,2],"b":1}'),
]  # fmt: skip


@pytest.mark.parametrize(("template", "expected"), HUB_TEMPLATE_FEATURES)
def test_hub_template_features_render_as_transformers_does(template: str, expected: str) -> None:
    tok = _stub_tokenizer(template)
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert tok.render_chat(messages) == expected
    # The same answer as the reference renderer (a test-only dependency).
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=True
    )
    assert rendered[0] == expected


def test_template_that_does_not_compile_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _stub_tokenizer("{% for m in messages %}{{ m.content }}")


def test_a_text_far_past_the_limit_is_refused_from_its_start(stories_target: Path) -> None:
    """`at_most`: a megabyte of digits (a token each) took 3.3 s to tokenize before being
    refused for the context. A text longer than PROBE_CHARS characters per token allowed
    has its start counted first; past the limit, the rest is never tokenized."""
    from modeling.text.tokenizer import PROBE_CHARS, TextTooLong

    tok = _tokenizer(stories_target)
    seen: list[int] = []
    real = tok.backend

    class Spy:  # the tokenizers library's object, each text's length noted
        def encode_batch(self, texts: list[str], **kwargs: object) -> object:
            seen.extend(len(t) for t in texts)
            return real.encode_batch(texts, **kwargs)

    tok.backend = Spy()  # type: ignore[assignment]
    with pytest.raises(TextTooLong) as caught:
        tok.encode("7" * 1_000_000, at_most=500)
    assert caught.value.tokens > 500 and seen == [PROBE_CHARS * 500]
    # Within the limit (or no limit), the ids are the whole text's, as before.
    text = "Once upon a time there was a cat. " * 200
    tok.backend = real
    whole = tok.encode(text)
    assert tok.encode(text, at_most=len(whole)) == whole
    with pytest.raises(TextTooLong):
        tok.encode(text, at_most=len(whole) // 4)


def test_a_files_padding_and_truncation_are_not_applied(
    stories_target: Path, tmp_path: Path
) -> None:
    """tokenizer.json's `padding` and `truncation` are a training pipeline's: padding to a
    fixed 20,000,000 cost every prompt 16 s and 2.4 GB; truncation cut prompts silently."""
    folder = tmp_path / "model"
    shutil.copytree(stories_target, folder)
    for file in [folder, *folder.iterdir()]:
        file.chmod(0o755 if file.is_dir() else 0o644)
    plain = _tokenizer(folder).encode("Once upon a time there was a cat")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                      "pad_id": 0, "pad_type_id": 0, "pad_token": "<unk>"}  # fmt: skip
    tok["truncation"] = {
        "direction": "Right",
        "max_length": 2,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    assert _tokenizer(folder).encode("Once upon a time there was a cat") == plain
    assert len(plain) > 2
