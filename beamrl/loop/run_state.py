"""Driver-side state saved beside each trainer checkpoint, so `--resume` continues exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "driver_state.json"


def save_driver_state(directory: Path, step: int, weight_version: int, data_state: dict) -> None:
    state = {"step": step, "weight_version": weight_version, "data": data_state,
             "python_rng": repr(random.getstate()), "numpy_rng": _np_state(), "torch_rng": torch.get_rng_state().tolist()}
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(directory / STATE_FILE)


def load_driver_state(directory: Path) -> dict:
    path = directory / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: {directory} is not a complete beamrl checkpoint")
    state = json.loads(path.read_text())
    random.setstate(_literal(state["python_rng"]))
    kind, keys, pos, has_gauss, cached = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    return state


def _np_state():
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _literal(text: str):
    import ast

    return ast.literal_eval(text)
