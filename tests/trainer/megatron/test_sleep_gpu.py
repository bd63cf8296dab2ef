"""Trainer sleep/wake on one GPU (GPU-only): the CUDA path (page-locked host copies, CUDA storages resized to 0 and
back, the blocks returned to the driver) with the same checks as the CPU test, plus the device memory freed. (The share left asleep is model-size dependent: benchmarks/colocated_h200.sh.)"""

import pytest
import torch

from beamrl.trainer.megatron.launch import launch
from tests.trainer.megatron import _sleep_runs as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the CUDA sleep path")


def test_sleep_on_gpu_frees_the_device_and_restores_training_exactly():
    out = launch(R.sleep_cycle, 1, ("bfloat16", {}), timeout_s=540)[0]
    assert out["all_freed"] and out["independent_freed"] and out["bit_identical"], \
        {k: out[k] for k in ("all_freed", "not_freed", "independent_freed", "independent_not_freed", "bit_identical")}
    assert out["losses_sleep"] == out["losses_plain"]
    assert out["grads_zero_or_kept"] and out["grads_dropped"] and out["refused_pending"], out
    # every released byte left the device, copied or dropped (the allocator rounds blocks up: at least that much)
    assert out["allocated_awake"] - out["allocated_asleep"] >= out["released_bytes"] + out["dropped_bytes"] > 0, out
    assert out["reserved_asleep"] <= out["peak"], out  # the blocks went back to the driver
