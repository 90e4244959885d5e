"""How likely verification is to move from a tree node to each of its children, learned
online from verification outcomes (DESIGN.md, "Trees that never lose to a chain").

A tree round yields 1 + (accepted nodes) tokens, and a node is accepted exactly when
verification reaches it, so the expected yield of a tree is 1 + the sum over its nodes of
the probability of reaching them, a product along the path of per-edge probabilities

    a(child) = P(verification moves from the parent to this child | it is at the parent).

Best-first growth by that product is optimal for the tree's yield (SpecExec, Sequoia).
What `a` is depends on the verification:

- the walk (`walk`): the target's draw at the parent is the child's token. Sampled with
  the same position noise the draft ranked its children by (`PositionNoise`), so that an
  aligned draft's first child is the target's own draw;
- recursive rejection sampling (`rejection`) over children sampled without replacement:
  child j is accepted after children 1..j-1 were rejected; for an exact draft a_1 = 1.

Neither is the draft's raw probability: a flat but aligned draft (any real model at T=1)
has q = 0.3 where a = 0.97, and a peaked but wrong one the reverse. So `a` is estimated
per verification kind and temperature regime, as a function of the child's rank among its
siblings and of its draft probability (Sequoia's positional acceptance vector, EAGLE-2's
calibrated confidence), from counts of what verification did at every node it visited:
each child there is a trial, the one it moved to a success.

Before any outcome the estimate is a prior worth `PRIOR_WEIGHT` observations, one that
grows the best chain until evidence says otherwise: a first child is accepted almost
always (`FIRST_CHILD_PRIOR`), so a cold tree goes deep down the draft's first choices as
the longest chain would; a later sibling is worth a share of what the first child misses
(`SIBLING_SHARE` of 1 - its estimate), so it stays out of the tree while first children
are accepted and comes in as soon as they are seen to fail. First children are tried at
every node verification visits, so that evidence comes within a round; siblings, once in
the tree, learn their own rate.

A path is valued by what the evidence predicts for it, not by the estimates multiplied:
the first children along one path share one unknown rate, and the probability that k of
them in a row are accepted is E[a^k] under the estimate's posterior, which falls off like
a power of k while the rate is uncertain and like a^k once it is known. Sequentially, the
(k+1)-th first child on a path, given the k before it accepted, misses with the rank's
posterior miss rate β / (α + β + k) (α, β: the rank's successes and misses, prior
included), scaled by its draft-probability bin's share of misses. With the plain product, one
early miss (6 of 7 first children accepted: 0.88 per level) valued a 46-deep chain at
0.003 and a cold 64-node tree took siblings from depth ~24 on, yielding 32 tokens per pass
where the 64-chain yielded 43 (SmolLM2 with its 8-bit substitute, greedy, MT-Bench); the
prediction values it at 0.6 and the tree stays a chain until misses say otherwise.
(The old prior, a first child accepted at 0.5 + q/2,
spread a cold tree wide: an aligned draft's first 64-node tree yielded 37 tokens where the
64-chain yielded 65, and a cold `--budget 64` run gave 0.71x the chain's tokens per pass;
a first child at 0.92 still cut a cold 64-node tree at depth ~40.)
What a model pair has learned is kept on disk between runs (daemon/acceptance_store.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.sampling import SamplingParams

VERIFICATIONS = ("walk", "rejection")
TREE_VERIFICATION_CHOICES = ("auto", *VERIFICATIONS)

# The child's draft probability, binned: the upper edges (the last bin ends at 1).
Q_EDGES = (1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 0.95)
# The child's rank among its siblings (1 = first), binned: 1, 2, 3, 4, 5-8, 9-16, 17+.
RANK_EDGES = (1, 2, 3, 4, 8, 16)
PRIOR_WEIGHT = 2.0
# The prior's first child, accepted almost always (a draft is chosen because it agrees),
# and each later rank's share of what the first child misses (per child: the bins hold
# ranks 2, 3, 4, 5-8, 9-16, 17+; together about all of the miss).
FIRST_CHILD_PRIOR = 0.97
SIBLING_SHARE = (0.45, 0.2, 0.1, 0.04, 0.01, 0.003)
# Counts are decayed towards the latest outcomes once a cell holds this many trials, so a
# model pair whose text changes character (code after prose) is followed.
MAX_TRIALS = 4000.0
# The floor of an estimate (a probability of exactly 0 would make log-values -inf).
MIN_ACCEPTANCE = 1e-6
# Ranks the yield simulation gives each node (children past it add little and cost time).
SIMULATED_BRANCH = 8
# The weight of the latest round in a table's running mean of tokens per round.
RECENT_WEIGHT = 0.05


REGIMES = ("greedy", "T<0.5", "T0.5-0.85", "T0.85-1.15", "T>=1.15")


def _cells(value: object, shape: torch.Size, what: str) -> torch.Tensor:
    """A table's counts read back from a file: a list of lists of finite counts >= 0 in
    exactly the table's shape."""
    rows, cols = shape
    if not (
        isinstance(value, list)
        and len(value) == rows
        and all(isinstance(r, list) and len(r) == cols for r in value)
        and all(isinstance(x, (int, float)) for r in value for x in r)
    ):
        raise ValueError(f"{what}: not a {rows} x {cols} table of counts")
    if any(isinstance(x, int) and not -(1 << 53) < x < 1 << 53 for r in value for x in r):
        raise ValueError(f"{what}: a count past what a float holds exactly")
    out = torch.tensor(value, dtype=torch.float64)
    if not bool(torch.isfinite(out).all()) or bool((out < 0).any()):
        raise ValueError(f"{what}: counts must be finite and >= 0")
    return out


