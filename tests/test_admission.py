"""Admission (daemon/admission.py): one request checked once against the runtime, for the
HTTP API, `specd generate` and `specd bench` alike. What it settles, and that each refusal
names the field at fault, in the order a client meets them. Over HTTP the same refusals
are checked in tests/test_server_errors.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.admission import Ask, admit
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.errors import RequestError
from speculative.grammar import Grammar
from speculative.sampling import SamplingParams

CONTEXT = 64
LONG_CONVERSATION = [{"role": "user", "content": "the dog ran " * 40}]


@pytest.fixture(scope="module")
def runtime(stories_target: Path) -> Runtime:
    return Runtime(RuntimeOptions(model=str(stories_target), device="cpu", context=CONTEXT))


def ask(**fields) -> Ask:  # type: ignore[no-untyped-def]
    return Ask(**{"prompt": [1, 2, 3], "messages": None, "params": SamplingParams(),
                  "max_tokens": 4, **fields})  # fmt: skip


def refusal(runtime: Runtime, asked: Ask) -> RequestError:
    with pytest.raises(RequestError) as info:
        admit(runtime, asked)
    return info.value


def test_what_admission_settles(runtime: Runtime) -> None:
    request = admit(runtime, ask(prompt="Once upon a time", max_tokens=5))
    assert request.prompt_ids == runtime.tokenizer.encode("Once upon a time")
    assert request.strategy == runtime.default_strategy == "autoregressive"
    assert request.max_tokens == 5 and request.constraint is None and request.calls is None
    # A default max_tokens is cut to the room the prompt leaves; so is one asked for, when
    # clamping; otherwise that is a refusal naming the largest that fits.
    unset = admit(runtime, ask(max_tokens=1000, max_tokens_given=False))
    assert unset.max_tokens == CONTEXT - 3
    assert admit(runtime, ask(max_tokens=1000), clamp_max_tokens=True).max_tokens == CONTEXT - 3
    error = refusal(runtime, ask(max_tokens=1000))
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    assert f"at most {CONTEXT - 3} new tokens fit" in str(error)
    grammar = Grammar.json_object("response_format")
    constrained = admit(runtime, ask(grammar=grammar))
    assert constrained.constraint is not None and constrained.constraint.grammar is grammar


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"strategy": "tree"}, "strategy", None),  # no draft here
        ({"prompt": [1, 10**6]}, "prompt", None),
        ({"prompt": []}, "prompt", None),
        ({"prompt": list(range(3, 3 + CONTEXT))}, "prompt", "context_length_exceeded"),
        ({"prompt": "the dog ran " * 40}, "prompt", "context_length_exceeded"),
        ({"prompt": None, "messages": LONG_CONVERSATION}, "messages", "context_length_exceeded"),
        # (a variable too long for any context, which the template may not even render: the
        # field named is the variables', not the messages')
        (
            {
                "prompt": None,
                "messages": [{"role": "user", "content": "Hi"}],
                "template_vars": {"unused": "A" * 10**6},
            },
            "chat_template_kwargs",
            "context_length_exceeded",
        ),
        ({"params": SamplingParams(logit_bias=((10**6, 1.0),))}, "logit_bias", None),
        ({"budget": 10**6}, "budget", "budget_too_large"),
    ],
)
def test_each_refusal_names_its_field(
    runtime: Runtime, fields: dict, param: str, code: str | None
) -> None:
    error = refusal(runtime, ask(**fields))
    assert (error.param, error.code) == (param, code), str(error)


def test_the_first_fault_is_the_one_reported(runtime: Runtime) -> None:
    """The order a client meets: strategy, prompt, max_tokens, logit_bias, grammar, budget."""
    faults = [
        ("strategy", {"strategy": "tree"}),
        ("prompt", {"prompt": list(range(3, 3 + CONTEXT))}),
        ("max_tokens", {"max_tokens": 10**4}),
        ("logit_bias", {"params": SamplingParams(logit_bias=((10**6, 1.0),))}),
        ("budget", {"budget": 10**6}),
    ]
    for i, (param, _) in enumerate(faults):
        at_fault = {name: value for _, bad in faults[i:] for name, value in bad.items()}
        assert refusal(runtime, ask(**at_fault)).param == param


def test_a_budget_past_the_plan_says_which_bound_and_why(runtime: Runtime) -> None:
    """Any budget past the plan's largest tree is `budget_too_large`, naming that tree and
    where it comes from (auto's largest here); the wire format checks only that it is a
    positive integer, so 257 and 100,000 get the same answer."""
    from daemon.http.openai_errors import ApiError
    from daemon.http.openai_fields import WireLimits, generation_fields

    limits = WireLimits(default_max_tokens=8, max_tokens=8)
    for budget in (runtime.max_tree_budget + 1, 100_000, 10**30):
        fields = generation_fields({"prompt": "hi", "budget": budget}, limits, chat=False)
        error = refusal(runtime, ask(budget=fields["budget"]))
        assert (error.param, error.code) == ("budget", "budget_too_large")
        assert f"({runtime.max_tree_budget} nodes: auto's largest tree" in str(error)
    for bad in (0, -3, 2.5, "64", True):
        with pytest.raises(ApiError, match="budget must be a positive integer") as info:
            generation_fields({"prompt": "hi", "budget": bad}, limits, chat=False)
        assert info.value.param == "budget"


def test_a_tokenizer_that_panics_is_a_400_naming_the_text(
    stories_target: Path, tmp_path: Path
) -> None:
    """A tokenizer.json whose pre-tokenizer regex backtracks past the engine's limit makes
    the `tokenizers` library panic: a BaseException that `except Exception` let through,
    closing the connection with no answer. It is the text's field that is refused."""
    import json
    import shutil

    folder = tmp_path / "redos"
    shutil.copytree(stories_target, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a|a)+$|(a+)+b"}, "behavior": "Isolated",
             "invert": False}  # fmt: skip
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, spec["pre_tokenizer"]]}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    rt = Runtime(RuntimeOptions(model=str(folder), device="cpu", context=CONTEXT))
    text = "a" * 30 + "c"
    for fields, param in [
        ({"prompt": text}, "prompt"),
        ({"prompt": None, "messages": [{"role": "user", "content": text}]}, "messages"),
    ]:
        error = refusal(rt, ask(**fields))
        assert error.param == param
        assert str(error).startswith("the model's tokenizer could not tokenize this text (")
    assert admit(rt, ask(prompt="Once upon a time")).prompt_ids  # other text still serves
