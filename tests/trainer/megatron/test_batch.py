"""THD layout of packed micro-batches: padding to a common length and the per-token alignment of outputs."""

import pytest
import torch

from beamrl.trainer.megatron.batch import BatchError, common_length, to_thd
from beamrl.trainer.protocol import PackedBatch


def test_common_length_rounds_up_to_the_multiple():
    a = PackedBatch.from_sequences([[1, 2, 3], [4, 5]])
    b = PackedBatch.from_sequences([[1] * 7])
    assert common_length([a, b]) == 7
    assert common_length([a, b], multiple=4) == 8
    with pytest.raises(BatchError):
        common_length([])


def test_padding_is_its_own_sequence_with_free_routes():
    routes = torch.arange(5 * 3 * 2).view(5, 3, 2)
    b = PackedBatch.from_sequences([[1, 2, 3], [4, 5]], routes=[routes[:3], routes[3:]])
    thd = to_thd(b, 8, num_layers=3)
    assert thd.tokens.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert thd.cu_seqlens.tolist() == [0, 3, 5, 8] and thd.cu_seqlens.dtype == torch.int32
    assert torch.equal(thd.routes[:5], routes) and (thd.routes[5:] == -1).all()
    assert to_thd(b, 5).cu_seqlens.tolist() == [0, 3, 5]  # no padding span when it fits exactly
    with pytest.raises(BatchError, match="num_hidden_layers=4"):
        to_thd(b, 8, num_layers=4)
    with pytest.raises(BatchError, match="does not fit"):
        to_thd(b, 4)


def test_targets_and_token_alignment():
    b = PackedBatch.from_sequences([[10, 11, 12], [20, 21]])
    thd = to_thd(b, 6)
    assert thd.next_token_targets().tolist() == [[11, 12, 20, 21, 0, 0]]
    per_position = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], requires_grad=True)
    per_token = thd.to_tokens(per_position)
    # token t was predicted at position t-1; first tokens of sequences (0 and 3) get 0
    assert per_token.tolist() == [0.0, 1.0, 2.0, 0.0, 4.0]
    per_token.sum().backward()
    assert per_position.grad.tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]]