def regime(params: SamplingParams) -> str:
    """The temperature regime whose statistics a request shares: acceptance at T=0.2 says
    little about T=1."""
    if params.greedy:
        return "greedy"
    t = params.temperature
    if t < 0.5:
        return "T<0.5"
    if t < 0.85:
        return "T0.5-0.85"
    if t < 1.15:
        return "T0.85-1.15"
    return "T>=1.15"


def q_bin(q: torch.Tensor) -> torch.Tensor:
    """(n,) bin index of each draft probability."""
    edges = torch.tensor(Q_EDGES, dtype=q.dtype, device=q.device)
    return torch.bucketize(q, edges)


def rank_bin(rank: torch.Tensor) -> torch.Tensor:
    """(n,) bin index of each 1-based sibling rank."""
    edges = torch.tensor(RANK_EDGES, dtype=rank.dtype, device=rank.device)
    return torch.bucketize(rank, edges)


def _middles() -> torch.Tensor:
    lows, highs = (0.0, *Q_EDGES), (*Q_EDGES, 1.0)
    return torch.tensor([(lo + hi) / 2 for lo, hi in zip(lows, highs, strict=True)])


_MIDDLES = _middles()  # each q bin's middle draft probability


def _prior_shape(kind: str) -> torch.Tensor:
    """(ranks, q bins) how the prior spreads each rank's acceptance over the draft's
    probabilities, a mean of 1 per rank: for the walk in proportion to the child's draft
    probability (a first child a little, later ones wholly), for rejection flat (a sampled
    child is accepted by min(1, p/q), whatever q was)."""
    middle = _MIDDLES.double()
    ranks = len(RANK_EDGES) + 1
    if kind == "walk":
        first = 0.85 + 0.15 * middle
        later = middle.expand(ranks - 1, len(middle))
        shape = torch.cat((first[None], later))
    else:
        shape = torch.ones(ranks, len(middle), dtype=torch.float64)
    return shape / shape.mean(1, keepdim=True)


