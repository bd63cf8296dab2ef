import pytest
import torch

from beamrl.algorithms import KL_ESTIMATORS, KLConfig, kl_penalized_scores

D = torch.float64
P = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=D)
Q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=D)
ANALYTIC_KL = float((P * (P / Q).log()).sum())  # KL(P || Q)


def est(name, idx):
    return KL_ESTIMATORS.get(name)(P.log()[idx], Q.log()[idx])


def test_registry_names():
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_exact_expectation(name):
    expectation = float((P * est(name, torch.arange(4))).sum())
    assert expectation == pytest.approx(ANALYTIC_KL, rel=1e-12)


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_monte_carlo(name):
    gen = torch.Generator().manual_seed(1234)
    idx = torch.multinomial(P, 200_000, replacement=True, generator=gen)
    vals = est(name, idx)
    stderr = float(vals.std()) / len(idx) ** 0.5
    assert abs(float(vals.mean()) - ANALYTIC_KL) < 4 * stderr


def test_k2_and_k3_nonnegative_and_k2_biased_low():
    vals2, vals3 = est("k2", torch.arange(4)), est("k3", torch.arange(4))
    assert torch.all(vals2 >= 0) and torch.all(vals3 >= 0)
    assert float((P * vals2).sum()) != pytest.approx(ANALYTIC_KL, rel=1e-3)  # k2 is not unbiased here


def test_k2_loss_gradient_equals_kl_gradient():
    """As a loss (samples from p held fixed), E_p[grad k2] = grad KL(p||q): check with exact expectation."""
    logits = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=D, requires_grad=True)
    logp = torch.log_softmax(logits, 0)
    surrogate = (logp.exp().detach() * KL_ESTIMATORS.get("k2")(logp, Q.log())).sum()
    (g_k2,) = torch.autograd.grad(surrogate, logits)
    logp = torch.log_softmax(logits, 0)
    (g_kl,) = torch.autograd.grad((logp.exp() * (logp - Q.log())).sum(), logits)
    torch.testing.assert_close(g_k2, g_kl, rtol=1e-12, atol=1e-14)


def test_kl_config_validation_and_clamp():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; allowed: k1, k2, k3"):
        KLConfig(estimator="k4")
    with pytest.raises(ValueError, match="coef"):
        KLConfig(coef=-1)


def test_kl_in_reward_subtracts_sequence_kl():
    logprobs = torch.tensor([-1.0, -1.0, -2.0, -0.5], dtype=D)
    ref = torch.tensor([-1.5, -1.0, -1.0, -0.5], dtype=D)
    mask = torch.tensor([True, True, True, False])
    seq_ids = torch.tensor([0, 0, 1, 1])
    scores = torch.tensor([1.0, 0.0], dtype=D)
    shaped, metrics = kl_penalized_scores(scores, logprobs, ref, mask, seq_ids, KLConfig(coef=0.5, estimator="k1"))
    torch.testing.assert_close(shaped, torch.tensor([1.0 - 0.5 * 0.5, 0.0 - 0.5 * -1.0], dtype=D))
    assert scores.tolist() == [1.0, 0.0]  # input untouched
    assert "kl_in_reward/seq_kl_mean" in metrics
