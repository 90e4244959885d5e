"""The readers of config.json's shared keys, each value checked as it is read (a hostile or
broken file is one line naming the file and the key, never a traceback or quietly wrong
logits): typed getters (`integer`, `number`, `dtype_name`), the attention widths, token
ids, RoPE parameters (`rope_config`, range-checked), routed experts and layer types. The
architecture modules (modeling/models/) read their configs through them into the records
of modeling/config.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from modeling.config import (
    SUPPORTED_ROPE_TYPES,
    RopeConfig,
    UnsupportedModelError,
)
from modeling.weights.quant import short


def _given(raw: dict[str, Any], key: str, source: str, required: bool, label: str) -> Any:
    """raw[key], None where it is absent or null (as transformers' configs write an unset
    key); an error naming `label` where it is `required`."""
    value = raw.get(key)
    if value is None and required:
        raise UnsupportedModelError(f"{source}: required key {label!r} is missing or null")
    return value


def integer(
    raw: dict[str, Any],
    key: str,
    source: str,
    default: int | None = None,
    minimum: int = 1,
    label: str | None = None,
) -> int:
    """config.json's `key` (`label` in messages: a nested block's key), a whole number of at
    least `minimum` (4096.0 is 4096; a bool, a string or 4096.5 is refused); `default` where
    it is absent or null, required where there is none."""
    label = label or key
    value = _given(raw, key, source, default is None, label)
    if value is None:
        return default  # type: ignore[return-value]  # (not None: _given checked)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UnsupportedModelError(
            f"{source}: {label} is {short(value)}; it must be a whole number of at least "
            f"{minimum}: fix the file or download the model again"
        )
    return value


def number(
    raw: dict[str, Any],
    key: str,
    source: str,
    default: float | None = None,
    label: str | None = None,
) -> float:
    """config.json's `key` (`label` in messages) as a finite float (a bool or a string is
    refused); `default` where it is absent or null, required where there is none. Its range
    is the reader's to check."""
    label = label or key
    value = _given(raw, key, source, default is None, label)
    if value is None:
        return default  # type: ignore[return-value]  # (not None: _given checked)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UnsupportedModelError(
            f"{source}: {label} is {short(value)}; it must be a finite number: fix the file or "
            "download the model again"
        )
    return float(value)


def flag(
    raw: dict[str, Any], key: str, source: str, default: bool, label: str | None = None
) -> bool:
    """config.json's `key` (`label` in messages) as true or false; `default` where it is
    absent or null. The text "false" is refused, not read as true."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UnsupportedModelError(
            f"{source}: {label or key} is {short(value)}; it must be true or false: fix the "
            "file or download the model again"
        )
    return value


def dtype_name(raw: dict[str, Any], source: str) -> str | None:
    """config.json's `torch_dtype` (or `dtype`, newer exports'): None, "auto" or the name of
    a torch dtype ("bfloat16", "torch.float16"); anything else is refused, as transformers
    refuses it. Which names specd computes in is the loader's (`dtype_key`: another is
    taken as no dtype, fp32)."""
    key = "torch_dtype" if raw.get("torch_dtype") is not None else "dtype"
    name = raw.get(key)
    if name is None or name == "auto":
        return name
    if not isinstance(name, str) or not isinstance(
        getattr(torch, name.removeprefix("torch."), None), torch.dtype
    ):
        raise UnsupportedModelError(
            f"{source}: {key} {short(name)} is not a torch dtype (such as 'bfloat16'): fix "
            "the file or download the model again"
        )
    return name


def attention_widths(raw: dict[str, Any], source: str) -> tuple[int, int, int, int]:
    """config.json's hidden size, attention heads, key/value heads and head dimension,
    the heads a positive multiple of the key/value heads."""
    hidden = integer(raw, "hidden_size", source)
    heads = integer(raw, "num_attention_heads", source)
    kv_heads = integer(raw, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}"
        )
    if raw.get("head_dim") is None and hidden < heads:
        raise UnsupportedModelError(
            f"{source}: hidden_size {hidden} is less than num_attention_heads {heads}, and "
            "there is no head_dim: fix the file or download the model again"
        )
    return hidden, heads, kv_heads, integer(raw, "head_dim", source, default=hidden // heads)


def bos_id(raw: dict[str, Any], source: str) -> int | None:
    """config.json's `bos_token_id`: a token id, or None."""
    present = raw.get("bos_token_id") is not None
    return integer(raw, "bos_token_id", source, minimum=0) if present else None


