"""`specd plan`: the memory plan for a model pair, printed before anything is loaded.

Only config.json is read, so a folder holding just that file is enough, and the budgets can
describe another machine:

    specd plan --model ./Llama-3.1-70B --draft ./Llama-3.2-1B --gpu-budget 24GB \\
        --ram-budget 160GB --bandwidth 25GB/s            # dtype and context auto

A GPU budget given on a machine without CUDA plans for that GPU machine: CUDA, and `auto`
picks the checkpoint's dtype there, not this machine's CPU choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.cli.argtypes import (
    DRAFT_HELP,
    MODEL_HELP,
    QUANTIZE_GROUP,
    count,
    count_or_auto,
    size_or_off,
)
from daemon.options import RuntimeOptions
from daemon.settings import (
    COMPILE_CHOICES,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    QUANTIZE_CHOICES,
    SUBSTITUTE_BITS_CHOICES,
    Settings,
    no_draft,
)
from daemon.settings_checks import size_bytes
from modeling.errors import RequestError
from offload.units import parse_rate, parse_size

if TYPE_CHECKING:  # torch: only `specd plan` itself needs it
    import torch

    from modeling.checkpoints.checkpoint import ModelNotFoundError


def _size_or_auto(text: str) -> str:
    if text != "auto":
        try:
            parse_size(text, "")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _rate(text: str) -> str:
    try:
        parse_rate(text, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_context_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    """--context, for `generate`, `plan` and the daemon commands (16.. as the config key)."""
    p.add_argument(
        "--context",
        type=count_or_auto("--context", 16),
        default=default,
        help="KV cache length in tokens, or auto: the longest up to the model's that fits "
        "(at least 4096)",
    )


def add_quantize_args(p: argparse.ArgumentParser, default: str | None) -> None:
    """--quantize, --draft-quantize and --substitute-bits, for `generate`, `plan` and the
    daemon commands."""
    for flag, whose in (("--quantize", "target"), ("--draft-quantize", "draft")):
        p.add_argument(
            flag,
            choices=QUANTIZE_CHOICES,
            default=default,
            help=f"quantize the {whose}'s full-precision projections as they load (groups of "
            f"{QUANTIZE_GROUP} inputs, symmetric; packed in RAM, on the bus and in the slots)",
        )
    p.add_argument(
        "--substitute-bits",
        type=substitute_bits,
        default=default,
        metavar="auto|8|4|3|2",
        help="--draft substitute: bits of the target's own HQQ-quantized layers that draft "
        "for it (auto: the most that fit)",
    )


def substitute_bits(text: str) -> int | str:
    """auto, or one of the bits the substitute draft is built with."""
    if text == "auto":
        return text
    if text.isdigit() and int(text) in SUBSTITUTE_BITS_CHOICES:
        return int(text)
    raise argparse.ArgumentTypeError(f"--substitute-bits must be auto, 8, 4, 3 or 2, not {text!r}")


def add_prefix_cache_arg(p: argparse.ArgumentParser) -> None:
    """--prefix-cache, for `generate`, `plan` and the daemon commands."""
    p.add_argument(
        "--prefix-cache",
        type=size_or_off("--prefix-cache"),
        default=None,
        metavar="SIZE",
        help="tree: host memory for cached target logits, e.g. 1GiB, or 0 (off); "
        "default speculation.prefix_cache (1GiB)",
    )


def add_offload_args(p: argparse.ArgumentParser) -> None:
    """Offload flags shared by `generate` and `plan` (defaults None: 'not given', so a
    config file's values survive; RuntimeOptions holds the real defaults)."""
    g = p.add_argument_group("offload")
    g.add_argument("--offload", choices=("none", "stream", "auto"), default=None)
    g.add_argument(
        "--resident-layers",
        type=count_or_auto("--resident-layers", 0),
        default=None,
        help="N or auto",
    )
    g.add_argument("--slots", type=int, default=None, help="streaming slots on the device (>= 2)")
    g.add_argument("--gpu-budget", type=_size_or_auto, default=None, help="24GB, 512MiB or auto")
    g.add_argument("--ram-budget", type=_size_or_auto, default=None, help="64GB or auto")
    g.add_argument("--host-tier", choices=("ram", "disk", "auto"), default=None)
    g.add_argument(
        "--experts",
        choices=("auto", "device", "stream", "cpu"),
        default=None,
        help="a mixture of experts' routed experts: with their layers (device), in RAM "
        "copied to a device cache as routed (stream), in RAM computed on the CPU (cpu), or "
        "auto (device where everything fits; else on a GPU, per layer: the layers whose "
        "experts fit keep them, the rest stream or compute on the CPU, as the measured "
        "rates say)",
    )
    g.add_argument(
        "--expert-slots",
        type=count("--expert-slots", 1),
        default=None,
        help="--experts stream: the most experts the device cache holds (default: all that fit)",
    )
    g.add_argument("--bandwidth", type=_rate, default=None, help="host→device rate, e.g. 25GB/s")
    g.add_argument(
        "--cpu-rate",
        type=_rate,
        default=None,
        help="the rate the CPU reads weights multiplying a token, e.g. 40GB/s: what experts "
        "computed there cost under --experts auto (default: measured on a GPU machine)",
    )


_OFFLOAD_FIELDS = (
    "offload",
    "resident_layers",
    "slots",
    "gpu_budget",
    "ram_budget",
    "host_tier",
    "experts",
    "expert_slots",
    "bandwidth",
    "cpu_rate",
)


def apply_offload_args(options: RuntimeOptions, args: argparse.Namespace) -> RuntimeOptions:
    """The offload flags and --prefix-cache that were given, over `options`."""
    given = {f: getattr(args, f) for f in _OFFLOAD_FIELDS if getattr(args, f, None) is not None}
    if getattr(args, "prefix_cache", None) is not None:
        given["prefix_cache"] = size_bytes(args.prefix_cache)
    return dataclasses.replace(options, **given)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="show where the models' memory goes (nothing is loaded)")
    p.add_argument("--config", type=Path, default=None, help="a specd YAML config file")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (a folder needs only config.json)")
    p.add_argument("--draft", default=None, help=DRAFT_HELP)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="default auto")
    add_quantize_args(p, default=None)
    p.add_argument("--device", choices=DEVICE_CHOICES, default=None)
    add_context_arg(p, default=None)
    p.add_argument(
        "--budget",
        type=count_or_auto("--budget", 1),
        default=None,
        help="tree node budget or auto (the plan holds the largest tree)",
    )
    add_prefix_cache_arg(p)
    p.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default=None,
        help="plan for compiled passes: on a GPU, `on` captures CUDA graphs (their memory)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_offload_args(p)
    p.set_defaults(func=cmd_plan)


