"""When a rollout batch that lost samples (rewards with on_error: skip) can still be trained on, by the rule that cuts
micro-batches (the loop skips the update of one that cannot: it raised mid-run before)."""

from beamrl.trainer.batching import micro_batch_count, trainable


def test_micro_batches_are_a_multiple_of_dp():
    assert [micro_batch_count(n, 8, 2) for n in (1, 8, 16, 24, 40)] == [2, 2, 2, 2, 4]


def test_a_batch_too_small_for_the_layout_is_not_trainable():
    assert trainable(64, 64, 64, 1) and trainable(1, 64, 64, 1)  # one sample still makes a micro-batch
    assert not trainable(0, 64, 64, 1)
    assert not trainable(1, 64, 8, 2) and trainable(2, 64, 8, 2)  # every DP rank needs a sample
    assert not trainable(31, 64, 16, 1, min_micro_per_rank=2)  # vpp: pp micro-batches per rank
    assert trainable(32, 64, 16, 1, min_micro_per_rank=2) and trainable(128, 64, 16, 1, min_micro_per_rank=2)
