"""Interpreter start-up hook for SGLang processes spawned by a beamrl process running SGLang on CPU.

`beamrl.compat.sglang_cpu.spawn_env()` / `child_env()` put this folder first on PYTHONPATH; Python imports
`sitecustomize` at start-up, so every spawned scheduler/detokenizer (a fresh interpreter) installs the same CPU
shims before it imports sglang. A `sitecustomize` that this one shadows is still run afterwards.
"""

import importlib.util
import os
import sys

from beamrl.compat.sglang_cpu import activate

activate()

# Chain to the next sitecustomize on the path, if the environment had one.
_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    if os.path.abspath(_entry or ".") == _here:
        continue
    _candidate = os.path.join(_entry, "sitecustomize.py")
    if os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_beamrl_chained_sitecustomize", _candidate)
        _module = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_module)
        break