def plan_options(args: argparse.Namespace) -> tuple[Settings, RuntimeOptions]:
    """Flags over the settings a daemon would start with (`--config FILE`, else the user
    config file; `SPECD_*` variables; built-in defaults): the plan of what `specd start`
    with the same flags runs. The settings too, which say where each value came from."""
    from daemon.settings_loading import load_settings

    overrides = {"models.target": (args.model, "--model")} if args.model else None
    settings = load_settings(config_file=args.config, overrides=overrides)
    if not settings.models.target:
        raise RequestError(
            "specd plan needs --model MODEL (or models.target in the config file, --config FILE)"
        )
    options = settings.runtime_options()
    for name in (
        "model",
        "draft",
        "dtype",
        "quantize",
        "draft_quantize",
        "substitute_bits",
        "device",
        "context",
        "budget",
        "compile",
    ):
        value = getattr(args, name)
        if value is not None:
            if name == "draft":
                value = no_draft(value)
            options = dataclasses.replace(options, **{name: value})
    return settings, apply_offload_args(options, args)


def blame_config_file(
    exc: ModelNotFoundError, settings: Settings, key: str, ref: str | None
) -> ModelNotFoundError:
    """`exc` (the model at `ref` not found), saying so where `ref` is a relative path the
    configuration file gave as `key`: which file, and the folder it was taken from."""
    from modeling.checkpoints.checkpoint import ModelNotFoundError, on_this_machine

    source = settings.sources.get(key, "")
    given = settings.models.target if key == "models.target" else settings.models.draft
    if ref is None or ref != given or not source.startswith("file "):
        return exc
    if Path(ref).expanduser().is_absolute() or not on_this_machine(ref):
        return exc
    return ModelNotFoundError(
        f"{exc} ({key} in {source.removeprefix('file ')}: a relative path is taken from the "
        f"folder specd runs in, {Path.cwd()}; write it whole)"
    )


