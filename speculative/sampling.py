"""Logits → the final sampling distribution, as pure, batched functions.

Order (as in transformers and vLLM): penalties, temperature, top-k, top-p, min-p, softmax.
Temperature 0 is greedy: the distribution is one-hot on the (penalised) argmax, so the
speculative acceptance rules need no special case for it. Every request samples with its
own seeded `torch.Generator`; nothing touches the global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from modeling.errors import RequestError

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


# The smallest repetition penalty: a seen token's positive logit is divided by it, and below
# about 1e-37 that overflowed float32 (inf - inf: NaN in the softmax, a 500 at T > 0). At
# 0.01 a logit grows a hundredfold, past any use.
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's next-token distribution at
    its position (the model's own distribution: log-softmax of its logits, before
    temperature, penalties or top-k/p), and the most likely alternatives there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, log-probability), most likely first
    # Where the token's text begins in the generation's text, in characters (set by
    # speculative/generation.py; None before): the completions' `text_offset`.
    start: int | None = None


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`logits` (V,): the target's at the position `token` was drawn for."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
    best = torch.topk(logp, top) if top else None
    # Tokens a grammar forbids (-inf) are no alternatives: fewer than `top` may remain.
    alternatives = (
        [
            (t, lp)
            for t, lp in zip(best.indices.tolist(), best.values.tolist(), strict=True)
            if lp != float("-inf")
        ]
        if best is not None
        else []
    )
    return TokenLogprob(token, float(logp[token]), alternatives)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and generated tokens
    presence_penalty: float = 0.0  # OpenAI style, over generated tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before anything else,
    # sorted by id. A penalty of its own kind (fixed, not counted), applied wherever the
    # penalties are, so every strategy samples the biased distribution exactly.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities of each emitted token and of this many most likely alternatives
    # (0..MAX_TOP_LOGPROBS); None: not asked for. Not a sampling setting: nothing sampled
    # changes with it.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", 0.0 <= self.temperature <= 2.0, "in [0, 2], as the OpenAI API"),
            ("top_k", self.top_k >= 0, "0 (off) or a positive integer"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            (
                "repetition_penalty",
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0,
                f"in [{MIN_REPETITION_PENALTY}, 10]",
            ),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**64, "a 64-bit integer"),
            (
                "logit_bias",
                all(i >= 0 and -100.0 <= b <= 100.0 for i, b in self.logit_bias),
                "token ids → biases in [-100, 100]",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"0..{MAX_TOP_LOGPROBS} alternatives, or None",
            ),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise RequestError(
                    f"{name}={getattr(self, name)!r} is out of range: must be {allowed}", name
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are changed before temperature (penalties, logit_bias)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )


class PenaltyContext:
    """Token counts that penalties depend on: which tokens the prompt holds, and how often
    each was generated so far. Speculative strategies extend it along draft paths."""

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int], device: torch.device | str):
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if len(prompt_ids):
            self.in_prompt[torch.as_tensor(list(prompt_ids), device=device)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def copy(self) -> PenaltyContext:
        """The counts as they are now, apart from later appends."""
        twin = PenaltyContext.__new__(PenaltyContext)
        twin.in_prompt, twin.counts = self.in_prompt, self.counts.clone()
        return twin

    def append(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.counts[t] += 1

    def rows(self, extra_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, seen) for N rows: the generated counts so far plus `extra_counts` (N, V),
        the tokens on each row's own draft path."""
        counts = self.counts[None, :] if extra_counts is None else self.counts + extra_counts
        return counts, (counts > 0) | self.in_prompt


