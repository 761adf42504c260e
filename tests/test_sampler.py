"""The sampler and its pieces that stand alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun import kernels
from qrun.kernels import cpu_library
from qrun.kernels.argmax import first_max_ref
from qrun.kernels.cpu_argmax import first_max_cpu
from qrun.kernels.cpu_draw import draw_cpu
from qrun.kernels.cpu_logprobs import top_logprobs_cpu
from qrun.kernels.draw import at_infinity, draw_ref, inverse_cdf, truncate
from qrun.kernels.logprobs import top_logprobs_ref
from qrun.sampler import RunSampling, logprob_entries, sample
from qrun.sampling_params import SamplingParams
from qrun.sequence import Sequence

needs_library = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels did not build here")
FIRST_MAX = [first_max_ref, pytest.param(first_max_cpu, marks=needs_library)]


@pytest.mark.parametrize("first_max", FIRST_MAX)
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 300), levels=st.integers(1, 6), nans=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_first_max_is_argmax_ties_and_nans_included(first_max, rows, width, levels, nans, seed):
    """Few distinct values, so most rows tie for their maximum: the first index wins, as argmax's;
    a row holding NaNs answers its first one."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (rows, width), generator=gen).float()
    values[values == 0] = float("-inf")
    for _ in range(nans):
        values[torch.randint(0, rows, (), generator=gen), torch.randint(0, width, (), generator=gen)] = float("nan")
    assert torch.equal(first_max(values), values.argmax(dim=-1))


@needs_library
def test_first_max_cpu_reads_a_vocabulary_and_strided_rows_as_torch_does():
    """Rows as wide as a vocabulary, with their maximum in the vectors' body, their tail, or tied
    across lanes; and a view whose rows lie apart."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 49_157, generator=gen)
    values[1, -1] = 10.0  # in the tail past the last whole vector
    values[2, [17, 33, 49_000]] = 10.0  # tied, in different lanes
    values[3] = float("-inf")
    values[4, 20_000] = float("nan")
    assert torch.equal(first_max_cpu(values), values.argmax(dim=-1))
    assert torch.equal(first_max_cpu(values[:, :1000]), values[:, :1000].argmax(dim=-1))
    assert kernels.ops_for(torch.device("cpu")).first_max is first_max_cpu  # what the sampler takes here


@needs_library
@pytest.mark.parametrize("threads", [2, 3])
def test_first_max_cpu_splits_fewer_rows_than_threads_and_still_answers_as_torch(threads):
    """One or two rows as wide as a vocabulary are split over the threads: a maximum tied across
    their spans answers the first, and a NaN in a later span beats a larger value in an earlier one."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(2, 49_157, generator=gen)
    values[0, [3, 30_000, 49_156]] = 10.0  # tied, one in each span
    values[1, 40_000] = 10.0  # in the last span alone
    poisoned = values.clone()
    poisoned[0, 5] = 20.0
    poisoned[0, 45_000] = float("nan")
    poisoned[1, 44_000] = float("inf")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (values[:1], values, poisoned[:1], poisoned, values[1:, :40_001]):
            assert torch.equal(first_max_cpu(rows), rows.argmax(dim=-1))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("params, takes_first_max", [
    (SamplingParams(temperature=0), True),
    (SamplingParams(temperature=0, repetition_penalty=50.0), False),  # penalised: the given maximum is stale
    (SamplingParams(temperature=0, min_tokens=3), False),  # its stop tokens held back
    (SamplingParams(temperature=0.8, seed=3), False),  # sampled, not greedy
])
def test_a_given_first_maximum_is_taken_only_where_nothing_rewrites_a_greedy_rows_logits(params, takes_first_max):
    """The C++ model hands its rows' first maxima to the sampler with the logits."""
    logits = torch.full((1, 8), -10.0)
    logits[0, 2] = 5.0  # the row's maximum, a token its sequence has already sampled
    logits[0, 6] = 4.0
    seq = Sequence(0, "r", 0, [1], params, detokenizer=None, arrival_time=0.0, output_token_ids=[2],
                   generator=torch.Generator().manual_seed(3) if params.seed is not None else None)
    stale = [7]  # not the argmax: only a sampler that takes the given maxima answers it
    tokens, _ = sample(logits, [seq], eos_token_ids=[2], first_max=stale)
    assert (tokens == stale) == takes_first_max
    assert sample(logits, [seq], eos_token_ids=[2])[0] != stale


