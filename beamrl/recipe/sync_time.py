"""Projected seconds of one full weight sync for a recipe's layout (`beamrl train RECIPE --dry-run` prints it).

Bytes: every tensor of the model's HF weight table at the recipe's dtype (the FP32 router counted at 4 bytes).
Per-GPU payload rates (GB/s = 1e9 B/s) per GPU type, each with its source (`RATES`):
- `colocated`: a staged colocated sync into an engine on the same GPU (pack + copy-out), `benchmarks/sync_h200.py
  --mode colocated` at 512 MiB buckets;
- `intra_node`: an NCCL broadcast between two GPUs of a node (NVLink), `benchmarks/sync_h200.py --mode distributed`'s
  raw-broadcast reference;
- `inter_node`: one GPU's share of the network across nodes: a 400 Gb/s NIC per GPU (DGX H200 / DGX B200: eight
  ConnectX-7 400 Gb/s ports for eight GPUs) = 50 GB/s line rate, of which NCCL is assumed to reach 80 % (40 GB/s);
  not measured here (the lent machines are single nodes);
- `copy`: a device-to-device copy (packing and the engines' copy-out).

Two projections:
- **as built**: the export is gathered on trainer rank 0 (Megatron's TP/EP all-gathers, PP broadcasts), rank 0
  packs every bucket and ships it through the recipe's transport; per bucket these steps run one after another.
  Colocated engines of TP > 1, or colocated layouts over several nodes, first get each packed bucket broadcast to
  every trainer rank (buckets from every trainer rank, docs/colocated.md): NVLink in one node, the network across.
  Distributed: one broadcast stream from rank 0's GPU to every engine GPU, bound by that GPU's network share.
- **per-source-rank** (the design that reaches the 501B target): each trainer rank broadcasts the tensors it owns
  straight to the engines; every engine node receives the full model once (SGLang's engine ranks take full
  tensors) through all of its GPUs' network shares, and fans it out over NVLink; the sources send in parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from beamrl.dtypes import torch_dtype
from beamrl.models.beam.weights import expected_tensors
from beamrl.sync.config import buckets_from_every_rank

if TYPE_CHECKING:
    from beamrl.models.beam.config import BeamConfig
    from beamrl.recipe.schema import Recipe

TARGET_S = 5.0  # the design target for Beam 501B on 96 H200


@dataclass(frozen=True)
class LinkRates:
    """Per-GPU payload rates in GB/s, and where each comes from."""

    colocated: float
    intra_node: float
    inter_node: float
    copy: float
    source: str


RATES = {
    "h200": LinkRates(
        colocated=554.0, intra_node=345.0, inter_node=40.0, copy=2108.0,
        source="H200 measured with benchmarks/sync_h200.py on the lent machines (docs/benchmarks.md: colocated "
               "554 GB/s at 512 MiB through the training path and d2d copy 2,108 GB/s, 2026-12-02; raw NCCL "
               "broadcast GPU0->GPU1 345 GB/s, 2026-11-30); inter-node: 400 Gb/s NIC per GPU at 80 % (not measured)"),
    "b200": LinkRates(
        colocated=554.0, intra_node=690.0, inter_node=40.0, copy=3700.0,
        source="B200 not measured: NVLink 5 doubles NVLink 4, so the H200 NCCL figure x2; HBM3e 8 TB/s, so the H200 "
               "copy figure x1.8; the colocated figure is the H200 one; inter-node: 400 Gb/s NIC per GPU at 80 %"),
}


@dataclass(frozen=True)
class SyncTimeEstimate:
    """Seconds of one full sync; the as-built parts add up to `as_built_s`."""

    total_bytes: int
    expert_bytes: int
    buckets: int
    transport: str
    gather_s: float
    pack_s: float
    transfer_s: float
    load_s: float
    per_source_s: float
    rates: LinkRates

    @property
    def as_built_s(self) -> float:
        return self.gather_s + self.pack_s + self.transfer_s + self.load_s


def model_bytes(config: "BeamConfig", dtype: str) -> tuple[int, int]:
    """(all bytes, routed-expert bytes) of the HF weight table at `dtype` (FP32 router and correction bias)."""
    dt = torch_dtype(dtype)
    total = experts = 0
    for name, spec in expected_tensors(config).items():
        n = math.prod(spec.shape) * spec.dtype(dt).itemsize
        total += n
        if ".mlp.experts." in name:
            experts += n
    return total, experts


def estimate_sync_time(r: "Recipe", config: "BeamConfig") -> SyncTimeEstimate:
    """The projections of the module docstring for recipe `r` (a GPU recipe)."""
    rates = RATES[r.cluster.gpu_type]
    g = r.cluster.gpus_per_node
    tr, ro = r.trainer, r.rollout
    total, experts = model_bytes(config, r.model.dtype)
    dense = total - experts
    gb = 1e9

    def ring(nbytes: float, ranks: int, span_nodes: bool) -> float:
        """An all-gather ring over `ranks` GPUs: every rank receives (ranks-1)/ranks of the bytes."""
        if ranks <= 1:
            return 0.0
        return nbytes * (ranks - 1) / ranks / ((rates.inter_node if span_nodes else rates.intra_node) * gb)

    expert_ranks = tr.ep * tr.etp
    gather = (ring(dense, tr.tp, tr.tp > g) + ring(experts, expert_ranks, expert_ranks * tr.pp > g)
              + (total * (tr.pp - 1) / tr.pp / (rates.inter_node * gb) if tr.pp > 1 else 0.0))
    pack = 2 * total / (rates.copy * gb)  # pack, then read again for the checksum
    engines_remote = r.placement.mode == "disaggregated"
    transport = r.sync.transport
    if transport == "colocated":
        transfer = total / (rates.colocated * gb)
        if buckets_from_every_rank(transport, r.placement.mode, r.cluster.num_nodes, [ro.engine_tp]):
            spread = rates.inter_node if r.cluster.num_nodes > 1 else rates.intra_node
            transfer += total / (spread * gb)  # rank 0's packed bucket to every trainer rank's slot
    elif transport == "distributed":
        transfer = total / ((rates.inter_node if engines_remote else rates.intra_node) * gb)
    else:  # disk: a checkpoint written and read back; not modelled beyond the copy
        transfer = total / (rates.inter_node * gb)
    load = total / ro.engine_tp / (rates.copy * gb)  # each engine rank copies its shard out of the full bucket
    # Per-source-rank broadcasts: an engine node takes the full model through all its GPUs' network shares (or
    # NVLink when the engines share the trainer's nodes); each of the trainer GPUs sends its own share.
    engine_node_gpus = min(ro.engine_tp, g)
    inbound = total / (engine_node_gpus * (rates.inter_node if engines_remote else rates.intra_node) * gb)
    outbound = total / tr.num_gpus / (rates.inter_node * gb)
    per_source = max(inbound, outbound) + pack / tr.num_gpus + load
    return SyncTimeEstimate(total, experts, math.ceil(total / r.sync.bucket_bytes), transport, gather, pack,
                            transfer, load, per_source, rates)


def adapter_sync_bytes(config: "BeamConfig", lora, dtype: str) -> int:
    """Bytes of one adapter-only sync (`trainer.lora`): every adapter tensor at the model dtype, plus the FP32
    scale (docs/lora.md)."""
    from beamrl.models.beam.lora import adapter_num_parameters

    return adapter_num_parameters(config, lora) * torch_dtype(dtype).itemsize + 4


def format_lora_estimate(e: SyncTimeEstimate, r: "Recipe", config: "BeamConfig") -> str:
    """The dry-run line of a LoRA recipe: its syncs are adapter-only."""
    nbytes = adapter_sync_bytes(config, r.trainer.lora, r.model.dtype)
    rate = e.transfer_s and e.total_bytes / e.transfer_s
    return (f"  trainer.lora: every sync is adapter-only (apply mode 'adapter'): {nbytes / 1e6:.1f} MB per sync = "
            f"{100 * nbytes / e.total_bytes:.3f} % of the full sync above; transfer ~{nbytes / rate:.3f} s at the same "
            f"rate, then each engine merges W0 + s * B A into its {_targets(r)} (docs/lora.md)")


def _targets(r: "Recipe") -> str:
    return "targeted weights (" + ", ".join(r.trainer.lora.targets) + ")"


def format_estimate(e: SyncTimeEstimate, r: "Recipe") -> str:
    """The dry-run lines."""
    rt = e.rates
    verdict = "within" if e.per_source_s <= TARGET_S else "over"
    return "\n".join([
        f"weight sync ({e.transport}, {r.sync.bucket_mb} MiB buckets): {e.total_bytes / 1e9:.1f} GB per full sync "
        f"({e.expert_bytes / 1e9:.1f} GB routed experts), ~{e.buckets} buckets",
        f"  projected, as built (gathered on trainer rank 0, one stream): {e.as_built_s:.1f} s = gather "
        f"{e.gather_s:.1f} + pack {e.pack_s:.1f} + transfer {e.transfer_s:.1f} + engine load {e.load_s:.1f}",
        f"  projected, per-source-rank broadcasts: {e.per_source_s:.1f} s ({verdict} the {TARGET_S:g} s target; "
        "docs/weight-sync.md, 'Sync time')",
        f"  per-GPU rates ({r.cluster.gpu_type}): colocated {rt.colocated:g}, NVLink NCCL {rt.intra_node:g}, "
        f"inter-node {rt.inter_node:g}, copy {rt.copy:g} GB/s; {rt.source}",
    ])