def _plan_device(options: RuntimeOptions) -> torch.device:
    """A plan may be for another machine: planning for CUDA where there is none is fine as
    long as the GPU budget is given (nothing is ever placed on the device)."""
    import torch

    from daemon.runtime import pick_device

    if options.device == "cuda" and not torch.cuda.is_available():
        if options.gpu_budget == "auto":
            raise RequestError(
                "this machine has no CUDA device to measure: to plan for a GPU elsewhere pass "
                "--gpu-budget SIZE (and --ram-budget, --bandwidth for that machine)"
            )
        return torch.device("cuda")
    return pick_device(options.device)


def cmd_plan(args: argparse.Namespace) -> int:
    from daemon.draft_choice import AUTO, resolve_auto
    from daemon.pair_plan import plan_pair
    from modeling.checkpoints.checkpoint import (
        ModelNotFoundError,
        NotCachedError,
        has_tokenizer,
        load_tokenizer,
        open_checkpoint,
    )
    from offload.machine import detect_budget

    settings, options = plan_options(args)
    device = _plan_device(options)
    # A plan needs config.json only: a hub id's weights need not be downloaded yet. Each
    # model is checked as loading checks it (its chat template, a GGUF file's tensor
    # infos), and its tokenizer, where at hand, is built as loading builds it (a merge
    # outside the vocabulary), so that a plan refuses what a run would (0.3 s for SmolLM2's
    # 49k tokens). Every model missing from the cache is named at once.
    key, ref = "models.target", options.model
    try:
        target = open_checkpoint(ref, options.quantize, config_only=True)
        tokenizer = load_tokenizer(target) if has_tokenizer(target) else None
        draft = None
        if options.draft and options.draft not in ("ngram", "substitute", AUTO):
            key, ref = "models.draft", options.draft
            opened = open_checkpoint(ref, options.draft_quantize, config_only=True)
            if has_tokenizer(opened):
                load_tokenizer(opened)
            draft = opened.config
    except NotCachedError as exc:
        raise exc.naming_also([options.model, options.draft]) from None
    except ModelNotFoundError as exc:
        raise blame_config_file(exc, settings, key, str(ref)) from None
    # Measuring this machine's bus only makes sense when planning for this machine.
    this_machine = options.gpu_budget == "auto"
    budget = detect_budget(
        device,
        options.gpu_budget,
        options.ram_budget,
        options.bandwidth,
        measure=this_machine and options.bandwidth is None,
        cpu_rate=options.cpu_rate,
    )
    # budget.device is the machine planned for: "cuda" when a GPU budget describes another
    # machine's card, so `auto` picks that machine's dtype.
    reason = None
    if options.draft == AUTO:  # what a run would choose; its tokenizer is needed for that
        choice = resolve_auto(options, target, budget, budget.device, tokenizer)
        options, reason = dataclasses.replace(options, draft=choice.draft), choice.reason
        if choice.draft not in ("ngram", "substitute"):
            draft = open_checkpoint(choice.draft, options.draft_quantize, config_only=True).config
    plan, _ = plan_pair(options, target, draft, budget, budget.device, str(options.model))
    if reason is not None:
        plan.notes.insert(0, reason)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        from daemon.cli.models import (
            printable,
        )  # (a path is anyone's: escapes for control characters)

        print("\n".join(printable(line) for line in plan.render().split("\n")))
    return 0


__all__ = ["add_offload_args", "apply_offload_args", "cmd_plan", "register"]
