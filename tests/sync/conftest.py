"""Engines for weight-sync tests: the native engine hosted in a child process (a real process that can be
killed), plus in-process receivers that wedge or reply success=False (fakes held to the real receivers by
test_receiver_contract.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.rollout.native.config import NativeEngineConfig
from beamrl.rollout.native.engine import NativeEngine
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.sync.process_receiver import HostedEngine


def hosted_native_engine(checkpoint: str, name: str) -> HostedEngine:
    """The native engine in a child process (so it can be killed), with the calls a sync makes."""
    cfg = NativeEngineConfig(model_path=checkpoint, dtype="float32", device="cpu", name=name)
    return HostedEngine(NativeEngine, (cfg,), name=name)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The engines' starting weights: the tiny model, seed 0, saved in fp32."""
    out = tmp_path_factory.mktemp("tiny-ckpt")
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def hosted_engine(tiny_checkpoint):
    engine = hosted_native_engine(tiny_checkpoint, name="native-engine-0")
    yield engine
    engine.shutdown()


@pytest.fixture
def trainer_model():
    """The trainer side: the same tiny model (seed 0, fp32), to be perturbed by the test."""
    torch.set_num_threads(1)
    return BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


class WedgedReceiver(LocalWeightReceiver):
    """A receiver that never answers `wedge_on` (blocks until the test releases it), like a hung engine."""

    def __init__(self, model: torch.nn.Module, wedge_on: str, name: str = "wedged"):
        super().__init__(model, name=name)
        self.release = threading.Event()
        self.wedge_on = wedge_on

    def _maybe_wedge(self, op: str) -> None:
        if op == self.wedge_on:
            with self._lock:  # stuck inside the engine: every later call waits too
                self.release.wait(600)

    def begin_weight_update(self, manifest, timeout):
        self._maybe_wedge("begin_weight_update")
        super().begin_weight_update(manifest, timeout)

    def load_staged_bucket(self, slot, index, timeout):
        self._maybe_wedge("load_staged_bucket")
        super().load_staged_bucket(slot, index, timeout)

    def abort_weight_update(self, reason, timeout):
        self._maybe_wedge("abort_weight_update")
        return super().abort_weight_update(reason, timeout)

    def init_weights_update_group(self, *args):
        self._maybe_wedge("init_weights_update_group")
        super().init_weights_update_group(*args)


class RefusingReceiver(LocalWeightReceiver):
    """Replies like SGLang does when a load fails: `(False, message)`, which must raise."""

    def staging_supported(self, timeout):
        return False

    def update_weights_from_tensor(self, bucket, timeout):
        return False, "Failed to update parameter online: shape mismatch for model.norm.weight"
