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
