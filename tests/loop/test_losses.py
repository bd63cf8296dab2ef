"""The loss callables that run inside the trainer ranks build their index tensors where the batch lives, and hand
their metrics to the trainer ready for its reductions."""

from types import SimpleNamespace

import pytest
import torch

from beamrl.loop.losses import _local_seq_ids


def test_sequence_ids_of_a_packed_micro_batch():
    batch = SimpleNamespace(cu_seqlens=torch.tensor([0, 3, 5, 9]), tokens=torch.zeros(9, dtype=torch.int64))
    assert _local_seq_ids(batch).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_sequence_ids_are_made_on_the_batch_device():
    # On the H200 the first RL step failed: the ids were made on the CPU while the batch was on cuda:0. The meta
    # device stands in for "another device than the CPU" here (shape-only tensors; no values needed).
    batch = SimpleNamespace(cu_seqlens=torch.tensor([0, 3, 5, 9]).to("meta"),
                            tokens=torch.zeros(9, dtype=torch.int64, device="meta"))
    ids = _local_seq_ids(batch)
    assert ids.device.type == "meta" and ids.shape == (9,)


def test_policy_loss_weights_the_means_by_token_share_and_leaves_the_declared_reductions_as_they_are():
    """The trainer sums the means (weighted by the micro-batch's share of the step's loss tokens) and reduces the
    metrics of `PolicyLoss.metric_reductions` by their own op, so those reach it unweighted."""
    from beamrl.algorithms import AlgorithmConfig
    from beamrl.loop.losses import PolicyLoss
    from beamrl.trainer.protocol import PackedBatch, metric_reductions

    batch = PackedBatch.from_sequences([[1, 2, 3, 4], [5, 6, 7]], loss_masks=[[0, 1, 1, 1], [0, 1, 1]],
                                       fields={"advantages": [[1.0] * 4, [-1.0] * 3],
                                               "old_logprobs": [[0.0, -1.0, -2.0, -0.5], [0.0, -1.5, -1.0]]})
    lp = torch.tensor([0.0, -1.2, -1.0, -0.5, 0.0, -1.0, -1.1])
    loss = PolicyLoss(AlgorithmConfig(), normalizer=20.0, total_loss_tokens=20.0)  # this micro-batch: 5 of 20
    assert metric_reductions(loss) == {"num_tokens": "sum", "ratio_max": "max", "ratio_min": "min"}
    _, metrics = loss(lp, None, batch)
    ratio = (lp - batch.fields["old_logprobs"])[batch.loss_mask > 0].exp()
    assert metrics["num_tokens"].item() == 5.0
    assert metrics["ratio_max"].item() == pytest.approx(ratio.max().item())
    assert metrics["ratio_min"].item() == pytest.approx(ratio.min().item())
    assert metrics["ratio_mean"].item() == pytest.approx(ratio.mean().item() * 5 / 20)
