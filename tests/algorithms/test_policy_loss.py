import pytest
import torch

from beamrl.algorithms import (
    POLICY_LOSSES,
    ImportanceConfig,
    KLConfig,
    LossInputs,
    AlgorithmConfig,
    loss_normalizer,
)

D = torch.float64


def hand_ppo_token_loss(lp, old, adv, eps_low, eps_high):
    """Value and d/d(lp) of one token's PPO-clip loss, written out case by case."""
    import math

    r = math.exp(lp - old)
    unclipped, clipped_r = -adv * r, min(max(r, 1 - eps_low), 1 + eps_high)
    clipped = -adv * clipped_r
    if unclipped >= clipped:  # unclipped branch active: d/dlp(-adv*r) = -adv*r
        return unclipped, -adv * r
    return clipped, 0.0  # clipped branch is constant in lp


def test_ppo_clip_value_and_gradient_by_hand():
    lp = torch.tensor([-1.0, -0.5, -2.0, -1.2, -0.7, -3.0], dtype=D)
    old = torch.tensor([-1.5, -0.5, -1.0, -1.0, -1.6, -3.0], dtype=D)
    adv = torch.tensor([1.0, -0.7, -1.3, 0.4, 2.0, 5.0], dtype=D)
    mask = torch.tensor([True, True, True, True, True, False])
    cfg = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28)
    x = lp.clone().requires_grad_()
    out = POLICY_LOSSES.get("ppo_clip")(LossInputs(x, old, adv, mask, torch.zeros(6, dtype=torch.long)), cfg)
    out.loss.backward()
    vals, grads = zip(*[hand_ppo_token_loss(*map(float, t), 0.2, 0.28) for t in zip(lp, old, adv)])
    n = 5
    assert out.loss.item() == pytest.approx(sum(vals[:5]) / n, rel=1e-12)
    expected_grad = [g / n for g in grads[:5]] + [0.0]
    torch.testing.assert_close(x.grad, torch.tensor(expected_grad, dtype=D), rtol=1e-12, atol=1e-14)
    # token 0: r=e^0.5>1.28, A>0 -> clipped high; token 4: r=e^0.9, A>0 -> clipped; token 2: r=e^-1<0.8, A<0 -> clipped
    assert out.metrics["clip_fraction"].item() == pytest.approx(3 / 5)


def test_clip_higher_is_asymmetric():
    """With eps_high > eps_low, a ratio of 1.25 is clipped for eps=(0.2,0.2) but not for (0.2,0.28)."""
    lp, old, adv = torch.tensor([0.0], dtype=D), torch.tensor([-0.2231435513], dtype=D), torch.tensor([1.0], dtype=D)
    args = (torch.tensor([True]), torch.tensor([0]))
    grads = {}
    for eps_high in (0.2, 0.28):
        x = lp.clone().requires_grad_()
        cfg = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=eps_high)
        POLICY_LOSSES.get("ppo_clip")(LossInputs(x, old, adv, *args), cfg).loss.backward()
        grads[eps_high] = x.grad.item()
    assert grads[0.2] == 0.0 and grads[0.28] == pytest.approx(-1.25, rel=1e-6)
    # Lower side unaffected by eps_high: ratio 0.75 with A<0 is clipped for both.
    old_low = torch.tensor([0.2876820725], dtype=D)
    for eps_high in (0.2, 0.28):
        x = lp.clone().requires_grad_()
        cfg = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=eps_high)
        out = POLICY_LOSSES.get("ppo_clip")(LossInputs(x, old_low, -adv, *args), cfg)
        out.loss.backward()
        assert x.grad.item() == 0.0 and out.metrics["clip_fraction_low"].item() == 1.0


def _random_step(seed, n_seqs=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n_seqs,), generator=gen)
    seq_ids = torch.arange(n_seqs).repeat_interleave(lengths)
    t = len(seq_ids)
    mask = torch.rand(t, generator=gen) > 0.25
    mask[seq_ids == 3] = False  # a sequence with no loss token must not count in seq modes
    mask[seq_ids == 5] = False
    return dict(
        lp=torch.randn(t, generator=gen, dtype=D) * 0.3 - 1,
        old=torch.randn(t, generator=gen, dtype=D) * 0.3 - 1,
        rollout=torch.randn(t, generator=gen, dtype=D) * 0.3 - 1,
        ref=torch.randn(t, generator=gen, dtype=D) * 0.3 - 1,
        adv=torch.randn(n_seqs, generator=gen, dtype=D)[seq_ids],
        mask=mask,
        seq_ids=seq_ids,
        lengths=lengths,
    )


