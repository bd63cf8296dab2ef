"""Distributed transport: the trainer (rank 0) broadcasts one uint8 buffer per bucket to every engine TP rank.

Group: by default world = 1 + sum of engine TP sizes and engine k joins at rank_offset = 1 + sum of the TP sizes of
the engines before it (`update_group_ranks`); a launcher that knows better (multi-node engines) passes
`rank_offsets` and `world_size`. The engines' joins block until the trainer joins, so all joins run concurrently.
Per bucket the engines are told the bucket's index and checksum (its layout is in the session's manifest; SGLang
is given the names, dtypes and shapes by its adapter) and block receiving while the trainer broadcasts; they
rebuild the layout themselves (`FlatBucket.empty`, identical to SGLang's `FlattenedTensorBucket.empty`). The
checksum is read on the host before the broadcast (SGLang is told it with the bucket's index).

Buckets are pipelined over staging slots (2 from 128 MiB buckets up, `auto_staging_slots`): per bucket the trainer
issues the engines' calls in issue order and starts its broadcast without waiting for either, so the next bucket
is packed (and its checksum read) while the engines receive and load this one. A slot is packed again only after
the engines replied for its previous bucket and its broadcast is done (by then it is: engines reply after
receiving). An engine that
refuses a bucket without receiving it is seen at the latest one bucket later, when its reply is waited for; the
transport then leaves the group, which frees the broadcasts in flight (no wait for the group's timeout).

After any failure the collective sequence is out of step, so the trainer leaves the group and the next sync
builds a new one (a fresh group name) once the engines have been restarted.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import torch

from beamrl.net import reserve_port
from beamrl.protocols.checksum import bucket_checksum, checksum_values
from beamrl.protocols.manifest import BucketLayout
from beamrl.protocols.weights import WeightReceiver, WeightSyncError
from beamrl.sync.calls import run_concurrently
from beamrl.sync.transports import TRANSPORTS
from beamrl.sync.transports.base import ReceiverTransport
from beamrl.sync.update_group import (destroy_update_group, init_update_group, start_broadcast_from_rank0,
                                      wait_broadcast)

log = logging.getLogger(__name__)

TRAINER = "trainer (update-group rank 0)"


def update_group_ranks(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """SGLang's convention: (rank offset of each engine, world size); the trainer is rank 0."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        offsets.append(nxt)
        nxt += int(tp)
    return offsets, nxt


