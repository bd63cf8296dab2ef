"""Express calls and the trainer (the GPU case GPU-only): a trainer called through its express server, on the server's thread, trains
bit for bit as when called on the main thread, on the main thread's CUDA device (the current device is per thread:
the server sets the one its opener had)."""

import pytest
import torch

from beamrl.trainer.megatron.launch import launch
from tests.loop import _express_trainer_runs as R


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: Megatron on CUDA from another thread")
def test_a_trainer_trains_the_same_through_its_express_server_on_gpu():
    _same_through_express("bfloat16")


def test_a_trainer_trains_the_same_through_its_express_server_on_cpu():
    _same_through_express("float32")


def _same_through_express(dtype: str) -> None:
    out = launch(R.direct_and_express, 1, (dtype,), timeout_s=540)[0]
    assert out["express"]["thread"].startswith("beamrl-express-gpu-test")  # it ran on the server's thread
    assert out["express"]["device"] == out["main_device"]
    assert out["express"]["losses"] == out["direct"] and len(out["direct"]) == R.STEPS
