"""Model passes as requests: how strategies share one pass among many generations.

A strategy does not call its models. Its round is a generator that yields a `Forward` (run
this model over this segment of my sequence) wherever it needs logits; the driver runs it,
stores a `Pass` (the segment's logits and what the whole pass carried) in the request and
resumes the generator, which takes the result out (`Forward.take`): a driver still holding
the request then holds no logits through the next pass (the plan counts one); the
strategies drop theirs before they request the next pass too. Whoever drives the
generator decides how the requests run: `run_alone` runs each as a pass of its own (one
generation: the CLI, tests; `alone` does the same for a generator that also yields rounds or
chunks), the engine gathers the requests of every active generation and runs them as one
batched pass per model (`execute`), so a streamed target's weights cross the bus once for
all of them. The strategy's code is the same either way.

The second request, `Allot`, is how tree nodes are spent when several trees grow for one
pass (SpecExec's best-first order over the whole forest): at each growth step a tree offers
its candidates' estimated log-probabilities of being reached by verification
(speculative/acceptance.py), and the driver grants it a number
of nodes. Alone, a tree gets what it asked for; the engine ranks every tree's offers
together and grants the best ones, within the pass's node budget (`allot`).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from modeling.kv_cache import KVCache
from modeling.protocol import Model, Segment

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class Forward:
    """Run `model` over `segment`; the driver stores the outcome in `result`."""

    model: Model
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
    segment_tokens: int  # this segment's own tokens
    seconds: float = 0.0  # the pass's (the model's batched forward, as the host saw it)


@dataclass(eq=False)
class Allot:
    """A growing tree asks how many of its best candidates it may add now: `wanted` when
    alone. The driver sets `granted`: a count (0: wait, others' candidates were better;
    ask again next step) or None (the pass's nodes are spent: stop growing)."""

    offers: torch.Tensor  # (m,) the candidates' estimated log reach probabilities
    wanted: int
    granted: int | None = None
    answered: bool = False

    def grant(self, count: int | None) -> None:
        self.granted, self.answered = count, True

    def take(self) -> int | None:
        if not self.answered:
            raise RuntimeError("nodes were asked for but the driver resumed without answering")
        self.offers = self.offers[:0]  # the driver keeps no reference to the candidates
        return self.granted


# What a step-wise generation asks its driver for: a segment of the coming pass, or nodes to
# grow its tree by. (A client's request is another thing: daemon/jobs.py's GenerationRequest.)
PassRequest = Forward | Allot

# What a step-wise routine yields (it is resumed with None): it returns T when done.
Steps = Generator[PassRequest, None, T]


def forward(
    model: Model,
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


def feed_pass(model: Model, cache: KVCache, fed: list[int], tokens: Sequence[int]) -> Steps[Pass]:
    """Request one pass over `tokens` after the `fed` tokens that `cache` holds (positions
    continue from `len(fed)`), with logits for the last row only; `fed` then holds them."""
    start = len(fed)
    done = yield from forward(
        model,
        torch.tensor(list(tokens), dtype=torch.long, device=model.device),  # (T,)
        torch.arange(start, start + len(tokens), device=model.device),  # (T,)
        cache,
        logits_from=len(tokens) - 1,
    )
    fed.extend(tokens)
    return done


def execute(requests: Sequence[Forward]) -> None:
    """Run requests as one pass per model (in the order models first appear), each
    model's segments batched together; each request gets its `result`."""
    if len(requests) == 1:  # a generation alone: no grouping
        (request,) = requests
        t0 = time.perf_counter()
        (alone,) = request.model.forward_batch([request.segment])
        n = request.segment.length
        request.result = Pass(alone, n, 1, n, time.perf_counter() - t0)
        return
    models: dict[int, list[int]] = {}
    for i, req in enumerate(requests):
        models.setdefault(id(req.model), []).append(i)
    for indices in models.values():
        model = requests[indices[0]].model
        segments = [requests[i].segment for i in indices]
        t0 = time.perf_counter()
        logits = model.forward_batch(segments)
        seconds = time.perf_counter() - t0
        tokens = sum(seg.length for seg in segments)
        for i, out in zip(indices, logits, strict=True):
            own = requests[i].segment.length
            requests[i].result = Pass(out, tokens, len(segments), own, seconds)


def serve_alone(request: PassRequest) -> None:
    """Answer one request as if its generation were the only one: a pass of its own, or
    every node it asked for."""
    if isinstance(request, Forward):
        execute([request])
    else:
        request.grant(request.wanted)


def allot(requests: Sequence[Allot], budget: int) -> int:
    """Grant trees growing for one pass their nodes in one best-first order over all of
    them: this step adds at most the nodes they want together, and at most `budget`, and
    they go to the candidates most likely to be reached by verification, whichever
    tree they are in (their calibrated estimates, comparable across requests).
    With nothing left every tree is told to stop. Returns the nodes granted."""
    if budget <= 0:
        for request in requests:
            request.grant(None)
        return 0
    # As many nodes as the trees would add alone this step, placed by rank: a tree whose
    # candidates beat the others' gets more than it asked for (up to what it offers, which
    # never exceeds its own budget), one whose candidates lose waits.
    offers = torch.cat([r.offers for r in requests])  # (M,)
    owners = torch.cat(
        [torch.full((r.offers.numel(),), i, device=offers.device) for i, r in enumerate(requests)]
    )  # (M,)
    count = min(budget, sum(r.wanted for r in requests), int(offers.numel()))
    best = torch.topk(offers, count).indices  # (count,)
    granted = torch.bincount(owners[best], minlength=len(requests)).tolist()
    for request, n in zip(requests, granted, strict=True):
        request.grant(n)
    return count


def run_alone(steps: Steps[T]) -> T:
    """Drive a step-wise routine to its result, each request served alone."""
    try:
        request = next(steps)
        while True:
            serve_alone(request)
            request = next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def alone(steps: Generator[PassRequest | R, None, None]) -> Iterator[R]:
    """Drive a step-wise generator on its own: each request is served at once as if no
    other generation existed (`serve_alone`), everything else is passed on (a strategy's
    Rounds, a Generation's Chunks)."""
    try:
        for item in steps:
            if isinstance(item, Forward | Allot):
                serve_alone(item)
            else:
                yield item
    finally:
        steps.close()
