"""Suite-wide test settings: CPU only, deterministic, no compile, quiet third-party logs."""

import os

# Megatron's jit_fuser becomes torch.compile; the first compile of a tiny op costs seconds on CI.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("BEAMRL_TEST_THREADS", "2")))


@pytest.fixture
def tiny_config():
    from beamrl.models.beam import preset

    return preset("tiny")
