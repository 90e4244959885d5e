"""`specd plan`: the memory plan for a model pair, printed before anything is loaded.

Only config.json is read, so a folder holding just that file is enough, and the budgets can
describe another machine:

    specd plan --model ./Llama-3.1-70B --gpu-budget 24GB --ram-budget 64GB \\
        --bandwidth 25GB/s --dtype bf16 --context 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from daemon.argtypes import count_or_auto, size_bytes, size_or_off
from daemon.placement import OffloadRequest, footprint, plan_request
from daemon.runtime import RuntimeOptions, pick_device
from offload.machine import detect_budget
from offload.plan import make_plan
from offload.units import parse_rate, parse_size
from speculative.checkpoint import DTYPES, open_checkpoint


def _size_or_auto(text: str) -> str:
    if text != "auto":
        try:
            parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _rate(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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
    g.add_argument("--bandwidth", type=_rate, default=None, help="host→device rate, e.g. 25GB/s")


_OFFLOAD_FIELDS = (
    "offload",
    "resident_layers",
    "slots",
    "gpu_budget",
    "ram_budget",
    "host_tier",
    "bandwidth",
)


def apply_offload_args(options: RuntimeOptions, args: argparse.Namespace) -> RuntimeOptions:
    given = {f: getattr(args, f) for f in _OFFLOAD_FIELDS if getattr(args, f, None) is not None}
    return dataclasses.replace(options, **given)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="show where the models' memory goes (nothing is loaded)")
    p.add_argument("--config", type=Path, default=None, help="a specd YAML config file")
    p.add_argument("--model", default=None, help="target folder (config.json is enough) or hub id")
    p.add_argument("--draft", default=None, help="draft folder / hub id, or 'ngram'")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    p.add_argument("--context", type=int, default=None, help="KV cache length")
    p.add_argument("--budget", type=int, default=None, help="largest tree (nodes)")
    p.add_argument(
        "--prefix-cache",
        type=size_or_off("--prefix-cache"),
        default=None,
        metavar="SIZE",
        help="cached target logits (1GiB, 0 = off)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_offload_args(p)
    p.set_defaults(func=cmd_plan)


def plan_options(args: argparse.Namespace) -> RuntimeOptions:
    """Flags over the config file over built-in defaults."""
    if args.config is not None:
        from daemon.settings import load_settings  # only needed with --config

        overrides = {"models.target": (args.model, "--model")} if args.model else None
        options = load_settings(config_file=args.config, overrides=overrides).runtime_options()
    elif args.model:
        options = RuntimeOptions(model=args.model)
    else:
        raise ValueError("specd plan needs --model MODEL or --config FILE")
    for name in ("model", "draft", "dtype", "device", "context", "budget"):
        value = getattr(args, name)
        if value is not None:
            options = dataclasses.replace(options, **{name: value})
    if args.prefix_cache is not None:
        options = dataclasses.replace(options, prefix_cache=size_bytes(args.prefix_cache))
    return apply_offload_args(options, args)


def _plan_device(options: RuntimeOptions) -> torch.device:
    """A plan may be for another machine: planning for CUDA where there is none is fine as
    long as the GPU budget is given (nothing is ever placed on the device)."""
    if options.device == "cuda" and not torch.cuda.is_available():
        if options.gpu_budget == "auto":
            raise ValueError(
                "this machine has no CUDA device to measure: to plan for a GPU elsewhere pass "
                "--gpu-budget SIZE (and --ram-budget, --bandwidth for that machine)"
            )
        return torch.device("cuda")
    return pick_device(options.device)


def cmd_plan(args: argparse.Namespace) -> int:
    options = plan_options(args)
    device = _plan_device(options)
    dtype = DTYPES[options.dtype]
    target = open_checkpoint(options.model)
    draft_fp = None
    if options.draft and options.draft != "ngram":
        draft_fp = footprint(open_checkpoint(options.draft).config, dtype, options.draft)
    context = options.context or target.config.max_context
    if context > target.config.max_context:
        raise ValueError(
            f"--context {context} is longer than {options.model} supports "
            f"({target.config.max_context})"
        )
    # Measuring this machine's bus only makes sense when planning for this machine.
    this_machine = options.gpu_budget == "auto"
    budget = detect_budget(
        device,
        options.gpu_budget,
        options.ram_budget,
        options.bandwidth,
        measure=this_machine and options.bandwidth is None,
    )
    request = plan_request(
        footprint(target.config, dtype, str(options.model)),
        draft_fp,
        context,
        OffloadRequest(
            options.offload,
            options.resident_layers,
            options.slots,
            options.host_tier,
            options.sequences,
        ),
        options.budget,
        options.prefix_cache,
    )
    plan = make_plan(request, budget)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.render())
    return 0


__all__ = ["add_offload_args", "apply_offload_args", "cmd_plan", "register"]