def path_counts(tokens: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(len(tokens) + 1, V): row j counts t_1..t_j, the drafted tokens before position j;
    the penalties at each verified position see exactly the chain above it."""
    counts = torch.zeros(len(tokens) + 1, vocab_size, device=device)  # (k+1, V)
    for j, t in enumerate(tokens):
        counts[j + 1 :, t] += 1
    return counts


def apply_penalties(
    logits: torch.Tensor,  # (N, V)
    params: SamplingParams,
    counts: torch.Tensor,  # (N, V) or (1, V): times each token was generated
    seen: torch.Tensor,  # (N, V) or (1, V) bool: in the prompt or generated
) -> torch.Tensor:
    if params.logit_bias:  # first, as OpenAI adds it to the model's logits
        ids = torch.tensor([i for i, _ in params.logit_bias], device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], device=logits.device)
        logits = logits.index_add(-1, ids, bias.to(logits.dtype).expand(logits.shape[0], -1))
    if params.repetition_penalty != 1.0:
        # Shrink the logits of seen tokens towards "less likely" whatever their sign.
        penalised = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def probabilities(
    logits: torch.Tensor,  # (N, V) fp32
    params: SamplingParams,
    penalties: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The exact distribution a token is drawn from, (N, V), rows summing to 1."""
    logits = logits.float()
    if penalties is not None and params.has_penalties:
        logits = apply_penalties(logits, params, *penalties)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = _scale(logits, params.temperature)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# Below this temperature, logits / T may overflow float32 (and a scalar under ~1e-45 rounds
# to 0): inf - inf is NaN in the softmax. Such temperatures take the overflow-free path.
TINY_TEMPERATURE = 1e-4


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T, (N, V). For a tiny T the logits are shifted so the row maximum is 0 first
    (softmax does not change) and the maximum stays exactly 0 even when T underflows, so the
    result is the greedy limit (uniform over tied maxima) instead of NaN."""
    if temperature >= TINY_TEMPERATURE:
        return logits / temperature
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # (N, V) <= 0
    return torch.where(shifted == 0, shifted, shifted / temperature)


class PositionNoise:
    """Randomness keyed by absolute position, for strategies that sample the target exactly
    (autoregressive, the tree walk, the prefix-cache walk).

    The token at sequence position t is argmax(log p_t + g_t), with Gumbel noise g_t made
    from (seed, t) alone: the Gumbel-max trick, so it is exactly a draw from p_t, and g_t is
    independent of p_t (which depends only on earlier positions). Two tree nodes at the same
    depth share g_t, but a walk visits one node per position, so draws stay independent
    along any path. What this buys: with the same seed, the text no longer depends on which
    strategy produced p_t, on how the tree happened to be shaped, or on whether the session
    was fresh — autoregressive and tree decoding give the same sample."""

    def __init__(self, generator: torch.Generator, vocab_size: int) -> None:
        # One draw from the request's generator fixes every position's noise.
        self.seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        self.vocab_size = vocab_size
        self.device = generator.device

    def gumbel(self, positions: Sequence[int]) -> torch.Tensor:
        """(N, V) float64 Gumbel noise for the given absolute positions. A tree has many
        nodes per depth, so each distinct position is generated once and rows are shared."""
        distinct = sorted(set(positions))
        rows = []
        for t in distinct:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((self.seed * 0x9E3779B97F4A7C15 + t) % 2**64)
            u = torch.rand(self.vocab_size, generator=gen, device=self.device, dtype=torch.float64)
            rows.append(-torch.log(-torch.log(u)))
        noise = torch.stack(rows)  # (distinct, V)
        if len(distinct) == len(positions) and list(positions) == distinct:
            return noise
        index = {t: i for i, t in enumerate(distinct)}
        return noise[torch.tensor([index[t] for t in positions], device=noise.device)]


# Bytes per vocabulary entry that drawing ONE row allocates at its peak, traced through
# `draw` on its largest path: penalties on (their `seen` mask, 1, lives until the draw
# returns), then the Gumbel draw of PositionNoise: the final distribution (fp32, 4), its
# fp64 log (8), and while the noise row is made the fp64 uniforms with two fp64
# temporaries of -log(-log u) (24). The top-p filter's peak is below it (the logits and
# the distribution, sorted values, int64 order, mass before each, three boolean masks and
# two renormalised copies: 36 with `seen`), so is everything before it. The walks (tree,
# prefix cache, a plain step) draw one row at a time beside the pass's logits: the memory
# plan reserves this for that draw (daemon/footprint.py). Rejection verification
# (speculative/verification.py) holds more at a node with children: the target's final
# distribution (4) while the draft's is made from its stored row: that row in fp32 (4),
# its penalty counts with the node's path (4) and `seen` (1), then the same top-p peak
# less its input (31): 44; after that only (V,) rows (p, q, the residual's two steps).
# Under a grammar the row drawn from is a masked copy (4, speculative/grammar.py; making
# it takes about 3 more before the draw starts): the walk's draw then peaks at 41,
# top-p's at 40, both within 44.
DRAW_BYTES_PER_ENTRY = 44


def draw(
    logits: torch.Tensor,  # (N, V) fp32
    params: SamplingParams,
    penalties: PenaltyContext | None,
    noise: PositionNoise | torch.Generator,
    extra_counts: torch.Tensor | None = None,  # (N, V): tokens on each row's own draft path
    positions: Sequence[int] | None = None,  # with PositionNoise: each row's token position
) -> torch.Tensor:
    """One token per row from its final distribution, (N,). Greedy without penalties is the
    raw argmax: exactly what the one-hot distribution would give, without building it."""
    if params.greedy and not params.has_penalties:
        return logits.argmax(-1)
    rows = penalties.rows(extra_counts) if penalties is not None else None
    probs = probabilities(logits, params, rows)
    if params.greedy:
        return probs.argmax(-1)
    if isinstance(noise, PositionNoise):
        if positions is None or len(positions) != probs.shape[0]:
            raise ValueError("position-keyed sampling needs one position per row")
        return (probs.double().log() + noise.gumbel(positions)).argmax(-1)
    return sample(probs, noise)


# The most likely entries top-p first looks at: a model's row mostly holds top_p's mass in
# far fewer, and sorting a whole row of 262,144 took 23 ms on one core against 1-2 ms for
# its largest 1,024 (scripts/bench_sampling.py). Where they hold less than half of top_p
# the row is flat and the whole row is sorted at once; else eight times as many are
# looked at, until they hold it.
TOP_P_PREFIX = 1024


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p` (always at
    least the top token) and every token as likely as its least likely one, renormalised.
    Only the largest entries are sorted: once the `k` largest of every row hold `top_p`'s
    mass, every entry after them has at least that much mass before it and is dropped, as
    a sort of the whole row would drop it. Ties at the edge are all kept: which of equal
    entries a sort puts first differs between a sort and a top-k, so a row's kept set
    depended on its batch's (bf16 logits tie often), and a chain's rows, verified in one
    batch, could keep other tokens than decoding them one by one."""
    vocab = probs.shape[-1]
    k = min(vocab, TOP_P_PREFIX)
    while True:
        if 8 * k > vocab:
            k = vocab
        largest, order = (
            probs.sort(dim=-1, descending=True) if k == vocab else probs.topk(k, dim=-1)
        )  # (N, k) descending
        mass = largest.cumsum(-1)
        held = mass[..., -1]
        if k == vocab or bool((held >= top_p).all()):
            break
        k = vocab if bool((held < top_p / 2).any()) else 8 * k
        del largest, order, mass, held
    keep_largest = (mass - largest) < top_p  # the mass before each: a prefix of the order
    keep_largest[..., 0] = True
    last = keep_largest.sum(-1, keepdim=True) - 1  # (N, 1) the least likely kept
    edge = largest.gather(-1, last)  # (N, 1)
    del largest, order, mass, keep_largest
    probs = probs * (probs >= edge)
    return probs / probs.sum(-1, keepdim=True)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for one rejected position, (V,). A rejection can only happen
    where p(t) < q(t), so the residual has mass; rounding aside, where it has none, p is
    the answer (then p == q)."""
    residual = torch.clamp(p - q, min=0.0)  # (V,)
    mass = residual.sum()
    return residual / mass if mass > 0 else p


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own RNG; without a seed it is seeded from the OS."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(generator_seed(seed))
    return gen


def generator_seed(seed: int) -> int:
    """A request's 64-bit seed as the generator's: the CPU generator reads only a seed's low
    32 bits (5, 5 + 2**32 and 5 + 2**40 drew the same text, an attacker found), so a seed
    from 0 to 2**32 - 1 is itself, and any other (negative ones as their 64-bit two's
    complement) is mixed down to 32 bits (splitmix64's finaliser): distinct seeds then
    share a stream only by the chance of a 32-bit collision."""
    if 0 <= seed < 1 << 32:
        return seed
    x = seed & (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (1 << 64) - 1
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (1 << 64) - 1
    return (x ^ (x >> 31)) & (1 << 32) - 1


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` (N, V) → (N,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