@pytest.mark.parametrize("relabel", [False, True], ids=["dense-seq-ids", "offset-seq-ids"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_three_micro_batches_equal_full_batch(aggregation, relabel):
    s = _random_step(1)
    cfg = AlgorithmConfig(
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        loss_agg=aggregation,
        importance=ImportanceConfig(mode="tis", cap=1.5),
        kl=KLConfig(coef=0.1, estimator="k3", reference=True),
    )
    loss_fn = POLICY_LOSSES.get("ppo_clip")

    def inputs(x, sl, seq_offset, normalizer):
        return LossInputs(
            logprobs=x[sl],
            old_logprobs=s["old"][sl],
            advantages=s["adv"][sl],
            loss_mask=s["mask"][sl],
            seq_ids=s["seq_ids"][sl] - seq_offset,
            rollout_logprobs=s["rollout"][sl],
            ref_logprobs=s["ref"][sl],
            normalizer=normalizer,
        )

    full_x = s["lp"].clone().requires_grad_()
    full = loss_fn(inputs(full_x, slice(None), 0, None), cfg)
    full.loss.backward()

    # Split at sequence boundaries into 3 micro-batches: seqs [0,2), [2,5), [5,7).
    bounds = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), s["lengths"]]), 0).tolist()
    # Seq ids per micro-batch: 0..n-1 (offset = first seq), or arbitrary labels (offset 1000 * k apart).
    mbs = [
        (slice(bounds[a], bounds[b]), a - (1000 * k if relabel else 0))
        for k, (a, b) in enumerate(((0, 2), (2, 5), (5, 7)))
    ]
    norm = sum(loss_normalizer(s["mask"][sl], s["seq_ids"][sl] - off, aggregation) for sl, off in mbs)
    assert norm == loss_normalizer(s["mask"], s["seq_ids"], aggregation)
    mb_x = s["lp"].clone().requires_grad_()
    total = sum(loss_fn(inputs(mb_x, sl, off, norm), cfg).loss for sl, off in mbs)
    total.backward()
    torch.testing.assert_close(total, full.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mb_x.grad, full_x.grad, rtol=1e-12, atol=1e-14)
    assert full_x.grad.abs().sum() > 0


def test_aggregation_modes_differ_as_defined():
    # Two sequences: 1 token with loss 1, 3 tokens with loss 3 each (ratio 1, A=-1 gives token loss ratio*1).
    seq_ids = torch.tensor([0, 1, 1, 1])
    adv = torch.tensor([-1.0, -3.0, -3.0, -3.0], dtype=D)
    lp = torch.zeros(4, dtype=D)
    mask = torch.ones(4, dtype=torch.bool)
    res = {}
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        res[agg] = POLICY_LOSSES.get("ppo_clip")(
            LossInputs(lp, lp, adv, mask, seq_ids), AlgorithmConfig(loss_agg=agg)
        ).loss.item()
    assert res == pytest.approx(
        {"token-mean": 10 / 4, "seq-mean-token-mean": (1 + 3) / 2, "seq-mean-token-sum": (1 + 9) / 2}
    )


def test_missing_inputs_and_bad_config_are_clear():
    x = torch.zeros(2)
    base = dict(
        logprobs=x,
        old_logprobs=x,
        advantages=x,
        loss_mask=torch.ones(2, dtype=torch.bool),
        seq_ids=torch.zeros(2, dtype=torch.long),
    )
    with pytest.raises(ValueError, match="rollout_logprobs"):
        POLICY_LOSSES.get("ppo_clip")(
            LossInputs(**base), AlgorithmConfig(importance=ImportanceConfig(mode="tis", cap=2.0)))
    with pytest.raises(ValueError, match="ref_logprobs"):
        POLICY_LOSSES.get("ppo_clip")(LossInputs(**base), AlgorithmConfig(kl=KLConfig(coef=0.1, reference=True)))
    with pytest.raises(ValueError, match="advantages"):
        LossInputs(**{**base, "advantages": torch.zeros(3)})
    with pytest.raises(ValueError, match="loss_agg"):
        AlgorithmConfig(loss_agg="mean")
    with pytest.raises(ValueError, match="eps_clip_low"):
        AlgorithmConfig(eps_clip_low=1.5)


