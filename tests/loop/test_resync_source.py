"""A restarted engine's resync sends what every sync of that trainer sends: with LoRA, the adapters (it sent the
full export, which excludes the adapters, so a restarted LoRA engine served the base weights under the current
version). The orchestrator is a recorder here; the real resync runs in tests/loop/test_faults.py."""

from types import SimpleNamespace

import pytest

from beamrl.loop import weight_sync as W
from beamrl.models.beam.lora_config import LoRAConfig


class _Recorder:
    def __init__(self):
        self.sources = []

    def sync(self, source, engines=None, version=0):
        self.sources.append(type(source))


@pytest.mark.parametrize("lora", [None, LoRAConfig()], ids=["full", "lora"])
def test_a_resync_sends_what_every_sync_sends(monkeypatch, lora):
    trainer = SimpleNamespace(lora=lora, export_lora_layout=lambda: [], export_hf_layout=lambda: [])
    recorder = _Recorder()
    monkeypatch.setattr(W, "_orchestrator", lambda *args, **kwargs: recorder)
    request = W.SyncRequest(3, "shm", 1, 60.0)
    W.sync_on_rank(trainer, 1, [], [], [], request)  # rank 1: no engine to replace
    W.resync_on_rank(trainer, 1, [], [], [], 0, request)
    expected = W.LoRAExportSource if lora is not None else W.MegatronExportSource
    assert recorder.sources == [expected, expected]