def sorted_truncation(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """The definition, by a sort of each whole row: a token stays while fewer than top_k come before it, the mass
    before it (renormalized over the top-k) is at most top_p, and it has at least min_p of the top token's."""
    values, order = probs.double().sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1])
    in_top_k = ranks[None, :] < top_k[:, None]
    within = values * in_top_k
    before = (within.cumsum(dim=-1) - within) / within.sum(dim=-1, keepdim=True)
    keep = in_top_k & (before <= top_p[:, None]) & (values >= min_p[:, None] * values[:, :1])
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, order, keep)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 700), spread=st.floats(0.1, 8.0), seed=st.integers(0, 2**16),
       limits=st.lists(st.tuples(st.integers(0, 800), st.floats(0.05, 1.0), st.sampled_from([0.0, 0.0, 0.01, 0.2])),
                       min_size=4, max_size=4))
def test_truncation_keeps_each_rows_top_k_nucleus_and_min_p_sets_as_a_full_sort_defines_them(
        rows, vocab, spread, seed, limits):
    probs = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * spread).softmax(dim=-1)
    top_k = torch.tensor([min(k, vocab) if k > 0 else vocab for k, _, _ in limits[:rows]])
    top_p = torch.tensor([p for _, p, _ in limits[:rows]])
    min_p = torch.tensor([m for _, _, m in limits[:rows]])
    expected = sorted_truncation(probs, top_k, top_p, min_p)
    kept = truncate(probs, top_k, top_p, min_p) > 0
    # the two sum in different orders: they may differ only where a token's mass-before sits at top_p itself
    values, order = probs.double().sort(dim=-1, descending=True)
    before = (values.cumsum(dim=-1) - values).gather(1, order.argsort(dim=-1))
    borderline = (before / torch.where(top_k < vocab, values.cumsum(-1).gather(1, top_k[:, None] - 1).squeeze(1),
                                        1.0)[:, None] - top_p[:, None]).abs() < 1e-5
    assert torch.equal(kept | borderline, expected | borderline)
    assert kept.any(dim=-1).all() and torch.equal(truncate(probs, top_k, top_p, min_p)[kept], probs[kept])


@needs_library
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.integers(1, 2000), spread=st.floats(0.1, 8.0), seed=st.integers(0, 2**16),
       holes=st.integers(0, 5),
       limits=st.lists(st.tuples(st.floats(0.05, 2.0), st.integers(0, 2100), st.floats(0.05, 1.0),
                                 st.sampled_from([0.0, 0.0, 0.01, 0.2])), min_size=3, max_size=3))
