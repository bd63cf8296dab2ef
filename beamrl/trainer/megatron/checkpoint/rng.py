"""A trainer rank's random-number state as JSON (Python, NumPy, torch CPU/CUDA generators and Megatron's named
model-parallel streams). Generator states are byte tensors, stored base64-encoded."""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _bytes_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture() -> dict:
    """This process's RNG state (JSON-serialisable)."""
    from megatron.core import tensor_parallel

    version, keys, gauss = random.getstate()
    kind, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(keys), gauss],
             "numpy": [kind, np_keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": _b64(torch.get_rng_state()),
             "tracker": {name: _b64(s) for name, s in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def restore(state: dict) -> None:
    """Set this process's RNG state from `capture()`'s output."""
    from megatron.core import tensor_parallel

    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))
    tensor_parallel.get_cuda_rng_tracker().set_states({k: _bytes_tensor(v) for k, v in state["tracker"].items()})
