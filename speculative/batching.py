"""Many generations, one pass: the scheduler that answers the pass requests of every active
generation together (docs/architecture.md, "Many requests, one pass").

A generation is a step-wise generator (`Generation.steps`) that yields a pass request
(speculative/passes.py) whenever it needs a model pass (`Forward`) or nodes to grow its tree
by (`Allot`). Its driver (the engine, daemon/engine.py) runs it on to its next request; each
`PassScheduler.step` then answers the requests of every generation it is given: it runs the
draft model's requests as one batched pass per tree depth until every generation waits on the
target, then ONE target pass over all of them (a streamed target's weights cross the bus once
for every client), and each generation takes its logits to walk and commit on its own. A pass
holds at most `max_pass_tokens` tokens and `max_pass_rows` logit rows (the first request in
line always goes): requests that do not fit wait for the next pass, and the rows they hold are
counted before any tree grows again. Trees growing for one pass share its node budget in one
best-first order over the whole forest (SpecExec's Dijkstra across trees): at each depth step
the candidates of every tree are ranked together by their estimated probability of being
reached by verification (calibrated per verification and temperature, so requests compare on
one scale) and the best get the nodes, whichever request they belong to (`passes.allot`). A
long prompt is prefilled one chunk per pass inside the same passes, so on a streamed target
(a pass costs its weights' transfer) an arrival never stalls the streams in flight; on a
CPU (a pass costs its compute) its chunks are cut to about a second's work, a quarter of one
while others ride its passes (speculative/prefill.py, `chunk_now`).

A pass that raises leaves every cache where it stood. One that ran out of memory is rerun
once, after the driver freed some; a batched pass that still fails is rerun one generation at
a time to find whose fault it was, and only that generation fails. `step_alone` is the
interleaved schedule (one generation's round at a time, each pass its own), kept for
side-by-side measurement (scripts/bench_concurrency.py).

The scheduler knows nothing of jobs, clients or metrics: it reports back through the
callbacks it is built with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Generic, Protocol, TypeVar

import torch

from modeling.kv_cache import KVCache
from modeling.protocol import Model
from speculative.passes import Allot, Forward, PassRequest, allot, execute

# What it logs is about the engine's passes, and is read as the engine's.
log = logging.getLogger("specd.engine")


class Scheduled(Protocol):
    """A generation as the scheduler sees it (the engine keeps one record per active job)."""

    pass_request: PassRequest | None  # the pass (or the tree nodes) it waits for
    grown: int  # tree nodes granted to its round so far (rows of the coming pass)

    @property
    def pass_rows(self) -> int: ...  # its strategy's rows in a pass besides a tree's nodes

    @property
    def chunks(self) -> int: ...  # chunks it made (rounds, prefill steps): one ends a round

    @property
    def cancelled(self) -> bool: ...  # its client left


class PassBounds(Protocol):
    """What bounds a batched pass (the engine's, lowered under memory pressure): tokens and
    logit rows."""

    max_pass_tokens: int
    max_pass_rows: int


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: CUDA's, or the host's (a MemoryError, or torch's CPU
    allocator refusing)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "not enough memory" in text or "can't allocate memory" in text
    )


G = TypeVar("G", bound=Scheduled)


class PassScheduler(Generic[G]):
    """Answers the pass requests of the generations it is given, as few passes as the
    bounds allow; each generation whose request was answered runs on (`advance`)."""

    def __init__(
        self,
        target: Model,
        bounds: PassBounds,
        advance: Callable[[G], None],
        fail: Callable[[G, BaseException], None],
        rode: Callable[[list[G], int], None],
        out_of_memory: Callable[[], None],
    ) -> None:
        """`target`: the model whose pass ends a step (the others draft). `bounds`: read at
        every pass. The callbacks: `advance(g)` runs a generation whose request was answered
        on to its next one (or its end); `fail(g, error)` fails it alone; `rode(gs, tokens)`
        says that they rode one target pass of `tokens` tokens together; `out_of_memory()`
        frees memory before a pass that ran out of it (rolled back) runs again. A generation
        that ends or fails leaves the collection `step` was given through them."""
        self.target = target
        self.bounds = bounds
        self.advance = advance
        self.fail = fail
        self.rode = rode
        self.out_of_memory = out_of_memory

    def step(self, generations: Collection[G]) -> None:
        """One step: every generation runs on to its request; trees grow in lockstep (nodes
        granted, then one draft pass per depth); then one target pass over every generation
        that waits on the target. `generations` is read afresh at each turn."""
        for g in list(generations):
            if g.pass_request is None:
                self.advance(g)
        target = self.target
        # It ends: every turn grants a node or runs a draft pass, and the rows are finite.
        while True:
            asking = [g for g in generations if isinstance(g.pass_request, Allot)]
            if asking:
                self._allot(asking, self._forest_room(generations))
            drafting = [
                g
                for g in generations
                if isinstance(g.pass_request, Forward) and g.pass_request.model is not target
            ]
            if drafting:
                self._run_pass(drafting)
            elif not asking:
                break
        verifying = [g for g in generations if g.pass_request is not None]
        if verifying:
            self._run_pass(verifying)

    def step_alone(self, g: G) -> None:
        """The interleaved schedule: `g` runs one round (or one prefill step), each of its
        passes on its own, every node its tree asks for granted."""
        if g.pass_request is None:
            self.advance(g)
        chunks = g.chunks
        while g.chunks == chunks and g.pass_request is not None:
            if isinstance(g.pass_request, Allot):
                # Its own tree's budget, within a pass's rows less what the round holds
                # already (memory pressure lowers them); 0 ends the tree's growth.
                wanted = g.pass_request.wanted
                if self.bounds.max_pass_rows:
                    held = g.pass_rows + g.grown
                    wanted = min(wanted, max(0, self.bounds.max_pass_rows - held))
                self._allot([g], wanted)
            else:
                self._run_pass([g])

    def _forest_room(self, generations: Collection[G]) -> int:
        """Tree nodes the target pass being assembled can still take: the plan's logit rows
        less what is already committed to it, the rows of the target requests waiting
        (deferred ones included) and, for every other generation, the rows its strategy's
        pass returns (a root, a token, a chain) and the nodes its tree holds so far.
        Alone, at least the tree's budget."""
        rows = 0
        for g in generations:
            request = g.pass_request
            if isinstance(request, Forward) and request.model is self.target:
                rows += request.segment.logit_rows
            else:
                rows += g.pass_rows + g.grown
        return max(0, self.bounds.max_pass_rows - rows)

    def _allot(self, asking: list[G], budget: int) -> int:
        """Grant the growing trees their nodes in one best-first order over all of them
        (`passes.allot`); each runs on to its next request. Returns the nodes granted."""
        requests = [g.pass_request for g in asking if isinstance(g.pass_request, Allot)]
        granted = allot(requests, budget)
        for g, request in zip(asking, requests, strict=True):
            g.grown += request.granted or 0
            g.pass_request = None
            self.advance(g)
        return granted

    def _run_pass(self, waiting: list[G]) -> None:
        """One pass per model over the requests that fit the bounds (always the first),
        then each generation takes its result and runs on to its next request."""
        chosen: list[G] = []
        tokens = rows = 0
        most_tokens, most_rows = self.bounds.max_pass_tokens, max(self.bounds.max_pass_rows, 1)
        for g in waiting:
            assert isinstance(g.pass_request, Forward)
            seg = g.pass_request.segment
            fits = tokens + seg.length <= most_tokens
            if chosen and not (fits and rows + seg.logit_rows <= most_rows):
                continue
            chosen.append(g)
            tokens, rows = tokens + seg.length, rows + seg.logit_rows
        requests = [g.pass_request for g in chosen if isinstance(g.pass_request, Forward)]
        lengths = [(r.segment.cache, r.segment.cache.length) for r in requests]
        try:
            self._execute(requests, lengths)
        except Exception as exc:
            if len(chosen) == 1:
                self.fail(chosen[0], exc)
                return
            log.warning(
                "a pass of %d generations failed (%s: %s); each is rerun alone",
                len(chosen), type(exc).__name__, exc,
            )  # fmt: skip
            # Whose fault? Each alone: the others' results are as good as batched ones.
            for g in chosen:
                self._retry_alone(g)
            return
        if requests[0].model is self.target:
            self.rode(chosen, tokens)
        for g in chosen:
            self._deliver(g)

    def _execute(self, requests: list[Forward], lengths: list[tuple[KVCache, int]]) -> None:
        """Run a pass. One that fails leaves every cache where it stood (the layers commit
        each segment's keys and values before the head runs: a pass that raised there
        left them appended, and a rerun would append them twice). Out of memory, the
        driver frees some (`out_of_memory`) and the pass runs once more."""
        try:
            execute(requests)
            return
        except Exception as exc:
            for cache, length in lengths:
                cache.truncate(length)
            if not is_out_of_memory(exc):
                raise
            log.warning("a pass ran out of memory (%s); freeing memory and running it again", exc)
            self.out_of_memory()
        try:
            execute(requests)
        except Exception:
            for cache, length in lengths:
                cache.truncate(length)
            raise

    def _retry_alone(self, g: G) -> None:
        assert isinstance(g.pass_request, Forward)
        try:
            execute([g.pass_request])
        except Exception as exc:
            self.fail(g, exc)
            return
        if g.pass_request.model is self.target:
            self.rode([g], g.pass_request.segment.length)
        self._deliver(g)

    def _deliver(self, g: G) -> None:
        """The generation's pass ran: it takes the result and runs on."""
        assert isinstance(g.pass_request, Forward) and g.pass_request.result is not None
        if g.pass_request.model is self.target:
            g.grown = 0  # the round's tree is verified: its rows are spent
        g.pass_request = None
        if g.cancelled:
            # The client left during the pass: its round is neither walked nor posted;
            # the driver drops it (and its KV cache) before the next step.
            return
        self.advance(g)
