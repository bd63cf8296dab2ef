"""The native engine's sampler: truncation rules vs brute force, exact sampling distribution, seed behaviour."""

import torch

from beamrl.rollout.native.sampler import RowSampling, hashed_uniform, sample, truncation_mask


def _brute_keep(p, k, top_p):
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    kept, cum = set(), 0.0
    for rank, i in enumerate(order):
        if rank >= k:
            break
        if cum > top_p:
            break
        kept.add(i)
        cum += p[i]
    return kept


def test_truncation_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        probs = torch.softmax(3 * torch.randn(1, 12, generator=g), -1)
        k = int(torch.randint(1, 13, (1,), generator=g))
        p = float(torch.rand(1, generator=g))
        keep = truncation_mask(probs, torch.tensor([k]), torch.tensor([p]))
        assert set(keep[0].nonzero().flatten().tolist()) == _brute_keep(probs[0].tolist(), k, p)


def test_top_p_keeps_the_token_whose_preceding_mass_is_exactly_top_p():
    """SGLang's rule: a token is dropped only when the mass before it exceeds top_p; exactly top_p is kept."""
    keep = truncation_mask(torch.tensor([[0.5, 0.25, 0.25]]), torch.tensor([3]), torch.tensor([0.5]))
    assert keep.tolist() == [[True, True, False]]


def test_sampling_frequencies_follow_the_truncated_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 8000
    params = RowSampling(torch.ones(n), torch.full((n,), 3), torch.ones(n), torch.arange(n))
    tokens, logprobs = sample(logits.expand(n, 4), params, torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=4).float() / n
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert (freq - expected).abs().max() < 0.02, freq
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tokens])  # before truncation


def test_uniforms_depend_only_on_seed_step_token():
    a = hashed_uniform(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 5]), 50)
    b = hashed_uniform(torch.tensor([1]), torch.tensor([0]), 50)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and (a < 1).all()
    big = hashed_uniform(torch.tensor([2**62 + 3]), torch.tensor([7]), 100_000)
    assert abs(big.mean().item() - 0.5) < 0.01