def eos_ids(raw: dict[str, Any], source: str) -> tuple[int, ...]:
    """config.json's `eos_token_id`: one token id, a list of them, or none."""
    eos = raw.get("eos_token_id")
    given = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if len(given) > 1024:  # (a hostile file's list may hold millions)
        raise UnsupportedModelError(f"{source}: eos_token_id lists {len(given):,} ids")
    return tuple(
        integer({"eos_token_id": i}, "eos_token_id", source, minimum=0, label="eos_token_id")
        for i in given
    )


def _rope_block(raw: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    """config.json's `rope_scaling` or `rope_parameters`: an object, or {} where null."""
    block = raw.get(key)
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise UnsupportedModelError(
            f"{source}: {key} is {short(block)}; it must be an object of RoPE parameters or "
            "null: fix the file or download the model again"
        )
    return block


def rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters. When a
    # config carries both, transformers lets a non-empty rope_scaling win outright (its
    # `convert_rope_params_to_dict`), so the logits we must match come from that one.
    parameters = _rope_block(raw, "rope_parameters", source)
    scaling = _rope_block(raw, "rope_scaling", source)
    params = scaling or parameters
    block = "rope_scaling" if scaling else "rope_parameters"
    # Precedence: the chosen block, the top level, rope_parameters, 10000. Each step's
    # default is a float, not Any (an Any default reads as dict.get's Optional overload).
    theta: float = parameters.get("rope_theta", 10000.0)
    theta = raw.get("rope_theta", theta)
    given = params.get("rope_theta", theta)
    try:
        theta = float(given)
    except (TypeError, ValueError):
        theta = math.nan
    # Below 1 the frequencies 1 / theta^(2i/d) grow past 1 and, far enough below (1e-300),
    # past float32: inf, then NaN in every logit. No model uses a base below 1 (10,000 to
    # 1,000,000 and more).
    if not math.isfinite(theta) or theta < 1:
        raise UnsupportedModelError(
            f"{source}: rope_theta {str(given)[:40]!r} is not a number of at least 1"
        )
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {short(kind)} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )

    def value(key: str, default: float) -> float:
        """The block's `key`, a finite number (its range is `_checked_rope`'s)."""
        return number(params, key, source, default, label=f"{block}.{key}")

    def optional(key: str) -> float | None:
        return None if params.get(key) is None else value(key, 0.0)

    # original_max_position_embeddings: the block's, else the top level's (Phi-3's)
    key = "original_max_position_embeddings"
    where, label = (params, f"{block}.{key}") if params.get(key) is not None else (raw, key)
    original = integer(where, key, source, label=label) if where.get(key) is not None else None
    factor = optional("factor")
    if kind in ("yarn", "longrope") and factor is None:
        if original is None:
            raise UnsupportedModelError(
                f"{source}: {kind} RoPE scaling needs factor or original_max_position_embeddings"
            )
        factor = integer(raw, "max_position_embeddings", source, original) / original
    if original is None:
        original = integer(raw, "max_position_embeddings", source, 8192)
    if params.get("partial_rotary_factor") is not None:
        partial = value("partial_rotary_factor", 1.0)
    else:
        partial = number(raw, "partial_rotary_factor", source, 1.0)
    rope = RopeConfig(
        theta=theta,
        kind=kind,
        factor=1.0 if factor is None else factor,
        low_freq_factor=value("low_freq_factor", 1.0),
        high_freq_factor=value("high_freq_factor", 4.0),
        original_max_position_embeddings=original,
        beta_fast=value("beta_fast", 32.0) or 32.0,  # (0: the default, as transformers reads it)
        beta_slow=value("beta_slow", 1.0) or 1.0,
        truncate=flag(params, "truncate", source, True, label=f"{block}.truncate"),
        attention_factor=optional("attention_factor"),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        partial_rotary_factor=partial,
        short_factor=_factors(params, "short_factor", kind, source),
        long_factor=_factors(params, "long_factor", kind, source),
    )
    return _checked_rope(rope, params, block, source)


