"""What the engine keeps between requests: the strategies it built (each keeps what it
learned: a tree strategy with `--budget auto` its measured costs and acceptance) and the
sessions of finished conversations (their KV caches, so that a follow-up prompt only
prefills its new suffix)."""

from __future__ import annotations

from collections import OrderedDict

from daemon.runtime import Runtime
from speculative.rounds import Strategy
from speculative.session import Session, common_prefix_len

# Strategies kept for per-request tree budgets. Without a bound, a client cycling through
# budgets grew one strategy (with its learned costs) per distinct value, forever; they all
# share the runtime's one prefix cache.
REQUEST_BUDGET_STRATEGIES = 4


class StrategyPool:
    """Strategies built once per (name, budget, tree verification): the configured ones kept
    for good, those of a request's own budget or verification in an LRU of at most
    REQUEST_BUDGET_STRATEGIES."""

    def __init__(self) -> None:
        self._configured: dict[str, Strategy] = {}
        self._budgeted: OrderedDict[tuple[str, int | None, str | None], Strategy] = OrderedDict()
        # Memory pressure shortens every strategy's prefill passes to 1/share of its own.
        self.prefill_share = 1
        self._own_chunk: dict[int, int] = {}  # id(strategy) → its own chunk, while held

    def shorten_prefill(self, share: int) -> None:
        """Prefill passes of 1/`share` of each strategy's own prompt tokens (1: its own),
        for the strategies held and those built later (a generation that is prefilling
        already keeps its chunk)."""
        self.prefill_share = share
        held = self.held()
        self._own_chunk = {id(s): self._own_chunk.get(id(s), s.prefill_chunk) for s in held}
        for strategy in held:
            strategy.prefill_chunk = max(1, self._own_chunk[id(strategy)] // share)
        if share == 1:
            self._own_chunk = {}  # given back: no id may outlive its strategy here

    def _built(self, strategy: Strategy) -> Strategy:
        if self.prefill_share > 1:
            self._own_chunk[id(strategy)] = strategy.prefill_chunk
            strategy.prefill_chunk = max(1, strategy.prefill_chunk // self.prefill_share)
        return strategy

    def get(
        self,
        runtime: Runtime,
        name: str | None,
        budget: int | None,
        verification: str | None = None,
    ) -> Strategy:
        name = name or runtime.default_strategy
        if name != "tree":
            # Only the tree reads a budget and a verification: one strategy serves every
            # request.
            budget = verification = None
        if budget is None and verification is None:
            if name not in self._configured:
                self._configured[name] = self._built(runtime.strategy(name))
            return self._configured[name]
        key = (name, budget, verification)
        strategy = self._budgeted.get(key)
        if strategy is None:
            strategy = runtime.strategy(name, budget=budget, verification=verification)
            self._budgeted[key] = self._built(strategy)
            while len(self._budgeted) > REQUEST_BUDGET_STRATEGIES:
                self._budgeted.popitem(last=False)  # active jobs keep their own
        self._budgeted.move_to_end(key)
        return strategy

    def clear(self) -> None:
        """Forget every strategy (and what each learned): the next requests build new ones.
        Active jobs keep theirs."""
        self._configured.clear()
        self._budgeted.clear()

    def held(self) -> list[Strategy]:
        return [*self._configured.values(), *self._budgeted.values()]


class SessionPool:
    """Sessions of finished generations, least recently used first, at most `capacity`
    (0: none kept). A session is only reused by the strategy (`key`) that made it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._idle: list[tuple[str, Session]] = []

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, key: str, prompt_ids: list[int]) -> Session | None:
        """The idle session with the longest common prefix with `prompt_ids`, if any."""
        best, best_len = None, -1
        for i, (held_key, session) in enumerate(self._idle):
            if held_key != key:
                continue
            n = common_prefix_len(session.target_tokens, prompt_ids)
            if n > best_len:
                best, best_len = i, n
        if best is None:
            return None
        return self._idle.pop(best)[1]

    def release(self, key: str, session: Session) -> None:
        if self.capacity == 0:
            return
        self._idle.append((key, session))
        while len(self._idle) > self.capacity:
            self._idle.pop(0)  # the least recently used conversation

    def clear(self) -> None:
        self._idle.clear()