def test_all_masked_micro_batch_gives_zero_loss_with_graph():
    x = torch.full((3,), float("nan"), dtype=D, requires_grad=True)  # padding garbage must not leak
    out = POLICY_LOSSES.get("ppo_clip")(
        LossInputs(
            x,
            torch.zeros(3, dtype=D),
            torch.ones(3, dtype=D),
            torch.zeros(3, dtype=torch.bool),
            torch.zeros(3, dtype=torch.long),
            normalizer=5.0,
        ),
        AlgorithmConfig(),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.all(x.grad == 0)


def test_garbage_in_masked_positions_never_reaches_loss_or_gradient():
    """Padding may hold NaN/-inf in any input; with TIS and a k3 KL term the result must equal a clean run."""
    mask = torch.tensor([True, False, True, False])
    seq_ids = torch.tensor([0, 0, 1, 1])
    clean = dict(lp=[-1.0, -1.0, -2.0, -1.0], old=[-1.1, -1.0, -1.9, -1.0], adv=[1.0, 1.0, -1.0, 1.0])
    dirty = dict(
        lp=[-1.0, -float("inf"), -2.0, float("nan")],
        old=[-1.1, float("nan"), -1.9, 0.0],
        adv=[1.0, float("nan"), -1.0, float("inf")],
    )
    cfg = AlgorithmConfig(importance=ImportanceConfig(mode="tis", cap=2.0),
                          kl=KLConfig(coef=0.1, estimator="k3", reference=True))
    results = []
    for v, junk in ((clean, -1.0), (dirty, -float("inf"))):
        x = torch.tensor(v["lp"], dtype=D, requires_grad=True)
        other = torch.tensor([-1.2, junk, -2.1, junk], dtype=D)
        out = POLICY_LOSSES.get("ppo_clip")(
            LossInputs(
                x,
                torch.tensor(v["old"], dtype=D),
                torch.tensor(v["adv"], dtype=D),
                mask,
                seq_ids,
                rollout_logprobs=other,
                ref_logprobs=other,
            ),
            cfg,
        )
        out.loss.backward()
        results.append((out.loss.detach(), x.grad.clone(), {k: float(m) for k, m in out.metrics.items()}))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    assert results[1][2] == pytest.approx(results[0][2])
    assert torch.isfinite(results[1][1]).all()


def test_extremes_and_count_are_declared_and_a_micro_batch_without_tokens_gives_their_identity():
    """`ratio_max`, `ratio_min` and `num_tokens` are no means: `METRIC_REDUCTIONS` says how they combine over
    micro-batches; with no loss token the extremes are -inf / +inf, so they count for nothing in a max / min."""
    from beamrl.algorithms.policy_loss import METRIC_REDUCTIONS

    lp = torch.tensor([-1.0, -0.5, -2.0, -1.2], dtype=D)
    old = torch.tensor([-1.5, -0.1, -1.0, -1.2], dtype=D)
    mask = torch.tensor([True, True, True, False])
    out = POLICY_LOSSES.get("ppo_clip")(
        LossInputs(lp, old, torch.ones(4, dtype=D), mask, torch.zeros(4, dtype=torch.long)), AlgorithmConfig())
    assert METRIC_REDUCTIONS == {"num_tokens": "sum", "ratio_max": "max", "ratio_min": "min"}
    assert set(METRIC_REDUCTIONS) <= set(out.metrics)
    ratios = (lp - old)[mask].exp()
    assert out.metrics["ratio_max"].item() == ratios.max().item()
    assert out.metrics["ratio_min"].item() == ratios.min().item()
    assert out.metrics["num_tokens"].item() == 3.0
    empty = POLICY_LOSSES.get("ppo_clip")(
        LossInputs(lp, old, torch.ones(4, dtype=D), torch.zeros(4, dtype=torch.bool),
                   torch.zeros(4, dtype=torch.long)), AlgorithmConfig())
    assert empty.metrics["ratio_max"].item() == -float("inf") and empty.metrics["ratio_min"].item() == float("inf")
    assert empty.metrics["num_tokens"].item() == 0.0