def _checked_rope(rope: RopeConfig, params: dict[str, Any], block: str, source: str) -> RopeConfig:
    """`rope`, or an UnsupportedModelError naming the first parameter that would make its
    frequencies or its factor on cos and sin zero, infinite or NaN (each is finite here)."""
    wanted: list[tuple[str, bool, str]] = [
        ("partial_rotary_factor", 0 < rope.partial_rotary_factor <= 1, "above 0 and at most 1"),
    ]
    if rope.kind != "default":  # frequencies / factor: 5e-324 made them inf
        wanted.append(("factor", 1e-3 <= rope.factor <= 1e6, "from 0.001 to 1,000,000"))
    if rope.kind == "llama3":  # divides by each frequency factor and by their difference
        low = rope.low_freq_factor
        wanted += [
            ("low_freq_factor", low > 0, "above 0"),
            ("high_freq_factor", rope.high_freq_factor > low, f"above low_freq_factor {low}"),
        ]
    if rope.kind == "yarn":  # divides by the logarithms of theta and of the betas' ratios
        wanted += [
            ("rope_theta", rope.theta > 1, "above 1 for YaRN"),
            ("beta_fast", rope.beta_fast > 0, "above 0"),
            ("beta_slow", rope.beta_slow > 0, "above 0"),
        ]
    if rope.kind == "longrope":  # its default factor on cos and sin divides by log(original)
        original = rope.original_max_position_embeddings
        wanted.append(("original_max_position_embeddings", original >= 2, "at least 2"))
    if rope.kind in ("yarn", "longrope"):
        # (On cos and sin: 1e30 made every logit NaN, an mscale of 1e30 attention uniform.)
        given = rope.attention_factor, rope.mscale, rope.mscale_all_dim
        wanted += [
            ("attention_factor", given[0] is None or 0 < given[0] <= 100, "above 0, at most 100"),
            ("mscale", given[1] is None or 0 <= given[1] <= 100, "from 0 to 100"),
            ("mscale_all_dim", given[2] is None or 0 <= given[2] <= 100, "from 0 to 100"),
        ]
    for key, ok, rule in wanted:
        if not ok:
            label = f"{block}.{key}" if key in params else key
            raise UnsupportedModelError(
                f"{source}: {label} is {short(getattr(rope, key.removeprefix('rope_')))}; it "
                f"must be {rule}: fix the file or download the model again"
            )
    return rope


def _factors(params: dict[str, Any], key: str, kind: str, source: str) -> tuple[float, ...]:
    """LongRoPE's `short_factor` / `long_factor`: finite positive numbers (their count is
    checked against the rotary dimensions by the architecture that turns them)."""
    if kind != "longrope":
        return ()
    values = params.get(key)
    if not isinstance(values, list) or not values or len(values) > 4096:
        raise UnsupportedModelError(f"{source}: longrope RoPE scaling needs a list {key}")
    try:
        factors = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise UnsupportedModelError(f"{source}: {key} holds a value that is no number") from None
    if not all(0 < f < float("inf") for f in factors):
        raise UnsupportedModelError(f"{source}: {key} holds a factor that is not above 0")
    return factors


def whole_head_rope(raw: dict[str, Any], source: str, model_type: str) -> RopeConfig:
    """`rope_config`, refusing what a module that turns the whole head does not compute
    (LongRoPE, partial rotary)."""
    rope = rope_config(raw, source)
    if rope.kind == "longrope" or rope.partial_rotary_factor != 1.0:
        raise UnsupportedModelError(
            f"{source}: rope {rope.kind} with partial_rotary_factor "
            f"{rope.partial_rotary_factor} is not supported for {model_type}"
        )
    return rope


def routed_experts(raw: dict[str, Any], source: str, key: str) -> tuple[int, int]:
    """(experts, experts per token): `key` and `num_experts_per_tok`, 1 <= k <= experts."""
    experts = integer(raw, key, source)
    top_k = integer(raw, "num_experts_per_tok", source)
    if not 1 <= top_k <= experts:
        raise UnsupportedModelError(
            f"{source}: num_experts_per_tok {top_k} must be 1 to {key} {experts}"
        )
    return experts, top_k


LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names


def given_layer_types(raw: dict[str, Any], layers: int, source: str) -> tuple[str, ...]:
    """config.json's `layer_types`: one of LAYER_TYPES for each of `layers` layers."""
    given = raw.get("layer_types")
    if (
        not isinstance(given, list)
        or len(given) != layers
        or not all(t in LAYER_TYPES for t in given)
    ):
        raise UnsupportedModelError(
            f"{source}: layer_types must list {layers} of {', '.join(LAYER_TYPES)}"
        )
    return tuple(given)
