"""The trainer ranks' side of a weight sync in the RL loop: each rank runs the one orchestrator
(`beamrl.sync.orchestrator.WeightSync`) on the Megatron export. Rank 0 holds the transport and reaches the engines
as Ray actors (`ActorReceiver`); the other ranks take part in the collective export and probe pass, and, when the
colocated engines take their buckets from every trainer rank (`SyncRequest.colocations`), each keeps its own
shared slots (`beamrl.sync.rank_slots`). The driver makes one call to the trainer group per sync
(`TrainerGroup.sync_weights`) and gets rank 0's report."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from beamrl.loop.actor_calls import call_result
from beamrl.loop.express import ExpressAddress, ExpressClient, ExpressPeerLost
from beamrl.loop.log import log
from beamrl.loop.ray_utils import ActorCallError, died
from beamrl.models.beam.lora_payload import ADAPTER, SCALE_NAME, scale_tensor
from beamrl.protocols.weights import PendingCall, WeightSyncError
from beamrl.sync.export import ExportSource, TensorSpec
from beamrl.sync.forwarding_receiver import ForwardingReceiver
from beamrl.sync.orchestrator import ProbeCheck, SyncTimeouts, WeightSync
from beamrl.sync.rank_payload import Colocation
from beamrl.sync.rank_slots import RankSlots

_LAYOUTS: dict[int, list[list[TensorSpec]]] = {}  # per trainer object: its export layout
_ADAPTER_LAYOUTS: dict[int, list[list[TensorSpec]]] = {}  # per trainer object: its adapter export layout
# Ray adds its own latency on top of an engine call's timeout; the engine enforces the call's own limit.
_RPC_SLACK_S = 10.0


class _ActorCall(PendingCall):
    """A call to an engine actor, made through Ray or as an express call; `wait` raises `WeightSyncError`."""

    def __init__(self, call, what: str) -> None:
        super().__init__()
        self._call, self._what = call, what

    def wait(self, timeout: float):
        try:
            return call_result(self._call, timeout + _RPC_SLACK_S, self._what)
        except ActorCallError as e:
            raise WeightSyncError(str(e)) from None


class ActorReceiver(ForwardingReceiver):
    """A `WeightReceiver` whose engine lives in an `EngineActor` (same or another node). Calls from one caller
    run in issue order on the actor, so per-bucket calls can be pipelined (`call_async`)."""

    def __init__(self, handle, name: str, tp_size: int = 1):
        self._handle, self._name, self._tp = handle, name, tp_size

    @property
    def name(self) -> str:
        return self._name

    @property
    def tp_size(self) -> int:
        return self._tp

    def _submit(self, method: str, timeout: float, *args) -> PendingCall:
        return _ActorCall(self._handle.call.remote(method, *args, timeout=timeout), f"{self._name}.{method}")


class ExpressReceiver(ActorReceiver):
    """An `ActorReceiver` reached by express calls (`beamrl.loop.express`: the engine actor is on this trainer rank's
    node): the same calls, in issue order, over a socket instead of Ray."""

    def __init__(self, address: ExpressAddress, name: str, tp_size: int = 1):
        super().__init__(None, name, tp_size)
        self._address = address
        self._client: ExpressClient | None = None

    def _submit(self, method: str, timeout: float, *args) -> PendingCall:
        what = f"{self._name}.{method}"
        try:
            if self._client is None:
                self._client = ExpressClient(self._address, self._name)
            return _ActorCall(self._client.call_async("call", method, *args, timeout=timeout), what)
        except ExpressPeerLost as e:
            return PendingCall(error=WeightSyncError(str(died(what, e))))

    def close(self) -> None:
        """Close the channel (the engine was replaced or the sync discarded)."""
        if self._client is not None:
            self._client.close()
            self._client = None


def _close_receivers(receivers) -> None:
    for r in receivers:
        close = getattr(r, "close", None)
        if close is not None:
            close()


def engine_receiver(target, name: str, tp_size: int) -> ForwardingReceiver:
    """The receiver of an engine given as its express address (express calls) or its actor handle (Ray)."""
    if isinstance(target, ExpressAddress):
        return ExpressReceiver(target, name, tp_size)
    return ActorReceiver(target, name, tp_size)


class MegatronExportSource(ExportSource):
    """The Megatron trainer's collective HF export (`MegatronTrainer.export_hf`), its probe logprobs, and the
    ranks' agreement after the export (one all-reduce)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        layout = _LAYOUTS.get(id(trainer))
        if layout is None:  # the layout never changes for a trainer: computed once
            layout = _LAYOUTS[id(trainer)] = [[TensorSpec(n, dtype, tuple(shape)) for n, shape, dtype in unit]
                                              for unit in trainer.export_hf_layout()]
        self._units = layout

    def units(self) -> list[list[TensorSpec]]:
        return self._units

    @property
    def layout_key(self) -> object:
        return ("megatron-export", id(self._units))

    def stream(self):
        return self.trainer.export_hf()

    def finish(self, ok: bool) -> bool:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.trainer.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        from beamrl.trainer.protocol import PackedBatch

        batch = PackedBatch.from_sequences(sequences)
        self.trainer.set_routing_replay(False)  # the probes are scored with free routing on both sides
        lp = self.trainer.compute_logprobs(batch, temperature=1.0, return_entropy=False).logprobs
        cu = batch.cu_seqlens.tolist()
        return [lp[a + 1:b].tolist() for a, b in zip(cu[:-1], cu[1:])]


