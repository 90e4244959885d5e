"""Model passes as requests: how strategies share one pass among many generations.

A strategy does not call its models. Its round is a generator that yields a `Forward` (run
this model over this segment of my sequence) wherever it needs logits; the driver runs it,
stores a `Pass` (the segment's logits and what the whole pass carried) in the request and
resumes the generator, which takes the result out (`Forward.take`): a driver still holding
the request then holds no logits through the next pass (the plan counts one). Whoever drives the
generator decides how the requests run: `run_alone` runs each as a pass of its own (one
generation: the CLI, tests), the engine gathers the requests of every active generation
and runs them as one batched pass per model (`execute`), so a streamed target's weights
cross the bus once for all of them. The strategy's code is the same either way.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from speculative.kv_cache import KVCache
from speculative.model import Segment, Transformer

T = TypeVar("T")


@dataclass(eq=False)
class Forward:
    """Run `model` over `segment`; the driver stores the outcome in `result`."""

    model: Transformer
    segment: Segment
    result: Pass | None = None

    def take(self) -> Pass:
        """The result, handed over once; the request keeps neither it nor the mask."""
        result, self.result = self.result, None
        if result is None:
            raise RuntimeError("a pass was requested but the driver resumed without running it")
        self.segment.mask = None
        return result


@dataclass
class Pass:
    """What a `Forward` got: its own logits, and the size of the pass it rode in."""

    logits: torch.Tensor  # (segment.logit_rows, V) fp32
    tokens: int  # tokens of every segment in the pass
    sequences: int  # segments in the pass


# What a step-wise routine yields (it is resumed with None): it returns T when done.
Steps = Generator[Forward, None, T]


def forward(
    model: Transformer,
    tokens: torch.Tensor,  # (T,)
    positions: torch.Tensor,  # (T,)
    cache: KVCache,
    mask: torch.Tensor | None = None,
    logits_from: int = 0,
) -> Steps[Pass]:
    """Request one pass over one sequence's segment (`yield from` it)."""
    request = Forward(model, Segment(tokens, positions, cache, mask, logits_from))
    yield request
    return request.take()


def execute(requests: Sequence[Forward]) -> None:
    """Run requests as one pass per model (in the order models first appear), each
    model's segments batched together; each request gets its `result`."""
    models: dict[int, list[int]] = {}
    for i, req in enumerate(requests):
        models.setdefault(id(req.model), []).append(i)
    for indices in models.values():
        model = requests[indices[0]].model
        segments = [requests[i].segment for i in indices]
        logits = model.forward_batch(segments)
        tokens = sum(seg.length for seg in segments)
        for i, out in zip(indices, logits, strict=True):
            requests[i].result = Pass(out, tokens, len(segments))


def run_alone(steps: Steps[T]) -> T:
    """Drive a step-wise routine to its result, each request a pass of its own."""
    try:
        request = next(steps)
        while True:
            execute([request])
            request = next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
