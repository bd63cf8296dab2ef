"""The loss callables that run inside the trainer ranks build their index tensors where the batch lives."""

from types import SimpleNamespace

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