def test_the_cpu_draw_gives_the_references_token_for_every_uniform(rows, vocab, spread, seed, holes, limits):
    """Each row drawn at 65 uniforms across [0, 1): the tokens may differ only where a uniform sits at a boundary of
    the reference's cumulative distribution, or where a token's place in the top-p or min-p set is borderline (the
    two sum and exponentiate differently)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * spread
    holes_at = torch.randint(0, rows, (holes,), generator=gen), torch.randint(0, vocab, (holes,), generator=gen)
    logits[holes_at] = -math.inf
    temperature = torch.tensor([t for t, _, _, _ in limits[:rows]])
    top_k = torch.tensor([min(k, vocab) if k > 0 else vocab for _, k, _, _ in limits[:rows]])
    top_p = torch.tensor([p for _, _, p, _ in limits[:rows]])
    min_p = torch.tensor([m for _, _, _, m in limits[:rows]])
    grid = 65
    uniforms = torch.linspace(0, 1 - 2**-53, grid, dtype=torch.float64).repeat(rows)
    args = [t.repeat_interleave(grid, dim=0) for t in (logits, temperature, top_k, top_p, min_p)] + [uniforms]
    expected, drawn = draw_ref(*args), draw_cpu(*args)
    probs = at_infinity(logits / temperature[:, None]).softmax(dim=-1)
    kept = truncate(probs, top_k, top_p, min_p).double()
    cdf = (kept.cumsum(dim=-1) / kept.sum(dim=-1, keepdim=True)).repeat_interleave(grid, dim=0)
    values, order = probs.double().sort(dim=-1, descending=True)
    in_top_k = torch.arange(vocab)[None, :] < top_k[:, None]
    within = values * in_top_k
    before = (within.cumsum(dim=-1) - within) / within.sum(dim=-1, keepdim=True)
    borderline = (((before - top_p[:, None]).abs() < 1e-4) & in_top_k).any(dim=-1)
    borderline |= ((values / values[:, :1] - min_p[:, None]).abs() < 1e-4).any(dim=-1)
    for i in torch.nonzero(expected != drawn).flatten().tolist():
        low, high = sorted((int(expected[i]), int(drawn[i])))
        at_boundary = (cdf[i, low:high] - uniforms[i]).abs().min() < 1e-5 if low >= 0 else False
        assert at_boundary or borderline[i // grid], (i, int(expected[i]), int(drawn[i]))
    assert torch.equal(drawn < 0, expected < 0) and (drawn < vocab).all()  # -1: a row of every logit -inf


@needs_library
def test_the_cpu_draw_takes_the_limit_of_infinite_rows_and_gives_minus_one_without_mass():
    logits = torch.tensor([[1.0, math.inf, 0.0, math.inf], [-math.inf] * 4, [0.0, math.nan, 1.0, 2.0],
                           [0.5, 3.0, 3.5, -1.0]])
    uniforms = torch.tensor([0.49, 0.5, 0.5, 0.0], dtype=torch.float64)
    args = (torch.ones(4), torch.tensor([4, 4, 4, 1]), torch.ones(4), torch.zeros(4), uniforms)
    assert draw_cpu(logits, *args).tolist() == draw_ref(logits, *args).tolist() == [1, -1, -1, 2]
    assert draw_cpu(logits[:1], *(a[:1] for a in args[:4]), torch.tensor([0.5], dtype=torch.float64)).item() == 3
    assert kernels.ops_for(torch.device("cpu")).draw is draw_cpu  # what the sampler takes here


@needs_library
def test_a_row_at_temperature_zero_is_not_drawn():
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    args = (torch.tensor([0.0, 1.0]), torch.tensor([3, 3]), torch.ones(2), torch.zeros(2),
            torch.tensor([0.9, 0.9], dtype=torch.float64))
    assert draw_cpu(logits, *args).tolist() == draw_ref(logits, *args).tolist() == [-1, 2]


@needs_library
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 3000), spread=st.floats(0.1, 30.0), holes=st.integers(0, 40),
       top_n=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_the_cpu_logprobs_are_the_references_for_every_row(rows, vocab, spread, holes, top_n, seed):
    """Tokens that a grammar forbids (-inf) among the rest, rows as wide as a vocabulary and as narrow as one token:
    the same values to float32 rounding of a log-sum-exp, the same likeliest tokens (random logits do not tie)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * spread
    holes_at = torch.randint(0, rows, (holes,), generator=gen), torch.randint(0, vocab, (holes,), generator=gen)
    logits[holes_at] = -math.inf
    logits[0, 0] = 1.0  # a finite row
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    top_n = min(top_n, vocab)
    (chosen, values, ids), (expected_chosen, expected_values, expected_ids) = (
        top_logprobs_cpu(logits, tokens, top_n), top_logprobs_ref(logits, tokens, top_n))
    for found, expected in ((chosen, expected_chosen), (values, expected_values)):  # -inf: a forbidden token
        finite = expected.isfinite()
        assert torch.equal(found.isfinite(), finite) and torch.equal(found.isnan(), expected.isnan())
        assert torch.allclose(found[finite], expected[finite], rtol=1e-5, atol=1e-5)
    finite = expected_values.isfinite()
    assert torch.equal(ids[finite], expected_ids[finite])
    assert (ids[~finite] == -1).all()  # fewer finite logits than top_n: the rest carry no token


@needs_library
def test_the_cpu_logprobs_take_the_limit_of_infinite_rows_and_report_nan_rows_as_nan():
    logits = torch.tensor([[1.0, math.inf, 0.0, math.inf], [-math.inf] * 4, [0.0, math.nan, 1.0, 2.0],
                           [0.5, 3.0, 3.0, -1.0]])
    tokens = torch.tensor([1, 0, 2, 2])
    entries = [logprob_entries(tokens.tolist(), [3] * 4, *top(logits, tokens, 3))
               for top in (top_logprobs_cpu, top_logprobs_ref)]
    half = -math.log(2)
    assert entries[0][0] == entries[1][0] == {1: pytest.approx(half), 3: pytest.approx(half)}
    for row in (1, 2):  # log-softmax of nothing finite, or of a NaN: NaN
        assert all(math.isnan(v) for found in entries for v in found[row].values()) and entries[0][row].keys() == {
            tokens[row].item()}
    assert list(entries[0][3]) == [2, 1, 0]  # the sampled token, then the likeliest, of equal ones the lower first
    assert entries[0][3] == pytest.approx(entries[1][3])
    assert kernels.ops_for(torch.device("cpu")).top_logprobs is top_logprobs_cpu  # what the sampler takes here