@TRANSPORTS.register("distributed")
class DistributedTransport(ReceiverTransport):
    """Flattened-bucket broadcasts over an update group (SGLang `update_weights_from_distributed`)."""

    name = "distributed"
    # The native engine compares each bucket's checksum; SGLang's distributed receive takes none (docs/weight-sync.md)
    content_check = ("checksums sent with every bucket (SGLang's distributed receive cannot compare them; the "
                     "post-sync probe checks its content)")

    def __init__(self, receivers: Sequence[WeightReceiver], device: str | torch.device = "cpu",
                 master_address: str = "127.0.0.1", master_port: int = 0, backend: str | None = None,
                 group_name: str = "beamrl-weight-update", teardown_timeout: float = 10.0,
                 rank_offsets: Sequence[int] | None = None, world_size: int | None = None) -> None:
        """`rank_offsets` / `world_size`: the engines' update-group ranks when the caller computes them (e.g.
        engines spanning nodes); default `update_group_ranks` of the receivers' TP sizes."""
        super().__init__(receivers, device=device)
        if (rank_offsets is None) != (world_size is None):
            raise ValueError("give both rank_offsets and world_size, or neither")
        if rank_offsets is not None and len(rank_offsets) != len(self.receivers):
            raise ValueError(f"{len(rank_offsets)} rank_offsets for {len(self.receivers)} receivers")
        self._offsets = None if rank_offsets is None else [int(o) for o in rank_offsets]
        self._world = None if world_size is None else int(world_size)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a cuda device, got {self.device}")
        self.master_address, self.master_port = master_address, master_port
        self.group_prefix = group_name
        self.teardown_timeout = teardown_timeout
        self.group_name: str | None = None
        self._pg = None

    @property
    def world_size(self) -> int:
        return self._world if self._world is not None else update_group_ranks([r.tp_size for r in self.receivers])[1]

    def rank_offsets(self) -> list[int]:
        if self._offsets is not None:
            return list(self._offsets)
        return update_group_ranks([r.tp_size for r in self.receivers])[0]

    def connect(self, timeout: float) -> None:
        if self._pg is not None:
            return
        self._require_healthy()
        # master_port 0: a port reserved until the trainer's store has bound it (no other process can take it
        # in between); an explicit master_port is the operator's choice.
        reserved = None if self.master_port else reserve_port(self.master_address)
        port = self.master_port or reserved.port
        group = f"{self.group_prefix}-{uuid.uuid4().hex[:8]}"  # fresh name: a failed group may linger in torch
        world, holder = self.world_size, {}

        def join_as_trainer() -> None:
            holder["pg"] = init_update_group(self.backend, self.master_address, port, world, 0, group, timeout)

        offsets = {id(r): off for r, off in zip(self.receivers, self.rank_offsets())}
        try:
            self._call_all("init_weights_update_group",
                           lambda r: r.init_weights_update_group(self.master_address, port, offsets[id(r)], world,
                                                                 group, self.backend, timeout),
                           timeout, extra=[(TRAINER, join_as_trainer)])
        except WeightSyncError as err:
            for who, msg in getattr(err, "failures", {}).items():
                if who != TRAINER:  # the engine is left in (or out of) a half-built group
                    self.mark_unhealthy(who, f"joining the update group failed: {msg}")
            if "pg" in holder:
                self._destroy_local(holder["pg"])
            raise
        finally:
            if reserved is not None:
                reserved.close()
        self._pg, self.group_name = holder["pg"], group
        log.info("weight-update group %s up: %s:%d, world %d, backend %s", group, self.master_address, port,
                 world, self.backend)

    def _send(self, bucket: BucketLayout, timeout: float) -> None:
        """Issue the engines' receive calls and start the broadcast; returns without waiting (module docstring)."""
        if self._pg is None:
            raise WeightSyncError("send before connect(): the update group does not exist")
        slot = self._slot(bucket.index)
        payload = slot.payload(bucket.nbytes)
        checksum = checksum_values(bucket_checksum(payload))  # also: the pack is done before the broadcast reads
        slot.last_bucket = bucket.index
        slot.pending = self._issue("update_weights_from_distributed", timeout, bucket.index, checksum,
                                   self.group_name)
        slot.in_flight = start_broadcast_from_rank0(self._pg, payload)

    def _wait_slot(self, slot, timeout: float) -> None:
        """The engines' replies for the slot's bucket (host, bounded: a refusal or a dead engine raises here), then
        its broadcast (done by then: the engines reply after receiving it)."""
        deadline = time.monotonic() + timeout
        super()._wait_slot(slot, timeout)
        work, slot.in_flight = slot.in_flight, None
        if work is not None:
            try:
                wait_broadcast(work, max(deadline - time.monotonic(), 1e-3))
            except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise their own types
                raise WeightSyncError(f"the trainer's broadcast of bucket {slot.last_bucket} failed: "
                                      f"{type(exc).__name__}: {exc}") from exc

    def abort(self, reason: str, timeout: float) -> None:
        for slot in self._slots:
            slot.in_flight = None  # never waited for after a failure: leaving the group below ends them
        if self._pg is not None:  # the collective sequence is broken: leave the group (frees blocked receives)
            self._destroy_local(self._pg)
            self._pg, self.group_name = None, None
        super().abort(reason, timeout)

    def close(self) -> None:
        """Leave the group on every side at once. NCCL's communicator teardown is an intra-node collective: an
        engine's destroy can block until the trainer destroys too, so destroying the engines' side first and the
        trainer's after it timed out on the H200 (docs/benchmarks.md, weight sync)."""
        super().close()
        if self._pg is None:
            return
        group, pg = self.group_name, self._pg
        self._pg, self.group_name = None, None
        self._call_all("destroy_weights_update_group",
                       lambda r: r.destroy_weights_update_group(group, self.teardown_timeout),
                       self.teardown_timeout, extra=[(TRAINER, lambda: _leave_quietly(pg))])

    def _destroy_local(self, pg) -> None:
        try:
            run_concurrently("destroy local update group", [(TRAINER, lambda: _leave_quietly(pg))],
                             self.teardown_timeout)
        except WeightSyncError as err:  # leaking a wedged group is better than hanging the trainer on it
            log.error("could not tear down the trainer's update group: %s", err)


def _leave_quietly(pg) -> None:
    """The trainer leaves the group; a failure is logged, not raised (leaking a broken group is better than
    failing the caller's teardown or recovery over it)."""
    try:
        destroy_update_group(pg)
    except Exception as err:
        log.error("could not tear down the trainer's update group: %s", err)
