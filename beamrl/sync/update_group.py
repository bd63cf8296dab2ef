"""The weight-update process group shared by the trainer (rank 0) and the engines' TP ranks.

It must rendezvous exactly as SGLang's `init_custom_process_group` does on the engine side: a TCP store on
`tcp://master_address:master_port` hosted by rank 0, wrapped in a prefix store named after the group, and a
process group built outside the default (world) group, because the trainer's own world (Megatron) and the
engines' worlds are unrelated. Creating such a group needs torch's `_new_process_group_helper` (the same
private helper SGLang uses); it is isolated here so a torch upgrade touches one function.

Every wait carries `timeout`: the store rendezvous, and every collective of the group (gloo/nccl enforce the
process-group timeout).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def init_update_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str, timeout: float) -> dist.ProcessGroup:
    """Join the update group as `rank` (trainer: 0). Blocks until all `world_size` ranks join or `timeout` s."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"update group backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the update group of world_size {world_size}")
    if backend == "nccl" and dist.is_initialized() and dist.distributed_c10d._get_default_group().bound_device_id:
        # torch would then build the group by ncclCommSplit of this process's world communicator, which the
        # engines are not part of: the join would hang. Refuse instead.
        raise ValueError("the weight-update group cannot be created in a process whose default process group is "
                         "bound to a device (init_process_group(device_id=...)); initialise it without device_id")
    td = timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=td))
    store.set_timeout(td)
    store = dist.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                           group_name=group_name, timeout=td)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_from_rank0(pg: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from group rank 0 (the trainer) to every rank of `pg`, waiting for completion."""
    dist.broadcast(tensor, src=0, group=pg)
    if tensor.is_cuda:  # NCCL returns once enqueued; the bytes are only sent when the stream gets there
        torch.cuda.current_stream(tensor.device).synchronize()


def start_broadcast_from_rank0(pg: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Start broadcasting `tensor` from group rank 0 and return at once (NCCL: on its own stream, after the work
    queued on the current stream; gloo: on its own thread). `tensor` must stay unchanged until `wait_broadcast`."""
    return dist.broadcast(tensor, src=0, group=pg, async_op=True)


def wait_broadcast(work: dist.Work, timeout: float) -> None:
    """Before `tensor` of `start_broadcast_from_rank0` is written again: wait on the host until the broadcast is done,
    at most `timeout` s (with a timeout, NCCL's wait is a host wait too)."""
    work.wait(timedelta(seconds=timeout))


def destroy_update_group(pg: dist.ProcessGroup) -> None:
    """Tear the group down (idempotent for a group already destroyed)."""
    if pg in c10d._world.pg_map:
        dist.destroy_process_group(pg)
