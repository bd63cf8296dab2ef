"""Nothing in the package or the benchmarks unpickles without an allowlist (checkpoints are JSON + tensors read
with `weights_only=True`). `pickle.loads` is used only between the run's own processes: the test launcher's IPC
with its children, the actor payloads (`Wire`), which cross Ray as Ray's own arguments do (Ray unpickles every
argument and result), and the express calls that stand in for Ray's on one node."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: file -> why it may call pickle.load(s)
ALLOWED_PICKLE = {"beamrl/trainer/megatron/launch.py": "results of its own child processes (IPC)",
                  "beamrl/loop/wire.py": "per-step payloads between the run's own actors, inside Ray's calls (which "
                                         "unpickle their arguments anyway)",
                  "beamrl/loop/express.py": "express calls between the run's own actors on one node: the arguments and "
                                            "results of the calls Ray would carry (and unpickle) otherwise; the "
                                            "socket takes only callers that hold the actor's random key",
                  "beamrl/trainer/megatron/checkpoint/safe_unpickle.py": "the allowlist unpickler itself",
                  "benchmarks/profile_step.py": "times the driver's actor payloads: unpickles only bytes it pickled "
                                                "itself in the same profiling run"}


def _sources():
    for top in ("beamrl", "benchmarks", "scripts"):
        yield from (p for p in (ROOT / top).rglob("*.py"))


def test_no_unrestricted_torch_load():
    bad = [str(p.relative_to(ROOT)) for p in _sources() if re.search(r"weights_only\s*=\s*False", p.read_text())]
    assert bad == []
    loose = [str(p.relative_to(ROOT)) for p in _sources()
             if re.search(r"torch\.load\((?![^)]*weights_only\s*=\s*True)", p.read_text())]
    assert loose == [], "torch.load without weights_only=True"


def test_pickle_loads_only_where_allowed():
    users = {str(p.relative_to(ROOT)) for p in _sources()
             if re.search(r"pickle\.(load|loads)\(|Unpickler\b", p.read_text())}
    assert users <= set(ALLOWED_PICKLE), users - set(ALLOWED_PICKLE)