class LoRAExportSource(MegatronExportSource):
    """An adapter-only sync (apply mode `adapter`, docs/lora.md): the scale, then the trainer's full adapter
    tensors one layer per unit (`MegatronTrainer.export_lora`); probes are scored with the trainer's merged
    weights (its forward), which the engines must reproduce after merging."""

    mode = ADAPTER

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        layout = _ADAPTER_LAYOUTS.get(id(trainer))
        if layout is None:
            scale = [TensorSpec(SCALE_NAME, torch.float32, (1,))]
            units = [[TensorSpec(n, dtype, tuple(shape)) for n, shape, dtype in unit]
                     for unit in trainer.export_lora_layout()]
            layout = _ADAPTER_LAYOUTS[id(trainer)] = [scale] + units
        self._units = layout

    @property
    def layout_key(self) -> object:
        return ("megatron-adapter", id(self._units))

    def stream(self):
        mine = not dist.is_initialized() or dist.get_rank() == 0
        yield [(SCALE_NAME, scale_tensor(self.trainer.lora).to(self.trainer.device))] if mine else []
        yield from self.trainer.export_lora()


def adapter_only_syncs(lora) -> bool:
    """Whether the syncs of a trainer with this `trainer.lora` send only its adapters (LoRA), not every weight."""
    return lora is not None


def export_source(trainer) -> ExportSource:
    """What a sync of this trainer sends: the adapters when it trains LoRA (`trainer.lora`), else every weight."""
    return LoRAExportSource(trainer) if adapter_only_syncs(trainer.lora) else MegatronExportSource(trainer)


@dataclass(frozen=True)
class SyncRequest:
    """What every trainer rank is told for one sync (picklable, the same on every rank)."""

    version: int
    transport: str
    bucket_bytes: int
    timeout: float
    probe_sequences: tuple[tuple[int, ...], ...] = ()
    probe_tolerance: float = 1e-4
    probe_every: int = 1
    probe_mean_tolerance: float | None = None
    staged_memory: bool = False
    #: Memory tags the engines resume at the end of a staged sync (() : the driver resumes them after the trainer
    #: went to sleep, `beamrl.loop.colocated`).
    resume_after_sync: tuple[str, ...] = ("kv_cache", "cuda_graph")
    #: Colocated buckets from every trainer rank: per engine, the trainer rank on each of its TP ranks' devices
    #: (`beamrl.loop.weight_update.rank_colocations`); () : every bucket from rank 0.
    colocations: tuple[tuple[int, ...], ...] = ()
    #: The engines this sync reaches (indices), when some are stopped (a restart that failed while another engine
    #: was healthy: the next rollout's health round starts it again, and its restart resyncs it); None: every one.
    engines: tuple[int, ...] | None = None

    def probe_check(self) -> ProbeCheck | None:
        """The orchestrator's post-sync check of this request's probe (None without probe sequences)."""
        if not self.probe_sequences:
            return None
        return ProbeCheck([list(s) for s in self.probe_sequences], self.probe_tolerance, self.probe_every,
                          self.probe_mean_tolerance)


_SYNCS: dict[tuple, WeightSync] = {}


def _transport_kwargs(transport: str, trainer) -> dict:
    """Where rank 0 packs buckets and, for the update group, the address engines on other nodes dial."""
    import ray

    device = trainer.device
    if transport == "distributed":
        return {"device": device, "master_address": ray.util.get_node_ip_address()}
    if transport == "colocated":
        return {"device": device}
    if transport == "disk":  # engines must see this node's filesystem (same node, or a shared mount)
        import tempfile

        return {"directory": Path(tempfile.gettempdir()) / f"beamrl-sync-{os.getpid()}", "config": trainer.config.model}
    raise ValueError(f"sync.transport={transport!r} is not a transport the RL loop knows")


def _rank_slots(trainer, rank: int, engine_names, req: SyncRequest) -> tuple[RankSlots | None, dict]:
    """This rank's slots and (rank 0) the transport's per-rank arguments, when the engines take their buckets
    from every trainer rank."""
    if req.transport != "colocated" or not req.colocations:
        return None, {}
    if len(req.colocations) != len(engine_names):
        raise WeightSyncError(f"{len(req.colocations)} colocations for {len(engine_names)} engines")
    slots = RankSlots(rank, trainer.device)
    colocations = {n: Colocation(tuple(c)) for n, c in zip(engine_names, req.colocations)}
    return slots, {"rank_slots": slots, "colocations": colocations}