@dataclass
class AcceptanceTable:
    """Trials and successes of one (verification, regime) per (rank bin, q bin) cell."""

    kind: str
    shape: torch.Tensor = field(init=False)  # (ranks, q bins) the prior's spread over q
    trials: torch.Tensor = field(init=False)
    successes: torch.Tensor = field(init=False)
    rounds: int = 0  # verified rounds observed
    tokens: float = 0.0  # tokens those rounds yielded
    recent: float = 0.0  # tokens per round, a running mean favouring recent rounds
    starts: int = 0  # generations that chose at their first tree round (not stored)

    def __post_init__(self) -> None:
        self.shape = _prior_shape(self.kind)
        self.trials = torch.zeros_like(self.shape)
        self.successes = torch.zeros_like(self.shape)
        self._estimate: torch.Tensor | None = None
        self._marginal: list[float] | None = None

    def estimate(self) -> torch.Tensor:
        """(ranks, q bins) P(move to the child), smoothed hierarchically: a rank's
        estimate over all draft probabilities towards the prior, and each cell towards its
        rank's (a cell seen a few times says little; its rank, seen at every visited node,
        learns within a round)."""
        if self._estimate is None:
            w = PRIOR_WEIGHT
            hits, tries = self.successes.sum(1), self.trials.sum(1)  # (ranks,)
            first = (hits[0] + w * FIRST_CHILD_PRIOR) / (tries[0] + w)
            share = torch.tensor(SIBLING_SHARE, dtype=torch.float64)
            prior_rank = torch.cat((first.reshape(1), (1 - first) * share))  # (ranks,)
            rank = (hits + w * prior_rank) / (tries + w)
            # The prior's shape across draft probabilities, scaled to the rank's estimate.
            toward = (self.shape * rank[:, None]).clamp(max=1.0)
            est = (self.successes + w * toward) / (self.trials + w)
            self._estimate = est.float().clamp(MIN_ACCEPTANCE, 1.0)
        return self._estimate

    def observe(self, ranks: torch.Tensor, q: torch.Tensor, moved: torch.Tensor) -> None:
        """One visited node's children: (n,) ranks, draft probabilities, and whether
        verification moved to each (at most one True)."""
        if not ranks.numel():
            return
        r, b = rank_bin(ranks.cpu()), q_bin(q.float().cpu())
        cells = r * self.shape.shape[1] + b
        n = self.shape.numel()
        self.trials += torch.bincount(cells, minlength=n).view_as(self.trials)
        hit = torch.bincount(cells, weights=moved.cpu().double(), minlength=n)
        self.successes += hit.view_as(self.successes)
        full = self.trials > MAX_TRIALS
        if bool(full.any()):
            scale = torch.where(full, MAX_TRIALS / self.trials, torch.ones_like(self.trials))
            self.trials *= scale
            self.successes *= scale
        self._estimate = None
        self._marginal = None

    def first_counts(self) -> tuple[float, float]:
        """(α, β): the first rank's successes and misses, the prior's included (its
        posterior, whose mean is the rank's estimate)."""
        w = PRIOR_WEIGHT
        hits, tries = float(self.successes[0].sum()), float(self.trials[0].sum())
        return hits + w * FIRST_CHILD_PRIOR, tries - hits + w * (1 - FIRST_CHILD_PRIOR)

    def _along_path(
        self, value: torch.Tensor, ranks: torch.Tensor, firsts: torch.Tensor | None
    ) -> torch.Tensor:
        """`value` (n,), each child's estimate, as the posterior predicts it for a first
        child whose path holds `firsts` (n,) accepted first children already: its miss
        1 - value scaled by (α + β) / (α + β + k) (the module's docstring)."""
        if firsts is None:
            return value
        alpha, beta = self.first_counts()
        seen = alpha + beta
        scale = seen / (seen + firsts.to(value.device, value.dtype))  # (n,)
        first = ranks == 1
        return torch.where(first, 1 - (1 - value) * scale, value)

    def log_acceptance(
        self, ranks: torch.Tensor, q: torch.Tensor, firsts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(n,) log P(move to each child) for children of the given ranks and draft
        probabilities: interpolated linearly in q between the middles of the two nearest
        bins, so that children of one bin keep the order of their draft probabilities.
        `firsts` (n,): the first children already on each child's path (`_along_path`);
        None values each child alone."""
        est = self.estimate().to(q.device)  # (ranks, q bins)
        middles = _MIDDLES.to(q.device, q.dtype)  # (q bins,)
        q = q.float().clamp(float(middles[0]), float(middles[-1]))
        upper = torch.bucketize(q, middles).clamp(1, len(middles) - 1)  # (n,)
        lo, hi = middles[upper - 1], middles[upper]
        frac = ((q - lo) / (hi - lo)).clamp(0.0, 1.0)
        r = rank_bin(ranks)
        value = est[r, upper - 1] * (1 - frac) + est[r, upper] * frac
        value = self._along_path(value, ranks, firsts)
        return value.clamp(MIN_ACCEPTANCE, 1.0).log()

    def by_rank(self) -> torch.Tensor:
        """(rank bins,) P(move to the child) by rank alone, averaged over the draft
        probabilities seen at that rank (prior-weighted where nothing was seen)."""
        est = self.estimate().double()  # (ranks, q bins)
        seen = self.trials + PRIOR_WEIGHT / est.shape[1]  # every bin a little weight
        return ((est * seen).sum(1) / seen.sum(1)).float().clamp(MIN_ACCEPTANCE, 1.0)

    def log_rank_acceptance(
        self, ranks: torch.Tensor, firsts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(n,) log P(move to each child) by its rank alone: what a sampled child is
        worth, since valuing it by its own draft probability would make whether it joins
        the tree depend on which token was drawn, and rejection sampling is exact only
        for children offered whatever they are. `firsts` as in `log_acceptance`."""
        value = self.by_rank().to(ranks.device)[rank_bin(ranks)]
        return self._along_path(value, ranks, firsts).clamp(MIN_ACCEPTANCE, 1.0).log()

    def marginal(self) -> list[float]:
        """P(move to the child of rank 1, 2, ...) by rank alone (`by_rank`)."""
        if self._marginal is None:
            by_rank = self.by_rank()
            values = []
            for rank in range(1, SIMULATED_BRANCH + 1):
                values.append(float(by_rank[int(rank_bin(torch.tensor([rank]))[0])]))
            self._marginal = values
        return self._marginal

    def expected_tokens(self, budget: int) -> float:
        """Tokens per round a best-first tree of `budget` nodes would yield if every node's
        children were accepted at the marginal rates: 1 + the `budget` largest reach
        probabilities (Sequoia's dynamic program, by best-first enumeration)."""
        rates = self.marginal()
        total, taken = 1.0, 0
        heap = [(-rates[0], 1, 1.0)]  # (-reach, rank, parent reach)
        while heap and taken < budget:
            neg, rank, parent = heapq.heappop(heap)
            reach = -neg
            total += reach
            taken += 1
            heapq.heappush(heap, (-reach * rates[0], 1, reach))  # its first child
            if rank < len(rates):  # its next sibling
                heapq.heappush(heap, (-parent * rates[rank], rank + 1, parent))
        return total

    def note_round(self, tokens: int) -> None:
        self.rounds += 1
        self.tokens += tokens
        weight = max(1.0 / self.rounds, RECENT_WEIGHT)
        self.recent += weight * (tokens - self.recent)


class AcceptanceModel:
    """Every (verification, regime) table of one model pair (one tree strategy)."""

    def __init__(self) -> None:
        self.tables: dict[tuple[str, str], AcceptanceTable] = {}

    def table(self, kind: str, params: SamplingParams) -> AcceptanceTable:
        key = (kind, regime(params))
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = AcceptanceTable(kind)
        return table

    def state(self) -> dict[str, dict[str, Any]]:
        """What the tables learned, as plain JSON-able values (`load_state` reads it back):
        per table its trials and successes per cell and its round counts."""
        return {
            f"{kind}/{reg}": {
                "trials": t.trials.tolist(),
                "successes": t.successes.tolist(),
                "rounds": t.rounds,
                "tokens": t.tokens,
                "recent": t.recent,
            }
            for (kind, reg), t in sorted(list(self.tables.items()))
        }

    def load_state(self, state: object) -> int:
        """Replace the tables with a `state()` record (from a file: hostile until checked);
        ValueError naming what is wrong, leaving the tables as they were. Returns the
        rounds it holds."""
        if not isinstance(state, dict) or len(state) > len(VERIFICATIONS) * len(REGIMES):
            raise ValueError("acceptance: not a table per verification and regime")
        tables: dict[tuple[str, str], AcceptanceTable] = {}
        for name, record in state.items():
            kind, _, reg = str(name).partition("/")
            if kind not in VERIFICATIONS or reg not in REGIMES or not isinstance(record, dict):
                raise ValueError(f"acceptance: unknown table {name!r}")
            table = AcceptanceTable(kind)
            cells = table.trials.shape
            trials = _cells(record.get("trials"), cells, f"acceptance {name} trials")
            hits = _cells(record.get("successes"), cells, f"acceptance {name} successes")
            if bool((hits > trials).any()) or bool((trials > MAX_TRIALS + 1).any()):
                raise ValueError(f"acceptance {name}: more successes than trials")
            rounds, tokens, recent = (record.get(k) for k in ("rounds", "tokens", "recent"))
            if not (isinstance(rounds, int) and 0 <= rounds < 1 << 40):
                raise ValueError(f"acceptance {name}: rounds is not a count")
            for value, what in ((tokens, "tokens"), (recent, "recent")):
                if not isinstance(value, (int, float)) or not 0 <= value < 1e15:
                    raise ValueError(f"acceptance {name}: {what} is not a count")
            table.trials, table.successes = trials, hits
            table.rounds = rounds
            table.tokens, table.recent = float(tokens), float(recent)  # type: ignore[arg-type]
            tables[(kind, reg)] = table
        self.tables = tables
        return sum(t.rounds for t in tables.values())

    def to_dict(self) -> dict[str, dict[str, float]]:
        """Per table: rounds seen, measured tokens per round, and the marginal acceptance
        of the first two ranks (for the status)."""
        out = {}
        for (kind, reg), t in sorted(list(self.tables.items())):  # (the engine may add one)
            rates = t.marginal()
            out[f"{kind}/{reg}"] = {
                "rounds": t.rounds,
                "tokens_per_round": round(t.recent, 3),
                "first_child": round(rates[0], 4),
                "second_child": round(rates[1], 4),
            }
        return out
