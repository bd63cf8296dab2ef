"""Publishing the trainer's weights to the engines after a train step: the one call the driver makes for a
weight sync (`publish_weights`), the colocated memory hand-over before the train step, and the probes.

The whole sync (pause, begin, buckets, commit, version check, probe verification, memory resume) runs in the
trainer ranks' orchestrator (`beamrl.loop.weight_sync`); the driver only sends the request and logs the report.
Colocated GPU engines give their memory to training (`beamrl.loop.colocated`, before the train step) and take it
back in the anchors' staged order: weights first (inside the sync), then the buckets, then KV cache and CUDA graphs
(at the end of the sync, or after the trainer went to sleep).
"""

from __future__ import annotations

from dataclasses import dataclass

from beamrl.cluster.placement import Placement
from beamrl.loop.groups import CarriedSync, EngineGroup, TrainerGroup
from beamrl.loop.log import log
from beamrl.loop.weight_sync import SyncRequest
from beamrl.protocols.rollout import EngineError
from beamrl.sync.config import SyncConfig, buckets_from_every_rank

#: Probe length: the last tokens of each probe sample (its answer and the end of its prompt). Short, so the probe
#: pass (a trainer forward + an engine prefill of two sequences) costs far less than a step.
PROBE_TOKENS = 64
#: Where trainer and engine compute the same thing (the native engine in float32) every probe token is exact to 1e-4.
EXACT_TOLERANCE = 1e-4
#: Elsewhere (bfloat16; SGLang, whose Beam keeps lm_head in BF16) it is an alarm: the exact per-step check is the
#: per-bucket checksums where the engine can read the bytes (docs/weight-sync.md, "The probe check"). On the *mean*
#: |delta logprob|, 0.5: a token whose router scores nearly tie takes other experts on one side and moves by up to
#: ~1 nat with every weight right (measured on the tiny Beam in bf16: max 0.86, mean 0.17 over an 11-token probe on a
#: CPU with AMX), while wrong or stale weights move every token (one-step-old weights at lr 1e-2: mean 1.2-1.4) ...
ALARM_MEAN_TOLERANCE = 0.5
#: ... and on the largest, loosely (~3x the near-tie measured): where the engine cannot checksum the bytes (SGLang
#: behind the distributed transport) a bucket wrong only for a few experts moves only the tokens routed there.
ALARM_MAX_TOLERANCE = 3.0


@dataclass(frozen=True)
class SyncProbe:
    """Post-sync verification: token sequences both sides score, the bound on their largest |delta logprob|
    (`tolerance`) and, for the alarm, on their mean (`beamrl.sync.orchestrator.ProbeCheck`)."""

    sequences: list[list[int]]
    tolerance: float
    mean_tolerance: float | None = None


def probe_tolerance(engine: str, dtype: str) -> tuple[float, float | None]:
    """(bound on the largest, bound on the mean): (1e-4, None) where trainer and engine compute the same thing in
    float32 (the native engine), else the alarm (3.0, 0.5)."""
    if engine == "native" and dtype == "float32":
        return EXACT_TOLERANCE, None
    return ALARM_MAX_TOLERANCE, ALARM_MEAN_TOLERANCE


def sync_probe(data, tokenizer, dtype: str, engine: str) -> SyncProbe:
    """Two fixed samples (prompt, answer, eos), cut to their last `PROBE_TOKENS` tokens."""
    eos = int(tokenizer.eos_token_id)
    seqs = [(list(p.prompt_ids) + tokenizer.encode(str(p.ground_truth)) + [eos])[-PROBE_TOKENS:]
            for p in data.samples[:2]]
    return SyncProbe(seqs, *probe_tolerance(engine, dtype))


_announced: set[str] = set()


def rank_colocations(placement: Placement, transport: str) -> tuple[tuple[int, ...], ...]:
    """Per engine, the trainer rank on each of its TP ranks' devices, when colocated engines must take their
    buckets from every trainer rank (`sync.config.buckets_from_every_rank`). () otherwise: rank 0 ships every
    bucket (the native engine's staged slots, or one flattened bucket)."""
    if not buckets_from_every_rank(transport, placement.mode, placement.num_nodes,
                                   [e.tp for e in placement.engines]):
        return ()
    return tuple(tuple(e.shares_with_trainer) for e in placement.engines)


def sync_request(version: int, sync: SyncConfig, timeout: float, probe: SyncProbe | None, staged: bool = False,
                 resume_after_sync: tuple[str, ...] = ("kv_cache", "cuda_graph"),
                 colocations: tuple[tuple[int, ...], ...] = ()) -> SyncRequest:
    return SyncRequest(version=version, transport=sync.transport, bucket_bytes=sync.bucket_bytes, timeout=timeout,
                       probe_sequences=tuple(tuple(s) for s in probe.sequences) if probe else (),
                       probe_tolerance=probe.tolerance if probe else 0.0, probe_every=sync.probe_every,
                       probe_mean_tolerance=probe.mean_tolerance if probe else None,
                       staged_memory=staged, resume_after_sync=resume_after_sync, colocations=colocations)


def resync_engine(trainer: TrainerGroup, engines: EngineGroup, index: int, version: int, sync: SyncConfig,
                  timeout: float, probe: SyncProbe | None, colocations: tuple[tuple[int, ...], ...] = ()) -> None:
    """Bring restarted engine `index` to `version` (what the others serve): a subset sync through the same
    orchestrator (checksums, version check, probe verification), then its served version is checked here too."""
    if version > 0:
        trainer.sync_restarted(engines, index, sync_request(version, sync, timeout, probe, colocations=colocations))
    served = engines.version_of(index)
    if served != version:
        raise EngineError(f"{engines.names[index]} serves weight version {served} after its restart; the trainer is "
                          f"at {version}")


def publish_weights(trainer: TrainerGroup, engines: EngineGroup, request: SyncRequest,
                    carried: CarriedSync | None = None) -> dict[str, float]:
    """Sync the trainer's weights into every engine as `request.version` (`sync_request`), checked (per-bucket
    checksums, served versions) and, when the request has probe sequences, verified on them, all in one call to the
    trainer group; or take the outcome of that sync when it already ran at the end of the train step's call
    (`carried`: its failure raises here as the sync call's would). Returns the sync metrics."""
    report = carried.report() if carried is not None else trainer.sync_weights(engines, request)
    if report["code_path"] not in _announced:
        _announced.add(report["code_path"])
        log(f"weight sync: {report['code_path']} ({request.transport}: {report['transport_mode']}, "
            f"{report['buckets']} buckets, {report['bytes'] / 2**20:.1f} MiB)")
    out = {"time/sync_s": report["seconds"], "sync/bytes": float(report["bytes"]), "sync/gbps": report["gbps"],
           "sync/version": float(report["version"]), "sync/buckets": float(report["buckets"])}
    if report["max_abs_logprob_diff"] is not None:
        out["sync/verify_max_abs_logprob_diff"] = report["max_abs_logprob_diff"]
        out["sync/verify_mean_abs_logprob_diff"] = report["mean_abs_logprob_diff"]
    return out
