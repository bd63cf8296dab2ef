"""Publishing the trainer's weights to the engines after a train step: the one call the driver makes for a
weight sync (`publish_weights`), plus the colocated memory hand-over around it and the post-sync check.

Colocated GPU engines give their memory to training (`release_engine_memory`, before the train step) and take
it back in the anchors' staged order: weights first, the sync, then KV cache and CUDA graphs, to keep the peak
low during the update."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from beamrl.loop.groups import EngineGroup, TrainerGroup
from beamrl.sync.config import SyncConfig
from beamrl.trainer.protocol import PackedBatch


@dataclass(frozen=True)
class SyncProbe:
    """Post-sync verification: token sequences both sides score, the largest |delta logprob| allowed, and the
    engines' time limit for scoring them (timeouts.generate_s)."""

    sequences: list[list[int]]
    tolerance: float
    timeout: float


def sync_probe(data, tokenizer, dtype: str, timeout: float) -> SyncProbe:
    """Two fixed prompts with their answers (probes the model has seen); tight tolerance in float32."""
    eos = int(tokenizer.eos_token_id)
    seqs = [list(p.prompt_ids) + tokenizer.encode(str(p.ground_truth)) + [eos] for p in data.samples[:2]]
    return SyncProbe(seqs, 1e-3 if dtype == "float32" else 0.5, timeout)


def release_engine_memory(engines: EngineGroup, staged: bool, timeout: float) -> None:
    """Colocated GPU: the engines free weights, KV cache and CUDA graphs for the train step."""
    if staged:
        engines.call_all("release_memory", timeout, tags=None)


def publish_weights(trainer: TrainerGroup, engines: EngineGroup, version: int, sync: SyncConfig, timeout: float,
                    probe: SyncProbe | None, staged: bool = False) -> dict[str, float]:
    """Sync the trainer's weights into every engine as `version`, check the versions they report, and verify
    them against the trainer on the probe sequences (when `probe` is given). Returns the sync metrics."""
    if staged:
        engines.call_all("resume_memory", timeout, tags=["weights"])
    report = trainer.sync_weights(engines, version=version, transport=sync.transport, bucket_bytes=sync.bucket_bytes,
                                  timeout=timeout, progress=False)
    versions = engines.versions()
    if any(v != version for v in versions):
        raise RuntimeError(f"weight sync to version {version} finished but engines report versions {versions}")
    out = {"time/sync_s": report["seconds"], "sync/bytes": float(report["bytes"]), "sync/gbps": report["gbps"],
           "sync/version": float(version)}
    if probe is not None:
        out["sync/verify_max_abs_logprob_diff"] = verify_engines(trainer, engines, version, probe)
    if staged:  # KV cache last, to keep the peak low during the weight update
        engines.call_all("resume_memory", timeout, tags=["kv_cache", "cuda_graph"])
    return out


def verify_engines(trainer: TrainerGroup, engines: EngineGroup, version: int, probe: SyncProbe) -> float:
    """Engine prompt logprobs vs trainer logprobs on the probe sequences, free routing on both sides; every
    engine is checked, so one bad replica cannot hide behind another. Returns the largest |delta|."""
    scores = engines.score(probe.sequences, probe.timeout)
    batch = PackedBatch.from_sequences(probe.sequences)
    tr = trainer.compute_logprobs(batch, temperature=1.0, replay=False).logprobs
    worst = 0.0
    for eng in scores.values():
        for i, (a, b) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())):
            t_lp = tr[a + 1:b]
            e_lp = torch.tensor(eng[i][-len(t_lp):], dtype=torch.float32)
            worst = max(worst, float((t_lp - e_lp).abs().max()))
    if worst > probe.tolerance:
        raise RuntimeError(f"post-sync verification failed: engine vs trainer max |delta logprob| = {worst:.3g} "
                           f"> {probe.tolerance} (engines now serve version {version}; restart them)")
    return worst
