"""Rank function of the per-rank payload test (2 gloo processes through `beamrl.trainer.megatron.launch`):
every trainer rank packs the same bucket into its own shared buffer (the plan and packing of a real sync),
the handles are gathered to rank 0, which builds the payload of an engine of TP2 colocated with the two ranks and
plays the engine: it opens entry r, checks that it is rank r's buffer holding the bucket's bytes, and "copies" it;
then every rank releases its buffer, and an entry opened after the release is refused."""

from __future__ import annotations

import torch


def per_rank_payload() -> dict:
    import torch.distributed as dist

    from beamrl.sync.export import specs_of
    from beamrl.sync.packing import pack_bucket
    from beamrl.sync.plan import plan_buckets
    from beamrl.sync.rank_payload import Colocation, KeepAlive, PayloadError, SharedBuffer, gather_handles, payload_entries

    dist.init_process_group("gloo")  # from the env `launch` sets
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)  # every rank exports the same tensors (the full bucket on every rank)
    named = [("model.norm.weight", torch.randn(64, generator=g)),
             ("lm_head.weight", torch.randn(16, 64, generator=g).to(torch.bfloat16))]
    plan = plan_buckets([specs_of(named)], 1 << 20)
    [(k, tensors)] = list(plan.assemble([named]))
    layout = plan.buckets[k]
    buffer = SharedBuffer.allocate(layout.nbytes, "cpu")
    pack_bucket(buffer, layout, tensors)
    keep = KeepAlive(max_outstanding=1)
    keep.hold(k, buffer)
    handles = gather_handles(SharedBuffer.of(buffer, rank, k))
    out: dict = {}
    if rank == 0:
        colocation = Colocation.from_devices(["cpu-slot-0", "cpu-slot-1"], ["cpu-slot-0", "cpu-slot-1"])
        entries = payload_entries(handles, colocation, k)
        expected = torch.cat([t.reshape(-1).view(torch.uint8) for t in
                              (dict(named)[m.name] for m in layout.metas)])
        opened = [e.open() for e in entries]
        out["entry_ranks"] = [e.rank for e in entries]
        out["entries_match"] = all(torch.equal(o, expected) for o in opened)
        out["distinct_buffers"] = len({e.path for e in entries}) == 2
        copies = [o.clone() for o in opened]  # the engine ranks copy out ...
        del opened
        out["copied"] = all(torch.equal(c, expected) for c in copies)
    dist.barrier()  # ... and reply: now every rank may free its buffer
    keep.release(k)
    keep.check_finished()
    del buffer
    dist.barrier()
    if rank == 0:
        try:
            entries[1].open()
            out["gone_refused"] = False
        except PayloadError as e:
            out["gone_refused"] = "released before the engine copied it" in str(e)
    dist.barrier()
    dist.destroy_process_group()
    return out
