"""Trainer sleep/wake (`beamrl.trainer.megatron.sleep`): storages really released, restored bit-exactly, and
training after a sleep/wake cycle identical to training without one (2 gloo processes, TP2+SP, distributed
optimizer, bf16 with FP32 main params)."""

import pytest

from beamrl.trainer.megatron.launch import launch
from tests.trainer.megatron import _sleep_runs as R


@pytest.mark.slow
def test_sleep_releases_everything_and_wake_restores_training_exactly():
    out = launch(R.sleep_cycle, 2, ("bfloat16",), timeout_s=540)[0]
    assert out["adam_state_tensors"] > 0  # the optimizer state existed (and was released with the rest)
    assert out["storages"] > 3 and out["released_bytes"] > 0
    assert out["all_freed"], "some released storage still has bytes"
    assert out["independent_freed"], "Adam state, main params, DDP buffers or main_grads still hold bytes"
    assert out["refused_asleep"], "a train step while asleep must be refused with a clear message"
    assert out["bit_identical"] and out["same_objects"]
    assert out["grads_zero_or_kept"] and out["grads_dropped"] and out["dropped_bytes"] > 0
    assert out["refused_pending"], "a sleep between forward_backward and optimizer_step must be refused"
    assert out["eval_for_logprobs"] and out["eval_again"] and out["train_for_step"]  # the trainer's module modes
    assert out["losses_sleep"] == out["losses_plain"]  # exact: the same bytes, the same computation
    assert len(out["losses_sleep"]) == R.K + R.N
