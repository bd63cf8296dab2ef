"""PackedBatch: validation messages name the field; packing helpers keep per-token alignment."""

import pytest
import torch

from beamrl.trainer.protocol import BatchError, PackedBatch, TrainStepResult


def test_from_sequences_packs_and_masks_first_tokens():
    b = PackedBatch.from_sequences([[5, 6, 7], [8, 9]], loss_masks=[[1, 1, 1], [0, 1]],
                                   fields={"adv": [[0.5] * 3, [-1.0] * 2]})
    assert b.tokens.tolist() == [5, 6, 7, 8, 9]
    assert b.cu_seqlens.tolist() == [0, 3, 5]
    assert b.seqlens == [3, 2] and b.num_sequences == 2 and b.num_tokens == 5
    # the first token of each sequence is never predicted, whatever the caller's mask says
    assert b.loss_mask.tolist() == [0, 1, 1, 0, 1]
    assert b.num_loss_tokens == 3
    assert b.fields["adv"].tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]
    assert [s.tolist() for s in b.sequences()] == [[5, 6, 7], [8, 9]]


@pytest.mark.parametrize("kwargs, field", [
    (dict(tokens=torch.tensor([[1, 2]]), cu_seqlens=[0, 2]), "tokens"),
    (dict(tokens=torch.tensor([1.0, 2.0]), cu_seqlens=[0, 2]), "tokens"),
    (dict(tokens=torch.tensor([1, 2, 3]), cu_seqlens=[0, 2]), "cu_seqlens"),
    (dict(tokens=torch.tensor([1, 2, 3]), cu_seqlens=[0, 0, 3]), "cu_seqlens"),
    (dict(tokens=torch.tensor([1, 2, 3]), cu_seqlens=[0, 3], loss_mask=torch.ones(2)), "loss_mask"),
    (dict(tokens=torch.tensor([1, 2, 3]), cu_seqlens=[0, 3], fields={"adv": torch.ones(4)}), "fields['adv']"),
    (dict(tokens=torch.tensor([1, 2, 3]), cu_seqlens=[0, 3], routes=torch.zeros(3, 2)), "routes"),
    (dict(tokens=torch.tensor([1, 2, 3]), cu_seqlens=[0, 3], routes=torch.zeros(3, 2, 4)), "routes"),
])
def test_invalid_batches_name_the_field(kwargs, field):
    with pytest.raises(BatchError, match=f"PackedBatch.{field}".replace("[", r"\[").replace("]", r"\]")):
        PackedBatch(**kwargs)


def test_train_step_result_as_dict():
    r = TrainStepResult(loss=1.5, grad_norm=0.25, lr=1e-6, num_micro_batches=4, metrics={"kl": 0.1})
    assert r.as_dict() == {"loss": 1.5, "grad_norm": 0.25, "lr": 1e-6, "num_micro_batches": 4.0, "skipped": 0.0,
                           "kl": 0.1}


def test_a_pickled_batch_crosses_as_numpy_arrays_and_comes_back_bit_for_bit():
    """Batches go to the trainer's actors every step: CPU tensors are pickled as numpy arrays (a tenth of a torch
    tensor's pickling cost) and rebuilt with the same dtype, shape and bits, writable; bfloat16 (no numpy dtype)
    crosses as a tensor."""
    import pickle

    import numpy as np

    batch = PackedBatch.from_sequences([[1, 2, 3], [4, 5]], loss_masks=[[0, 1, 1], [0, 1]])
    batch.fields = {"advantages": torch.randn(5), "ref": torch.randn(5).to(torch.bfloat16)}
    batch.routes = torch.randint(0, 8, (5, 2, 3), dtype=torch.int32)
    state = batch.__getstate__()
    assert isinstance(state["tokens"].array, np.ndarray) and isinstance(state["fields"]["advantages"].array, np.ndarray)
    assert torch.is_tensor(state["fields"]["ref"])
    back = pickle.loads(pickle.dumps(batch, protocol=5))
    pairs = [(batch.tokens, back.tokens), (batch.cu_seqlens, back.cu_seqlens), (batch.loss_mask, back.loss_mask),
             (batch.routes, back.routes)] + [(batch.fields[k], back.fields[k]) for k in batch.fields]
    for a, b in pairs:
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    back.loss_mask[0] = 1.0  # writable
    assert sorted(back.fields) == ["advantages", "ref"]
    # Ray reads arrays zero-copy from its object store, read-only: the rebuilt tensor is a writable copy.
    from beamrl.trainer.protocol import _WireArray

    ro = np.arange(3)
    ro.flags.writeable = False
    t = _WireArray(ro).tensor()
    t[0] = 7
    assert ro[0] == 0 and t.tolist() == [7, 1, 2]


def test_metric_reductions_are_read_from_the_loss_function_and_checked():
    from types import SimpleNamespace

    from beamrl.trainer.protocol import metric_reductions

    assert metric_reductions(lambda lp, ent, batch: None) == {}  # none declared: every metric is summed
    assert metric_reductions(SimpleNamespace(metric_reductions={"n": "sum", "hi": "max", "lo": "min"})) == \
        {"n": "sum", "hi": "max", "lo": "min"}
    with pytest.raises(ValueError, match="metric_reductions"):
        metric_reductions(SimpleNamespace(metric_reductions={"x": "mean"}))
    with pytest.raises(ValueError, match="metric_reductions"):
        metric_reductions(SimpleNamespace(metric_reductions={"loss": "max"}))  # the loss is always summed
