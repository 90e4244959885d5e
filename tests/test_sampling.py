"""Sampling: exact filtered distributions, exact penalty values, greedy as one-hot, and
seeded generators that never touch the global RNG."""

from __future__ import annotations

import math

import pytest
import torch

from speculative.sampling import (
    MIN_REPETITION_PENALTY,
    PenaltyContext,
    SamplingParams,
    apply_penalties,
    make_generator,
    probabilities,
    sample,
    top_p_filter,
)

BASE = torch.tensor([[0.5, 0.3, 0.15, 0.05]])  # (1, V), already sorted for readability


def _probs(params: SamplingParams, base: torch.Tensor = BASE) -> torch.Tensor:
    return probabilities(base.log(), params)


def _renormalised(keep: list[int], base: torch.Tensor = BASE) -> torch.Tensor:
    out = torch.zeros_like(base)
    out[0, keep] = base[0, keep]
    return out / out.sum()


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.8, [0, 1]),  # 0.5 + 0.3 reaches 0.8 exactly: the third is not needed
        (0.81, [0, 1, 2]),
        (0.95, [0, 1, 2]),
        (0.96, [0, 1, 2, 3]),
        (0.1, [0]),  # the top token is always kept
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: list[int]) -> None:
    got = _probs(SamplingParams(top_p=top_p))
    torch.testing.assert_close(got, _renormalised(kept))


# peaked rows to nearly flat ones (4 and 3: the largest 8,192, then 65,536, at top_p 0.9)
@pytest.mark.parametrize("scale", [8.0, 4.0, 3.0, 0.5, 0.01])
def test_top_p_over_the_largest_entries_keeps_what_a_whole_sort_keeps(scale: float) -> None:
    """top_p_filter sorts only a row's largest entries (TOP_P_PREFIX, eight times as many
    while they hold less than top_p's mass): at vocabulary 262,144 it keeps exactly the
    entries a sort of the whole row keeps, in a batch whose rows need prefixes of every
    size, the whole row included."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 262_144, generator=gen, dtype=torch.float64) * scale
    logits[1] *= 4  # a peaked row beside flat ones: the prefix grows for the flattest
    probs = torch.softmax(logits, -1).float()
    for top_p in (0.5, 0.9, 0.999):
        got = top_p_filter(probs, top_p)
        ordered, order = probs.sort(-1, descending=True)
        keep_sorted = (ordered.cumsum(-1) - ordered) < top_p
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        assert torch.equal(got > 0, keep)
        torch.testing.assert_close(got, probs * keep / (probs * keep).sum(-1, keepdim=True))


def test_top_p_keeps_ties_at_its_edge_whatever_the_batch() -> None:
    """Rows of bf16-rounded probabilities tie often: every token as likely as the least
    likely one kept is kept, the same set alone or beside a flat row (whose prefix grows
    to a whole sort: which tied entries a sort or a top-k put first differed, and a row's
    kept set with them)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = (torch.randn(262_144, generator=gen) * 5).to(torch.bfloat16).float()
        p = torch.softmax(logits, -1)
        flat = torch.softmax(torch.randn(262_144, generator=gen) * 0.01, -1)
        alone = top_p_filter(p[None], 0.9)[0] > 0
        batched = top_p_filter(torch.stack([p, flat]), 0.9)[0] > 0
        assert torch.equal(alone, batched)
        ordered = p.sort(descending=True).values
        count = int(((ordered.cumsum(-1) - ordered) < 0.9).sum())
        assert torch.equal(alone, p >= ordered[count - 1])  # the smallest set, and its ties


def test_top_p_does_not_depend_on_token_order() -> None:
    perm = torch.tensor([2, 0, 3, 1])
    got = top_p_filter(BASE[:, perm], 0.8)
    torch.testing.assert_close(got, _renormalised([0, 1])[:, perm])


def test_top_k() -> None:
    torch.testing.assert_close(_probs(SamplingParams(top_k=2)), _renormalised([0, 1]))
    torch.testing.assert_close(_probs(SamplingParams(top_k=1)), _renormalised([0]))
    torch.testing.assert_close(_probs(SamplingParams(top_k=10)), BASE)


