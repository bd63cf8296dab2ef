import math

import pytest
import torch

from beamrl.algorithms import IMPORTANCE_CORRECTIONS, ImportanceConfig, importance_weights

MASK = torch.tensor([True, True, True, True, False])
SEQ = torch.tensor([0, 0, 1, 1, 1])


def logps(ratios):
    """old = log(ratio) against rollout = 0, so exp(old - rollout) == ratio."""
    return torch.tensor([math.log(r) for r in ratios]), torch.zeros(len(ratios))


def test_tis_truncates_and_reports():
    old, rollout = logps([0.5, 1.0, 3.0, 1.5, 50.0])
    res = importance_weights(old, rollout, MASK, SEQ, ImportanceConfig(mode="tis", cap=2.0))
    torch.testing.assert_close(res.weights, torch.tensor([0.5, 1.0, 2.0, 1.5, 0.0]))
    assert res.kept.tolist() == MASK.tolist()
    assert float(res.metrics["truncated_fraction"]) == pytest.approx(0.25)
    expected_abs = sum(abs(math.log(r)) for r in [0.5, 1.0, 3.0, 1.5]) / 4
    assert float(res.metrics["train_rollout_logprob_abs_diff"]) == pytest.approx(expected_abs, rel=1e-6)
    assert float(res.metrics["ratio_mean"]) == pytest.approx((0.5 + 1 + 3 + 1.5) / 4, rel=1e-6)


def test_mis_token_level_masks_out_of_range():
    old, rollout = logps([0.4, 1.0, 3.0, 1.5, 50.0])
    res = importance_weights(old, rollout, MASK, SEQ, ImportanceConfig(mode="mis", lo=0.5, hi=2.0))
    assert res.kept.tolist() == [False, True, False, True, False]
    torch.testing.assert_close(res.weights, torch.tensor([0.0, 1.0, 0.0, 1.5, 0.0]))
    assert float(res.metrics["masked_fraction"]) == pytest.approx(0.5)


def test_mis_sequence_level_uses_geometric_mean():
    # seq 0: ratios 0.4 and 2.5 -> geometric mean 1.0 (kept although both tokens are out of range)
    # seq 1: ratios 3.0 and 1.5 (the masked 50 is ignored) -> sqrt(4.5) = 2.12 > 2 (whole seq masked)
    old, rollout = logps([0.4, 2.5, 3.0, 1.5, 50.0])
    cfg = ImportanceConfig(mode="mis", lo=0.5, hi=2.0, level="sequence")
    res = IMPORTANCE_CORRECTIONS.get("mis")(old, rollout, MASK, SEQ, cfg)
    assert res.kept.tolist() == [True, True, False, False, False]
    torch.testing.assert_close(res.weights, torch.tensor([0.4, 2.5, 0.0, 0.0, 0.0]))


def test_config_validation():
    with pytest.raises(ValueError, match="lo=2.0: MIS masks tokens with weight outside"):
        ImportanceConfig(mode="mis", lo=2.0, hi=1.0)
    with pytest.raises(ValueError, match="unknown importance correction 'icepop'; allowed: none, mis, tis"):
        ImportanceConfig(mode="icepop")
