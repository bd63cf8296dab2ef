"""Rank function of the express-call trainer test (one process through `beamrl.trainer.megatron.launch`): the same
training from the same weights, once called directly on the main thread and once as express calls, which run on the
server's own thread (`beamrl.loop.express`)."""

from __future__ import annotations

import threading

import torch

from tests.trainer.megatron import _checkpoint_runs as C

STEPS = 3


class _Host:
    """What an actor holds, as express serves it: its trainer, one call at a time."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._serial = threading.RLock()

    def train(self, steps: int) -> dict:
        return {"losses": C._train(self.trainer, steps), "device": _device(),
                "thread": threading.current_thread().name}


def _device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def direct_and_express(dtype: str) -> dict:
    from beamrl.loop.express import ExpressClient, ExpressServer

    direct = C._trainer({}, distributed_optimizer=True, dtype=dtype, weights="initial")
    out = {"main_device": _device(), "direct": C._train(direct, STEPS)}
    del direct
    host = _Host(C._trainer({}, distributed_optimizer=True, dtype=dtype, weights="initial"))
    server = ExpressServer(host, ("train",), host._serial, "gpu-test", node_id="node")
    try:
        out["express"] = ExpressClient(server.address, "gpu-test").call("train", STEPS, timeout=300)
    finally:
        server.close()
    return out
