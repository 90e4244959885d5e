"""What a target pass costs, learned from the passes seen, for `AutoBudget`
(speculative/budget.py) to predict a tree's cost with: `CostLine`, seconds ≈ a + b·f(n)
fitted through per-size running means that follow drift, and `MarginalCost`, what a
generation's own tokens cost in a pass it shares with others.

f(n) is n itself for a dense target. A mixture of experts whose routed experts live off the
device pays per distinct expert its tokens wake, and that union grows sublinearly (64
tokens wake 126 of Qwen3-30B-A3B's 128 experts a layer, 256 no more): its line is priced by
the expected experts woken (`feature`), so a 256-node tree is not predicted to cost 4x a
64-node one because the first few sizes rose steeply."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_SIZES = 256  # sizes a line read back from a file may hold (half-octaves need ~30)


# How far a quicker-than-expected pass moves its estimate (see CostLine.observe).
DOWN_RATE = 0.5


@dataclass
class CostLine:
    """seconds ≈ a + b·f(n), fitted through per-size running means (recent rounds weigh
    more, so drift on a shared machine is followed). f (`feature`, set by `price_by`) is
    the identity unless a pass's cost grows otherwise than with its tokens; the sizes kept
    are token counts either way (what a file keeps: `state`)."""

    decay: float = 0.9
    means: dict[int, float] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    # Per size key, the mean size observed under it (the key itself, unless sizes are
    # grouped: `observe(..., key=)`).
    sizes: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._fit: tuple[float, float, float] | None = None  # (mean f(n), mean s, slope)
        self.feature: Callable[[float], float] | None = None

    def price_by(self, feature: Callable[[float], float] | None) -> None:
        """Fit seconds against `feature`(tokens) from now on (None: the tokens)."""
        self.feature, self._fit = feature, None

    def _x(self, n: float) -> float:
        return n if self.feature is None else self.feature(n)

    def observe(self, n: int, seconds: float, key: int | None = None) -> None:
        """One measurement of `seconds` at size `n`, kept under `key` (default `n`)."""
        self._fit = None
        key = n if key is None else key
        if key in self.means:
            # A shared machine stalls now and then: one stall must not move the estimate far.
            # Its noise only ever adds time, so a pass quicker than the estimate shows what
            # passes cost now (a cost learnt on a busy machine, or by a daemon under load
            # and kept on disk, made trees look cheap long after): followed down by half at
            # once, up by (1 - decay).
            mean = self.means[key]
            seconds = min(seconds, 3.0 * mean)
            rate = DOWN_RATE if seconds < mean else 1 - self.decay
            self.means[key] = mean + rate * (seconds - mean)
            self.sizes[key] = self.decay * self.sizes[key] + (1 - self.decay) * n
            self.weights[key] = min(self.weights[key] + 1.0, 20.0)
        else:
            self.means[key], self.sizes[key], self.weights[key] = seconds, float(n), 1.0

    def __bool__(self) -> bool:
        return bool(self.means)

    def predict(self, n: int) -> float:
        if not self.means:
            raise ValueError("no measurements yet")
        if len(self.means) == 1:
            return next(iter(self.means.values()))  # one size seen: assume flat
        if self._fit is None:  # the planner predicts many sizes per observation: fit once
            w = self.weights
            x = {k: self._x(n) for k, n in self.sizes.items()}
            total = sum(w.values())
            mx = sum(w[k] * x[k] for k in w) / total
            my = sum(w[k] * self.means[k] for k in w) / total
            var = sum(w[k] * (x[k] - mx) ** 2 for k in w)
            covar = sum(w[k] * (x[k] - mx) * (self.means[k] - my) for k in w)
            slope = max(0.0, covar / var) if var > 0 else 0.0
            self._fit = (mx, my, slope)
        mx, my, slope = self._fit
        return max(my + slope * (self._x(n) - mx), 1e-9)

    def state(self) -> dict[str, dict[str, float]]:
        """The per-size means, weights and sizes as JSON-able maps (`from_state`)."""
        return {
            name: {str(k): v for k, v in getattr(self, name).items()}
            for name in ("means", "weights", "sizes")
        }

    @classmethod
    def from_state(cls, state: object, what: str) -> CostLine:
        """A line read back from a file (hostile until checked): ValueError naming `what`."""
        if not isinstance(state, dict):
            raise ValueError(f"{what}: not a cost line")
        maps: list[dict[Any, Any]] = []
        for name in ("means", "weights", "sizes"):
            m = state.get(name)
            if not isinstance(m, dict) or len(m) > MAX_SIZES:
                raise ValueError(f"{what}: not a cost line of at most {MAX_SIZES} sizes")
            maps.append(m)
        if not maps[0].keys() == maps[1].keys() == maps[2].keys():
            raise ValueError(f"{what}: its sizes disagree")
        line = cls()
        for key in maps[0]:
            if not (isinstance(key, str) and key.isdigit() and 0 < int(key) < 1 << 24):
                raise ValueError(f"{what}: size {key!r} is not a token count")
            values = [m[key] for m in maps]
            if not all(isinstance(v, (int, float)) and 0 < v < 1e9 for v in values):
                raise ValueError(f"{what}: the figures at size {key} are not positive")
            k = int(key)
            line.means[k], line.weights[k], line.sizes[k] = (float(v) for v in values)
        return line

    def intercept_and_slope(self) -> tuple[float, float]:
        """(seconds at 0 tokens, seconds per token) of the fitted line."""
        at_one = self.predict(1)
        return max(at_one - (self.predict(2) - at_one), 0.0), self.predict(2) - at_one


@dataclass
class MarginalCost:
    """What a generation's own tokens cost in a target pass it shares with `sharing` - 1
    others (the marginal-cost model): its share of the pass's fixed cost (a streamed
    target's weight transfer, the launch overheads) and the slope for each of its tokens.
    Alone it is the pass line itself."""

    passes: CostLine
    sharing: float

    def predict(self, n: int) -> float:
        fixed, slope = self.passes.intercept_and_slope()
        return max(fixed / max(self.sharing, 1.0) + slope * n, 1e-9)


def half_octave(tokens: int) -> int:
    """Pass sizes to half-octaves (1, 2, 3, 4, 6, 8, 11, 16, 23, ...), so that the pass
    line keeps a handful of points however varied shared passes are (each at the mean
    size it saw)."""
    if tokens <= 4:
        return tokens
    return round(2 ** (round(2 * math.log2(tokens)) / 2))