def _orchestrator(trainer, rank: int, receivers, engine_names, engine_tp, req: SyncRequest) -> WeightSync:
    key = (id(trainer), tuple(engine_names), req.transport, req.bucket_bytes, req.colocations)
    ws = _SYNCS.get(key)
    if ws is None:
        probe = req.probe_check()
        transport = engines = None
        rank_slots, per_rank = _rank_slots(trainer, rank, engine_names, req)
        if rank == 0:
            from beamrl.sync.transports import TRANSPORTS

            engines = [engine_receiver(h, n, tp) for h, n, tp in zip(receivers, engine_names, engine_tp)]
            kwargs = {**_transport_kwargs(req.transport, trainer), **per_rank}
            transport = lambda recs: TRANSPORTS.get(req.transport)(recs, **kwargs)  # noqa: E731
        ws = _SYNCS[key] = WeightSync(transport, engines or [], bucket_bytes=req.bucket_bytes,
                                      timeouts=SyncTimeouts.uniform(req.timeout), initial_version=req.version - 1,
                                      probe=probe, staged_memory=req.staged_memory,
                                      resume_after_sync=req.resume_after_sync, rank_slots=rank_slots)
    # Per request, not per cached orchestrator: a resumed run's first sync is unstaged, the loop's are staged.
    ws.staged_memory, ws.resume_after_sync = req.staged_memory, tuple(req.resume_after_sync)
    return ws


def sync_on_rank(trainer, rank: int, receivers, engine_names, engine_tp, req: SyncRequest) -> dict | None:
    """Run inside every trainer rank (a collective): the sync of `req.version`. Rank 0 returns the report as a
    dict; other ranks return None."""
    ws = _orchestrator(trainer, rank, receivers, engine_names, engine_tp, req)
    if req.engines is None:
        report = ws.sync(export_source(trainer), version=req.version)
    else:  # the running engines only (a subset sync on every rank, so the collectives match)
        targets = [ws.engines[i] for i in req.engines] if rank == 0 else []
        report = ws.sync(export_source(trainer), engines=targets, version=req.version)
    return None if report is None else asdict(report)


def _merged_if_lora(trainer):
    """LoRA: export what the trainer computes with, W' = merge(W0, A, B, s) (the base alone is its input)."""
    if trainer.lora is None:
        return contextlib.nullcontext()
    from beamrl.trainer.megatron.lora_mapping import merged_base_weights

    return merged_base_weights(trainer.models)


def resync_on_rank(trainer, rank: int, receivers, engine_names, engine_tp, index: int,
                   req: SyncRequest) -> dict | None:
    """Run inside every trainer rank (a collective): restarted engine `index` (new actors behind `receivers[index]`)
    replaces the old one in this run's orchestrator and gets `req.version` alone (a subset sync: the same
    manifest, checksums, version check and probe verification). Rank 0 returns the report as a dict."""
    ws = _orchestrator(trainer, rank, receivers, engine_names, engine_tp, req)
    targets = []
    if rank == 0:
        old = ws.engines[index]
        ws.replace_engine(index, engine_receiver(receivers[index], engine_names[index], engine_tp[index]))
        _close_receivers([old])
        targets = [ws.engines[index]]
    # what every sync of this trainer sends (LoRA: the adapters; the full export left a restarted LoRA engine on W0)
    report = ws.sync(export_source(trainer), engines=targets, version=req.version)
    return None if report is None else asdict(report)


def _keys_of(trainer) -> list[tuple]:
    """The `_SYNCS` keys of this trainer's orchestrators (one per engine set, transport, bucket size, colocation)."""
    return [k for k in _SYNCS if k[0] == id(trainer)]


def release_sync_buffers(trainer) -> None:
    """Before the trainer sleeps (colocated): free this rank's staging slots (the engines detach first); the next
    sync shares new ones. A no-op on ranks that do not ship."""
    for key in _keys_of(trainer):
        _SYNCS[key].release_buffers()


def discard_sync_buffers(trainer) -> None:
    """At shutdown: free every staging buffer and rank slot of the trainer's syncs, without engine calls (the
    engines may be shut down already). The actor is killed next; the driver removes a killed rank's /dev/shm files
    only as a fallback (`TrainerGroup`, which says so on the console)."""
    for key in _keys_of(trainer):
        try:
            ws = _SYNCS.pop(key)
            _close_receivers(ws.engines)
            ws.discard_buffers()
        except Exception as exc:  # noqa: BLE001 - the others' files must still go; shutdown goes on
            log(f"warning: discarding the buffers of weight sync {key[1:]} failed: {type(exc).__name__}: {exc}")


def save_hf_export(trainer, rank: int, out_dir: str) -> str | None:
    """Write the trainer's current weights as an HF Beam checkpoint (SGLang's format) from rank 0 (a LoRA trainer:
    the merged weights)."""
    from beamrl.models.beam.checkpoint import save_checkpoint

    tensors = {}
    with _merged_if_lora(trainer):
        for unit in trainer.export_hf():
            if rank == 0:
                tensors.update(unit)
    if rank != 0:
        return None
    save_checkpoint(trainer.config.model, tensors, Path(out_dir))
    return out_dir
