"""The in-process SGLang engine watches and stops only the processes it started, never its caller's multiprocessing
resource tracker (which SGLang's spawn starts; it ignores SIGTERM, so a shutdown waited out its 5 s grace and then
SIGKILLed a helper the caller still uses). In a fresh interpreter, where nothing has started the tracker yet: in the
test process another test's spawn may already have started it, and the check could not fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = r"""
import json, sys
from multiprocessing import resource_tracker

import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.processes import running
from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.rollout.sglang.engine import SGLangEngine


def main():
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).save_pretrained(sys.argv[1])
    engine = SGLangEngine(SGLangEngineConfig.on_cpu(sys.argv[1], dtype="float32"), start_timeout=600)
    claimed = engine.child_pids
    engine.shutdown()
    tracker = resource_tracker._resource_tracker._pid  # private, but the only record of the tracker's pid
    print(json.dumps({"claimed": claimed, "tracker": tracker, "tracker_alive": tracker is not None and running(tracker),
                      "claimed_alive": [p for p in claimed if running(p)]}))


if __name__ == "__main__":
    main()
"""


def test_the_engine_claims_only_the_processes_it_started(tmp_path):
    script = tmp_path / "engine_processes.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["claimed"] and out["tracker"] is not None  # the engine has processes; the tracker runs
    assert out["tracker"] not in out["claimed"]
    assert out["tracker_alive"] and not out["claimed_alive"]  # shutdown stopped the engine's, not the caller's
