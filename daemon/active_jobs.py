"""What the engine keeps of each job it runs (`ActiveJob`: its generation, and what the
pass scheduler reads and keeps of it), and how the choices of one request share their
prompt: the choices of a request with `n` > 1 share a `prompt_group`; all but the first
wait until the first has fed the prompt (`waits_for_prompt`), then start from a copy of
its caches (`prompt_fork`), so that the prompt is prefilled once (it was once a choice:
16 choices of a long prompt, 16 prefills).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

from daemon.jobs import GenerationRequest, Job
from speculative.generation import Chunk, Generation
from speculative.passes import PassRequest
from speculative.rounds import Strategy
from speculative.session import Session, common_prefix_len


@dataclass(eq=False)
class ActiveJob:
    """An active job: its generation, and what the pass scheduler reads and keeps of it
    (speculative.batching.Scheduled)."""

    job: Job
    generation: Generation
    steps: Generator[Chunk | PassRequest, None, None]
    session: Session
    pool_key: str
    first_token_seen: bool = False
    held: list[Chunk] = field(default_factory=list)  # coalesced, not yet posted
    last_post: float = 0.0
    pass_request: PassRequest | None = None  # the pass (or the tree nodes) it waits for
    chunks: int = 0  # chunks taken (rounds and prefill steps)
    target_passes: int = 0  # target passes it rode in
    pass_generations: int = 0  # generations in those passes, summed
    shared_passes: int = 0  # those that also carried another generation's work
    grown: int = 0  # tree nodes granted to this round so far (rows of the coming pass)

    @classmethod
    def begin(cls, job: Job, strategy: Strategy, session: Session, tokenizer: Any) -> ActiveJob:
        """`job`'s generation, with every parameter as its request settled it, on
        `session` (kept, when it ends, for `strategy`'s later requests)."""
        req = job.request
        gen = Generation(
            strategy,
            session,
            tokenizer,
            req.prompt_ids,
            req.params,
            max_tokens=req.max_tokens,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            trace=req.trace,
            constraint=req.constraint,
            call_lead=req.calls.lead if req.calls is not None else None,
            thinking=req.thinking,
        )
        return cls(job, gen, gen.steps(), session, strategy.name)

    @property
    def pass_rows(self) -> int:
        return self.generation.strategy.pass_rows

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled

    def rode(self, riders: int) -> None:
        """It rode one target pass with `riders` generations (itself included)."""
        self.target_passes += 1
        self.pass_generations += riders
        self.shared_passes += int(riders > 1)

    def batching(self) -> dict[str, float | int | None]:
        """Its batching figures, for its statistics: the mean number of generations in its
        target passes, and how many of those it shared."""
        passes = self.target_passes
        return {
            "batch_size": self.pass_generations / passes if passes else None,
            "shared_passes": self.shared_passes,
        }


def first_choice(request: GenerationRequest, active: Iterable[ActiveJob]) -> ActiveJob | None:
    """The active generation of another choice of `request`'s (its first), if any."""
    group = request.prompt_group
    if group is None:
        return None
    return next((a for a in active if a.job.request.prompt_group is group), None)


def waits_for_prompt(request: GenerationRequest, active: Iterable[ActiveJob]) -> bool:
    """Whether `request` waits for the first choice of its request to have fed their
    prompt: then it starts from a copy of that one's caches (`prompt_fork`)."""
    first = first_choice(request, active)
    if first is None:
        return False
    prompt, fed = request.prompt_ids, first.session.target_tokens
    # (the length first: the prefix is compared once, not at every step of a 32k prompt)
    return len(fed) < len(prompt) - 1 or common_prefix_len(fed, prompt) < len(prompt) - 1


def prompt_fork(
    request: GenerationRequest, pool_key: str, active: Iterable[ActiveJob]
) -> Session | None:
    """A copy of the session of a choice of the same request that has fed its prompt
    (`waits_for_prompt`), None where there is none."""
    first = first_choice(request, active)
    if first is None or first.pool_key != pool_key:
        return None
    return first.session.fork()
