import math

import pytest
import torch

from beamrl.algorithms import ADVANTAGES, AlgorithmConfig, per_token
from beamrl.registry import RegistryError


def brute_force_grpo(scores, groups, eps, scale_by_std, unbiased):
    out = []
    for s, g in zip(scores, groups):
        members = [x for x, h in zip(scores, groups) if h == g]
        n = len(members)
        mean = sum(members) / n
        if not scale_by_std:
            out.append(s - mean)
            continue
        var = sum((x - mean) ** 2 for x in members) / (max(n - 1, 1) if unbiased else n)
        out.append(0.0 if s == mean else (s - mean) / (math.sqrt(var) + eps))
    return out


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_grpo_matches_brute_force_with_group_ids(scale_by_std, unbiased):
    gen = torch.Generator().manual_seed(0)
    groups = torch.tensor([7, 3, 7, 3, 3, 9, 7, 3, 5])  # unequal sizes, one singleton (5)
    scores = torch.randint(0, 3, (len(groups),), generator=gen).double()
    cfg = AlgorithmConfig(normalize_std=scale_by_std)
    adv = ADVANTAGES.get("grpo")(scores, groups, cfg, eps=1e-6, unbiased_std=unbiased)
    expected = brute_force_grpo(scores.tolist(), groups.tolist(), 1e-6, scale_by_std, unbiased)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


def test_grpo_2d_layout_equals_group_id_layout():
    scores = torch.tensor([[1.0, 0.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 1.0, 3.0]])
    adv2d = ADVANTAGES.get("grpo")(scores)
    adv1d = ADVANTAGES.get("grpo")(scores.flatten(), torch.arange(3).repeat_interleave(4))
    assert adv2d.shape == scores.shape
    torch.testing.assert_close(adv2d.flatten(), adv1d)
    assert torch.all(adv2d[1] == 0)  # all-equal group: no signal, no NaN
    assert torch.isfinite(ADVANTAGES.get("grpo")(scores, eps=0.0)).all()


def test_registry_errors_and_bad_inputs():
    with pytest.raises(RegistryError, match="allowed: grpo"):
        ADVANTAGES.get("ppo")
    with pytest.raises(ValueError, match="group_ids"):
        ADVANTAGES.get("grpo")(torch.zeros(4))
    with pytest.raises(ValueError, match="eps"):
        ADVANTAGES.get("grpo")(torch.zeros(2, 2), eps=-1)


def test_per_token_broadcast():
    assert per_token(torch.tensor([1.0, -2.0]), torch.tensor([0, 0, 1, 1, 1])).tolist() == [1, 1, -2, -2, -2]
