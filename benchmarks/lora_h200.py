#!/usr/bin/env python
"""LoRA on one H200: a LoRA train step of a real-width model and an adapter-only apply into the embedded engine.

Sections (each in its own try/except, so one failure keeps the others' results):
  sizes_501b        adapter bytes of Beam 501B at rank 32 (bf16) per target set, next to the merged weights they
                    replace and the full model (no device work)
  lora_train_small  bf16 LoRA train step of the `small` preset (real widths, 4 layers, 16 experts), rank 32 on
                    attention + dense MLP + experts: forward+backward and full step time, tokens/s, peak memory,
                    trainable parameters; then the trainer's adapter is exported (kept for the next section)
  adapter_apply     adapter-only syncs of that adapter through the orchestrator (`WeightSync`, colocated, staged
                    buckets) into the embedded engine (same GPU, bf16 `small`): bytes, seconds (checksums, merge
                    from W0 at commit, copy), the first sync (W0 copies taken) and a later one, GB/s, and the
                    bytes a merged-weight sync would move

  python benchmarks/lora_h200.py                        # one H200 (writes $OUT/lora_h200.json)
  python benchmarks/lora_h200.py --device cpu --tiny    # CPU smoke run of every section at tiny sizes

Needs torch, megatron-core 0.19.2 and the repo on PYTHONPATH; runs as a 1-rank world in this process.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--tiny" in __import__("sys").argv:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from beamrl.models.beam import preset  # noqa: E402
from benchmarks._bench_utils import (free_device_memory, random_micro_batches, run_sections, sync_device,  # noqa: E402
                                     time_train_steps)
from beamrl.models.beam.lora import adapted_num_parameters, adapter_num_parameters  # noqa: E402
from beamrl.models.beam.lora_config import (ALL_TARGETS, ATTENTION_TARGETS, EXPERT_TARGETS,  # noqa: E402
                                            LoRAConfig)

BF16 = 2


def sizes_501b(rank: int = 32) -> dict:
    """Adapter vs merged vs full bytes (bf16) of Beam 501B for the usual target sets."""
    c = preset("beam-501b")
    full = c.num_parameters() * BF16
    out = {"full_model_bytes": full, "rank": rank}
    for name, targets, share in (("attention", ATTENTION_TARGETS, False), ("experts", EXPERT_TARGETS, False),
                                 ("experts_shared_a", EXPERT_TARGETS, True), ("all", ALL_TARGETS, False)):
        lora = LoRAConfig(rank=rank, targets=targets, share_expert_a=share)
        adapter = adapter_num_parameters(c, lora) * BF16
        merged = adapted_num_parameters(c, lora) * BF16
        out[name] = {"adapter_bytes": adapter, "merged_bytes": merged, "adapter_over_full": adapter / full,
                     "adapter_over_merged": adapter / merged}
    return out


def lora_train(config, lora: LoRAConfig, device: str, seq_len: int, seqs_per_micro_batch: int, micro_batches: int,
               warmup: int, steps: int, state: dict, seed: int = 0) -> dict:
    from beamrl.models.beam.weights import random_tensors
    from beamrl.trainer.megatron.config import TrainerConfig
    from beamrl.trainer.megatron.worker import MegatronTrainer, TrainerSetup

    trainer_config = TrainerConfig(num_gpus=1, global_batch_size=1, lr=1e-4, distributed_optimizer=True, lora=lora)
    trainer = MegatronTrainer(TrainerSetup(model=config, trainer=trainer_config, dtype="bfloat16"))
    base = dict(random_tensors(config, seed, torch.bfloat16))
    trainer.load_hf_state_dict(base)
    trainable = sum(p.numel() for m in trainer.models for p in m.parameters() if p.requires_grad)
    frozen = sum(p.numel() for m in trainer.models for p in m.parameters() if not p.requires_grad)
    batches = random_micro_batches(config.vocab_size, seq_len, seqs_per_micro_batch, micro_batches, seed)
    timed = time_train_steps(trainer, batches, warmup, steps)
    fb, full, losses, tokens, peak = (timed[k] for k in ("fwd_bwd_s", "step_s", "losses", "tokens", "peak_mem_gib"))
    sync_device()
    t0 = time.perf_counter()
    adapter = {k: v for unit in trainer.export_lora() for k, v in unit}
    sync_device()
    export_s = time.perf_counter() - t0
    trainer.shutdown()
    del trainer
    free_device_memory()
    state.update(adapter=adapter, base=base, config=config, lora=lora)
    fb_s, full_s = statistics.median(fb), statistics.median(full)
    return {"tokens_per_step": tokens, "fwd_bwd_ms": 1e3 * fb_s, "step_ms": 1e3 * full_s,
            "fwd_bwd_tokens_per_s": tokens / fb_s, "peak_mem_gib": peak, "trainable_params": trainable,
            "frozen_params": frozen, "adapter_export_s": export_s, "losses": losses, "rank": lora.rank,
            "targets": list(lora.targets)}


def adapter_apply(device: str, state: dict) -> dict:
    """Adapter-only syncs of the trainer's adapter through the one orchestrator (`WeightSync`, colocated transport,
    staged buckets) into the embedded engine on the same device: bytes, seconds of the first and a later sync."""
    from beamrl.models.beam.lora_payload import ADAPTER, adapter_payload
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.rollout.native.engine import NativeEngine
    from beamrl.sync.export import StateDictSource
    from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
    from beamrl.sync.transports import TRANSPORTS

    if "adapter" not in state:
        raise RuntimeError("lora_train_small did not produce an adapter")
    config, lora, adapter = state["config"], state["lora"], state["adapter"]
    model = BeamForCausalLM(config, dtype=torch.bfloat16, device=device, seed=None)
    model.load_hf_tensors(state.pop("base"), strict=True)
    engine = NativeEngine.from_model(model, lora=lora)
    adapter = {k: v.to(device) for k, v in adapter.items()}
    nbytes = sum(t.numel() * t.element_size() for t in adapter.values())
    source = StateDictSource(adapter_payload(adapter, lora), mode=ADAPTER)
    sync = WeightSync(lambda r: TRANSPORTS.get("colocated")(r, device=device), [engine], bucket_bytes=512 << 20,
                      timeouts=SyncTimeouts.uniform(3600), progress=None)
    reports = [sync.sync(source) for _ in range(2)]
    sync.close()
    merged = adapted_num_parameters(config, lora) * BF16
    engine.shutdown()
    del engine, model
    free_device_memory()
    r = reports[1]
    return {"adapter_bytes": nbytes, "sync_bytes": r.bytes, "merged_bytes": merged, "buckets": r.buckets,
            "first_sync_s": reports[0].seconds, "sync_s": r.seconds, "sync_gb_per_s": r.bytes / r.seconds / 1e9,
            "merged_gb_per_s_equivalent": merged / r.seconds / 1e9, "tensors": len(adapter),
            "code_path": r.code_path}


def sections(args, state: dict) -> list:
    dev = args.device
    if args.tiny:
        cfg = preset("tiny")
        tr = dict(seq_len=16, seqs_per_micro_batch=2, micro_batches=2, warmup=1, steps=1)
        lora = LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS)
    else:
        cfg = preset("small")
        tr = dict(seq_len=args.train_seq_len, seqs_per_micro_batch=args.seqs_per_micro_batch,
                  micro_batches=args.micro_batches, warmup=args.warmup, steps=args.steps)
        lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets=ALL_TARGETS)
    return [("sizes_501b", lambda: sizes_501b(32)),
            ("lora_train_small", lambda: lora_train(cfg, lora, dev, state=state, **tr)),
            ("adapter_apply", lambda: adapter_apply(dev, state))]


def format_table(results: dict) -> str:
    lines = []
    for name, r in results.items():
        if name == "meta":
            continue
        if "error" in r:
            lines.append(f"{name:<18} ERROR {r['error'].strip().splitlines()[-1][:80]}")
        elif name == "sizes_501b":
            for k in ("attention", "experts", "experts_shared_a", "all"):
                v = r[k]
                lines.append(f"{'501B r32 ' + k:<26} adapter {v['adapter_bytes'] / 1e9:8.3f} GB  merged "
                             f"{v['merged_bytes'] / 1e9:8.1f} GB  adapter/full {100 * v['adapter_over_full']:.2f} %")
        elif name == "lora_train_small":
            lines.append(f"{name:<18} fwd+bwd {r['fwd_bwd_ms']:.1f} ms ({r['fwd_bwd_tokens_per_s']:,.0f} tok/s)  step "
                         f"{r['step_ms']:.1f} ms  peak {r['peak_mem_gib']:.1f} GiB  trainable "
                         f"{r['trainable_params'] / 1e6:.1f} M")
        else:
            lines.append(f"{name:<18} {r['sync_bytes'] / 1e6:.1f} MB in {r['sync_s']:.3f} s "
                         f"({r['sync_gb_per_s']:.2f} GB/s; first {r['first_sync_s']:.3f} s; {r['buckets']} buckets, "
                         f"merge at commit); merged-weight sync would move {r['merged_bytes'] / 1e9:.2f} GB")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes everywhere (CPU smoke run)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (default 32; alpha = 2 * rank)")
    p.add_argument("--train-seq-len", type=int, default=2048)
    p.add_argument("--seqs-per-micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="directory of the JSON")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu --tiny)")
    from beamrl.trainer.megatron.launch import set_one_rank_world_env

    set_one_rank_world_env()
    results = {"meta": {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                        "torch": torch.__version__, "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M")}}
    state: dict = {}
    path = args.out / "lora_h200.json"
    rc = run_sections(sections(args, state), results, path)
    print(format_table(results))
    print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
