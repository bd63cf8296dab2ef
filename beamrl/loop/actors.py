"""Ray actors of a run: trainer ranks (Megatron) and rollout engines.

Actors are thin: they hold one object (`MegatronTrainer`, an engine) and forward calls, so the same objects
run in tests without Ray. Every call from the driver goes through `ray_get` with a timeout and passes its arguments
by keyword (after the first), so a reordered signature cannot silently swap two flags."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import ray
import torch

from beamrl.loop.express import ExpressAddress, ExpressServer, serial
from beamrl.loop.wire import Wire

#: The methods a caller on the same node may send as express calls (`beamrl.loop.express`): the per-step ones.
TRAINER_EXPRESS = ("train_step", "train_step_then_sync")
ENGINE_EXPRESS = ("generate", "call")


def _express_server(actor, methods, name: str) -> ExpressAddress:
    """Open (once) the actor's express server and return its address."""
    if actor._express is None:
        actor._express = ExpressServer(actor, methods, actor._serial, name, ray.get_runtime_context().get_node_id())
    return actor._express.address


def _close_express(actor) -> None:
    if actor._express is not None:
        actor._express.close()
        actor._express = None


@dataclass(frozen=True)
class TrainerRankSpec:
    """What a trainer rank needs to join its job (the rendezvous is rank 0's node, found at start-up)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    num_threads: int = 1


@ray.remote
class TrainerActor:
    """One Megatron trainer rank (`beamrl.trainer.megatron.MegatronTrainer`). Created first, then `start`ed
    once rank 0's node address is known, so ranks on other nodes can reach the rendezvous."""

    def __init__(self, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.trainer = None
        self._serial = threading.RLock()  # Ray's calls and express calls: one at a time (`express.serial`)
        self._express: ExpressServer | None = None

    def open_express(self) -> ExpressAddress:
        """Serve `TRAINER_EXPRESS` to callers on this node over a socket (`beamrl.loop.express`); its address."""
        return _express_server(self, TRAINER_EXPRESS, f"trainer-{getattr(self, 'rank', '?')}")

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port on it for rank 0's store (asked of rank 0). The port stays reserved
        until this rank's store has bound it in `start` (no other process can take it in between)."""
        from beamrl.net import reserve_port

        self._reserved = reserve_port("")
        return ray.util.get_node_ip_address(), self._reserved.port

    @serial
    def start(self, spec: TrainerRankSpec, setup, hf_checkpoint: str | None) -> bool:
        """Join the job as rank `spec.rank` and build the `MegatronTrainer` from `setup` (a `TrainerSetup`)."""
        os.environ.update(RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=spec.master_addr, MASTER_PORT=str(spec.master_port))
        from beamrl.trainer.megatron.worker import MegatronTrainer

        self.rank = spec.rank
        try:
            self.trainer = MegatronTrainer(setup, hf_checkpoint=hf_checkpoint)
        finally:
            reserved = getattr(self, "_reserved", None)
            if reserved is not None:
                reserved.close()
        return True

    def pid(self) -> int:
        """This rank's OS process (logged at start-up, so an operator can find it)."""
        return os.getpid()

    def data_parallel_rank(self) -> tuple[int, int]:
        """(dp rank, dp size) of this rank: which share of a step's micro-batches it trains on."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    @serial
    def compute_logprobs(self, batch, *, temperature: float, return_entropy: bool, replay: bool):
        self.trainer.set_routing_replay(replay)
        return self.trainer.compute_logprobs(batch, temperature=temperature, return_entropy=return_entropy)

    @serial
    def train_step(self, step, *, replay: bool, temperature: float):
        """One optimizer step; `step` is the `Wire` of (micro-batches, loss function) (`beamrl.loop.wire`)."""
        micro_batches, loss_fn = step.open()
        self.trainer.set_routing_replay(replay)
        return self.trainer.train_step(micro_batches, loss_fn, temperature=temperature)

    @serial
    def save_checkpoint(self, directory: str, async_save: bool = False) -> str:
        return str(self.trainer.save_checkpoint(directory, async_save=async_save))

    @serial
    def finalize_checkpoint(self, blocking: bool, timeout_s: float) -> str | None:
        done = self.trainer.finalize_checkpoint(blocking=blocking, timeout_s=timeout_s)
        return None if done is None else str(done)

    @serial
    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory)

    @serial
    def sync_weights(self, *, receivers: list, engine_names: list[str], engine_tp: list[int], request):
        """Collective over trainer ranks: every rank runs the sync orchestrator on the export; rank 0 ships the
        buckets and returns the report (`beamrl.loop.weight_sync.sync_on_rank`)."""
        from beamrl.loop.weight_sync import sync_on_rank

        return sync_on_rank(self.trainer, self.rank, receivers, engine_names, engine_tp, request)

    @serial
    def train_step_then_sync(self, step, *, replay: bool, temperature: float, receivers: list,
                             engine_names: list[str], engine_tp: list[int], request):
        """`train_step`, then `sync_weights` of the weights it produced, in one call (the driver's round trip
        between them saved). The train step's result comes back whatever the sync does: (result, report, None),
        or (result, None, "<error type>: <message>") when the sync failed, for the driver to handle as a failed
        `sync_weights` (e.g. restart an engine found dead and sync again)."""
        result = self.train_step(step, replay=replay, temperature=temperature)
        try:
            report = self.sync_weights(receivers=receivers, engine_names=engine_names, engine_tp=engine_tp,
                                       request=request)
        except Exception as exc:  # noqa: BLE001 - reported to the driver with the step's result, never dropped
            return result, None, f"{type(exc).__name__}: {exc}"
        return result, report, None

    @serial
    def save_lora_adapter(self, out_dir: str) -> str | None:
        self.trainer.save_lora_adapter(out_dir)  # collective; rank 0 writes
        return out_dir if self.rank == 0 else None

    @serial
    def sync_restarted(self, *, receivers: list, engine_names: list[str], engine_tp: list[int], index: int,
                       request):
        """Collective over trainer ranks: bring restarted engine `index` to `request.version` through the same
        orchestrator (a subset sync; `beamrl.loop.weight_sync.resync_on_rank`)."""
        from beamrl.loop.weight_sync import resync_on_rank

        return resync_on_rank(self.trainer, self.rank, receivers, engine_names, engine_tp, index, request)

    @serial
    def sleep(self) -> dict:
        """Colocated placement: free the weight sync's staging slots, then release this rank's device state
        (`MegatronTrainer.sleep`); the report as a dict."""
        from beamrl.loop.weight_sync import release_sync_buffers

        release_sync_buffers(self.trainer)
        return self.trainer.sleep().as_dict()

    @serial
    def wake(self) -> dict:
        return self.trainer.wake().as_dict()

    @serial
    def export_hf_checkpoint(self, out_dir: str) -> str | None:
        from beamrl.loop.weight_sync import save_hf_export

        return save_hf_export(self.trainer, self.rank, out_dir)

    @serial
    def shutdown(self) -> None:
        from beamrl.loop.weight_sync import discard_sync_buffers

        _close_express(self)
        try:
            discard_sync_buffers(self.trainer)
        finally:
            self.trainer.shutdown()


# Liveness and shutdown calls of an engine actor run in a thread of their own ("control"): a health check or a
# process-id question must not queue behind a `generate` that runs for minutes (the loop would take a busy engine for
# a dead one and restart it), and shutting a wedged engine down must not wait for the call it is stuck in.
@ray.remote(concurrency_groups={"control": 1})
class EngineActor:
    """One process of a rollout engine (`RolloutEngine` + `WeightReceiver`; on node ranks >= 1 of a multi-node
    engine a follower that serves no API), built in the actor from a picklable factory in two phases:
    `reserve` picks this node's address and free ports (the leader's become the engine's meeting point), then
    `start` builds the engine with them (every node of an engine starts at the same time). API calls (`call`) run
    one at a time; `health`, `pid`, `process_ids` and `shutdown` are answered while one runs."""

    def __init__(self, factory, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.factory = factory
        self.engine = None
        self._reserved: list = []
        self._serial = threading.RLock()  # the default group's calls and express calls: one at a time
        self._express: ExpressServer | None = None

    def open_express(self) -> ExpressAddress:
        """Serve `ENGINE_EXPRESS` to callers on this node over a socket (`beamrl.loop.express`); its address."""
        return _express_server(self, ENGINE_EXPRESS, getattr(self.factory, "name", "engine"))

    def reserve(self) -> tuple[str, int, int]:
        """(this node's cluster address, a port for the server, a port for the engine's nodes to meet). Both ports
        stay reserved (`beamrl.net.reserve_port`: no other process gets them) until `start` has finished."""
        from beamrl.net import reserve_port

        self._release_ports()
        host = ray.util.get_node_ip_address()
        self._reserved = [reserve_port(host), reserve_port(host)]
        return host, self._reserved[0].port, self._reserved[1].port

    @serial
    def start(self, *, host: str, port: int, dist_init_addr: str | None) -> bool:
        try:
            self.engine = self.factory.with_launch(host=host, port=port, dist_init_addr=dist_init_addr)()
        finally:
            self._release_ports()  # the server has bound its ports (or failed): the reservations are done
        return True

    def _release_ports(self) -> None:
        for r in self._reserved:
            r.close()
        self._reserved = []

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        """This node process's OS process id (logged at start-up and at each restart)."""
        return os.getpid()

    @serial
    def tp_size(self) -> int:
        return self.engine.tp_size

    @ray.method(concurrency_group="control")
    def health(self, timeout: float) -> bool:
        return self.engine is not None and bool(self.engine.health(timeout))

    @serial
    def call(self, method: str, *args, **kwargs):
        """Forward one protocol call (`generate`, `score`, `health`, `begin_weight_update`, ...)."""
        return getattr(self.engine, method)(*args, **kwargs)

    @serial
    def generate(self, requests, *, timeout: float) -> Wire:
        """The rollout's call: `requests` and the results cross as `Wire`s (`beamrl.loop.wire`)."""
        return Wire(self.engine.generate(requests.open(), timeout))

    @serial
    def weight_version(self) -> int:
        return self.engine.weight_version

    @ray.method(concurrency_group="control")
    def process_ids(self) -> list[int]:
        """The OS processes of this engine process on its node: its server, or an in-process engine's children."""
        server = getattr(self.engine, "server", None)
        if server is not None:
            return [server.pid] if server.pid is not None else []
        return list(getattr(self.engine, "child_pids", []))

    @ray.method(concurrency_group="control")
    def shutdown(self) -> None:
        _close_express(self)
        self._release_ports()
        if self.engine is not None:
            self.engine.shutdown()
