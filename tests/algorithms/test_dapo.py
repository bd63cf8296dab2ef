import pytest
import torch

from beamrl.algorithms import OverlongConfig, filter_groups, overlong_penalty, overlong_shaped_rewards


def test_dynamic_sampling_filters_on_raw_not_shaped():
    raw = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    lengths = torch.tensor([[5, 15, 16], [5, 5, 5], [4, 4, 4]])
    cfg = OverlongConfig(enabled=True, buffer=4)
    shaped = overlong_shaped_rewards(raw, lengths, cfg, max_response_len=16)
    assert len(set(shaped[0].tolist())) == 3  # shaped differs inside group 0 ...
    assert raw[0].tolist() == [1.0, 1.0, 1.0]  # ... raw is untouched
    res = filter_groups(raw_scores=raw, target_num_groups=2)
    assert res.kept_groups.tolist() == [1]  # group 0 is all-correct: no signal, dropped despite shaped spread
    assert res.dropped_groups.tolist() == [0, 2]
    # Filtering on the shaped values would keep group 0: the API refuses positional use to make this explicit.
    with pytest.raises(TypeError):
        filter_groups(shaped, 2)


def test_dynamic_sampling_bookkeeping():
    raw = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    gids = torch.tensor([4, 4, 8, 8, 2, 2, 6, 6])  # groups in first-appearance order: 4, 8, 2, 6
    res = filter_groups(raw_scores=raw, group_ids=gids, target_num_groups=6, num_already_kept=1)
    assert res.kept_groups.tolist() == [4, 2]  # the caller's group ids, in order of first appearance
    assert res.dropped_groups.tolist() == [8, 6]
    assert res.num_needed == 3 and res.num_surplus == 0
    assert res.suggested_num_prompts == 6  # keep rate 2/4 -> need 3/0.5 prompts
    full = filter_groups(raw_scores=raw, group_ids=gids, target_num_groups=2, num_already_kept=1)
    assert full.num_needed == 0 and full.num_surplus == 1 and full.suggested_num_prompts == 0
    none = filter_groups(raw_scores=torch.ones(2, 3), target_num_groups=2, max_oversample=4)
    assert none.kept_groups.numel() == 0 and none.suggested_num_prompts == 8  # capped over-sampling
    assert none.metrics["dynamic_sampling/keep_rate"] == 0.0


def test_overlong_penalty_at_buffer_edges():
    cfg = OverlongConfig(enabled=True, buffer=20, penalty=0.5)
    lengths = torch.tensor([0, 80, 81, 90, 99, 100, 120])
    expected = [0.0, 0.0, -0.5 / 20, -0.5 * 10 / 20, -0.5 * 19 / 20, -0.5, -0.5]
    torch.testing.assert_close(overlong_penalty(lengths, cfg, max_response_len=100), torch.tensor(expected))


def test_overlong_config_validation():
    with pytest.raises(ValueError, match="buffer"):
        OverlongConfig(buffer=0)
    with pytest.raises(ValueError, match="buffer=11 must be in \\[1, max_response_len=10\\]"):
        overlong_penalty(torch.zeros(3), OverlongConfig(buffer=11), max_response_len=10)
    with pytest.raises(ValueError, match="shape"):
        overlong_shaped_rewards(torch.zeros(3), torch.zeros(2), OverlongConfig(buffer=2), max_response_len=10)