def test_min_p_is_relative_to_the_top_token() -> None:
    # min_p 0.5: keep tokens with p >= 0.25 (half the top's 0.5)
    torch.testing.assert_close(_probs(SamplingParams(min_p=0.5)), _renormalised([0, 1]))
    torch.testing.assert_close(_probs(SamplingParams(min_p=0.3)), _renormalised([0, 1, 2]))


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0]])
    for t in (0.5, 1.0, 2.0):
        got = probabilities(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(got, torch.softmax(logits / t, -1))


def test_filters_apply_after_temperature() -> None:
    """top-p sees the tempered distribution (transformers' order)."""
    logits = BASE.log()
    hot = torch.softmax(logits / 2.0, -1)  # flatter: 0.8 needs three tokens now
    got = probabilities(logits, SamplingParams(temperature=2.0, top_p=0.8))
    assert hot[0, :2].sum() < 0.8 <= hot[0, :3].sum()
    torch.testing.assert_close(got, _renormalised([0, 1, 2], hot))


def test_greedy_is_one_hot_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.9], [5.0, -1.0, 4.0]])
    got = probabilities(logits, SamplingParams(temperature=0.0))
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    # Filters do not matter under greedy; penalties do (they change the argmax).
    assert SamplingParams(temperature=0.0, top_p=0.1, top_k=1).greedy


# Logits, prompt tokens and generated tokens for the penalty tests.
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])  # (1, V)
PROMPT = [1]
GENERATED = [0, 0, 2]


def _context() -> PenaltyContext:
    ctx = PenaltyContext(5, PROMPT, "cpu")
    ctx.append(GENERATED)
    return ctx


def test_repetition_penalty_exact_values() -> None:
    """HF/CTRL: seen tokens (prompt or generated) divide positive, multiply negative logits."""
    params = SamplingParams(repetition_penalty=2.0)
    got = apply_penalties(LOGITS, params, *_context().rows())
    torch.testing.assert_close(got, torch.tensor([[1.0, -2.0, 0.25, 3.0, 1.0]]))


def test_the_smallest_repetition_penalty_keeps_the_distribution_finite() -> None:
    """A seen token's positive logit divided by a penalty under ~1e-37 overflowed: two
    infinities made a NaN distribution (a 500 from the linear strategy at T=1). The
    smallest allowed penalty, with logits as large as a logit bias makes them, stays a
    distribution at any temperature; a smaller one is refused, naming the field."""
    logits = LOGITS * 50  # up to 150
    for temperature in (1.0, 1e-3, 1e-30):
        params = SamplingParams(temperature=temperature, repetition_penalty=MIN_REPETITION_PENALTY)
        probs = probabilities(logits, params, _context().rows())
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-5
    with pytest.raises(ValueError, match="repetition_penalty=1e-38 is out of range"):
        SamplingParams(repetition_penalty=1e-38)


def test_frequency_and_presence_penalties_exact_values() -> None:
    """OpenAI: logit - frequency * count - presence * [count > 0], generated tokens only."""
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(LOGITS, params, *_context().rows())
    want = torch.tensor([[2.0 - 1.0 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 3.0, 1.0]])
    torch.testing.assert_close(got, want)