def test_logprob_entries_report_the_token_then_at_most_its_count_of_alternatives_never_a_forbidden_one():
    chosen, values = torch.tensor([-0.5, -2.0, -1.0]), torch.tensor([[-0.5, -1.0], [-0.25, -math.inf], [-1.0, -3.0]])
    ids = torch.tensor([[4, 7], [2, 5], [1, 3]])
    assert logprob_entries([4, 9, 1], [2, 2, None], chosen, values, ids) == [
        {4: -0.5, 7: -1.0}, {9: -2.0, 2: -0.25}, None]
    assert logprob_entries([4], [0], chosen[:1], values[:1], ids[:1]) == [{4: -0.5}]


def test_a_runs_sampling_that_ends_early_leaves_seeded_generators_as_the_steps_run_would():
    seqs = [Sequence(i, "r", 0, [1], SamplingParams(temperature=0.8, seed=i), detokenizer=None, arrival_time=0.0,
                     generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sampling = RunSampling(seqs, 5, vocab=8, device=torch.device("cpu"))
    temperature, top_k, top_p, min_p, uniforms, *_ = sampling.arguments
    assert uniforms.shape == (5, 2) and top_k == [8, 8] and temperature == [0.8, 0.8]
    sampling.rewind(2)
    for i, seq in enumerate(seqs):
        assert torch.rand((), dtype=torch.float64, generator=seq.generator) == uniforms[2, i]


def test_inverse_cdf_draws_tokens_in_proportion_to_their_mass_and_never_a_massless_one():
    mass = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.5, 0.5, 0.0])  # unnormalized, zeros among them
    draws = 200_000
    tokens = inverse_cdf(mass.expand(draws, -1), torch.rand(draws, dtype=torch.float64,
                                                            generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(tokens, minlength=len(mass)).double()
    expected = mass.double() / mass.sum() * draws
    assert torch.equal(counts == 0, mass == 0)
    assert ((counts - expected).abs() <= 5 * expected.sqrt() + 1).all(), (counts, expected)
    edges = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)  # the smallest and largest uniforms
    assert inverse_cdf(mass.expand(2, -1), edges).tolist() == [1, 5]


def test_sampling_follows_the_temperature_scaled_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0, 0.0]])
    params = SamplingParams(temperature=0.7, top_p=0.8, seed=5)
    seq = Sequence(0, "r", 0, [1], params, detokenizer=None, arrival_time=0.0,
                   generator=torch.Generator().manual_seed(5))
    draws = 20_000
    counts = torch.bincount(torch.tensor([sample(logits, [seq], eos_token_ids=[])[0][0] for _ in range(draws)]),
                            minlength=6).double()
    probs = (logits[0].double() / 0.7).softmax(dim=-1)
    nucleus = sorted_truncation(probs[None], torch.tensor([6]), torch.tensor([0.8]), torch.tensor([0.0]))[0]
    expected = probs * nucleus / (probs * nucleus).sum() * draws
    assert torch.equal(counts > 0, nucleus)
    assert ((counts - expected).abs() <= 5 * expected.sqrt() + 1).all(), (counts, expected)


def test_a_row_whose_penalised_logits_reach_infinity_samples_its_infinite_tokens_in_equal_shares():
    """A repetition penalty near 0 divides seen tokens' positive logits to +inf: the limit of the distribution."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    params = SamplingParams(temperature=1.0, repetition_penalty=5e-324, logprobs=1)
    seq = Sequence(0, "r", 0, [2, 1], params, detokenizer=None, arrival_time=0.0,
                   generator=torch.Generator().manual_seed(0))
    drawn = [sample(logits, [seq], eos_token_ids=[]) for _ in range(400)]
    tokens = [tokens[0] for tokens, _ in drawn]
    assert set(tokens) == {1, 2} and 120 < tokens.count(1) < 280
    assert all(logprobs[0][token] == pytest.approx(-math.log(2)) for (token,), logprobs in drawn)
    assert inverse_cdf(torch.tensor([[float("nan"), 1.0], [0.0, 0.0]]), torch.tensor([0.5, 0.5])).tolist() == [-1, -1]


def test_a_row_with_every_logit_minus_infinity_samples_a_token_of_the_vocabulary():
    logits = torch.full((1, 5), float("-inf"))
    seq = Sequence(0, "r", 0, [1], SamplingParams(temperature=0.8, top_p=0.5), detokenizer=None, arrival_time=0.0)
    [token], _ = sample(logits, [seq], eos_token_ids=[])
    assert 0 <= token < 5
