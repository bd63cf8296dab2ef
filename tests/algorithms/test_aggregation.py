"""Loss aggregation (`beamrl.algorithms.aggregation`): what the step's denominator counts."""

import pytest
import torch

from beamrl.algorithms import loss_normalizer


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_modes_count_only_sequences_with_a_loss_token(mode):
    """A sequence without any loss token is not in a seq mode's denominator."""
    mask = torch.tensor([True, True, False, False])
    seq_ids = torch.tensor([0, 0, 1, 1])
    assert loss_normalizer(mask, seq_ids, mode) == 1.0