def test_penalties_flow_into_the_distribution() -> None:
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0)
    got = probabilities(LOGITS, params, _context().rows())
    torch.testing.assert_close(got, torch.softmax(LOGITS - 2.0 * torch.tensor([2, 0, 1, 0, 0]), -1))
    # Greedy follows the penalised argmax: token 3 (3.0) generated twice drops to 0.0
    # under frequency 1.5, below token 4's untouched 1.0.
    ctx = _context()
    ctx.append([3, 3])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    greedy = probabilities(LOGITS, params, ctx.rows())
    assert greedy[0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_penalty_rows_add_each_rows_draft_path() -> None:
    ctx = _context()
    extra = torch.zeros(2, 5)
    extra[1, 4] = 1.0  # row 1's own draft path holds token 4 once
    counts, seen = ctx.rows(extra)
    assert counts.shape == (2, 5) and seen.shape == (2, 5)
    assert counts[0].tolist() == [2.0, 0.0, 1.0, 0.0, 0.0]
    assert counts[1].tolist() == [2.0, 0.0, 1.0, 0.0, 1.0]
    assert seen[0].tolist() == [True, True, True, False, False]
    assert seen[1].tolist() == [True, True, True, False, True]


def test_invalid_params_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"top_p=0\.0 is out of range"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature=-1 is out of range"):
        SamplingParams(temperature=-1)


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    probs = torch.softmax(torch.randn(64, 50), -1)
    state = torch.random.get_rng_state()
    a = sample(probs, make_generator(1234))
    b = sample(probs, make_generator(1234))
    c = sample(probs, make_generator(1235))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)
    unseeded = make_generator(None)
    sample(probs, unseeded)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_sample_frequencies_match_the_distribution() -> None:
    """20,000 draws in one vectorised call; each count within 5 sigma of its expectation."""
    n = 20_000
    probs = _probs(SamplingParams(top_p=0.95))  # (1, V): 0 on the last token
    tokens = sample(probs.expand(n, -1), make_generator(7))
    counts = torch.bincount(tokens, minlength=4).float()
    expected = probs[0] * n
    sigma = (n * probs[0] * (1 - probs[0])).sqrt()
    assert counts[3] == 0
    assert ((counts - expected).abs() <= 5 * sigma + 1e-9).all(), (counts, expected)
    assert math.isclose(float(counts.sum()), n)


@pytest.mark.parametrize("temperature", [1e-5, 1e-30, 1e-45, 5e-324])
def test_vanishing_temperature_is_the_greedy_limit(temperature: float) -> None:
    """logits / T overflowing float32 gave inf - inf = NaN rows (multinomial then raised)."""
    logits = torch.tensor([[1.0, 30.0, 2.0, -5.0], [7.0, 7.0, -1.0, 3.0]])
    probs = probabilities(logits, SamplingParams(temperature=temperature, top_p=0.9, min_p=0.1))
    assert torch.isfinite(probs).all()
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])  # ties share
    assert torch.allclose(probs, expected)
    # Above the threshold nothing changes: the plain division.
    assert torch.equal(
        probabilities(logits, SamplingParams(temperature=0.7)), torch.softmax(logits / 0.7, -1)
    )


def test_seed_must_fit_64_bits() -> None:
    SamplingParams(seed=-(2**63))
    SamplingParams(seed=2**64 - 1)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)


def test_position_noise_depends_on_the_position_only_and_is_shared_per_position():
    from speculative.sampling import PositionNoise

    noise = PositionNoise(make_generator(5), vocab_size=16)
    rows = noise.gumbel([7, 8, 7, 9, 8])
    assert torch.equal(rows[0], rows[2]) and torch.equal(rows[1], rows[4])
    assert not torch.equal(rows[0], rows[1])
    assert torch.equal(noise.gumbel([9])[0], rows[3])  # the same draw, whatever the batch


def test_every_bit_of_a_seed_counts() -> None:
    """The CPU generator reads a seed's low 32 bits: 5, 5 + 2**32 and 5 + 2**40 drew the
    same text. Seeds below 2**32 keep their streams; wider and negative ones are mixed
    down, so neighbours 2**32 apart (and -1 against 2**64 - 1) draw apart."""
    from speculative.sampling import generator_seed, make_generator

    def draws(seed: int) -> list[float]:
        return torch.rand(4, generator=make_generator(seed)).tolist()

    assert generator_seed(5) == 5 and generator_seed(2**32 - 1) == 2**32 - 1
    assert draws(5) == torch.rand(4, generator=torch.Generator().manual_seed(5)).tolist()
    family = [5, 5 + 2**32, 5 + 2**40, 2**63 + 5, 0, 2**63, 4, 2**64 - 1, 2**64 - 2**32]
    assert len({tuple(draws(s)) for s in family}) == len(family)
    # (a negative seed is its 64-bit two's complement: the range is 1.5 times 2**64 wide)
    assert draws(-1) == draws(2**64 - 1) and draws(-(2**63)) == draws(2**63)
    assert all(0 <= generator_seed(s) < 2**32 for s in family)
