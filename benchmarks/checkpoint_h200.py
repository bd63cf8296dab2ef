#!/usr/bin/env python
"""Trainer checkpoints on one H200 (docs/checkpoints.md): save and load seconds, and the step time while an
asynchronous save is being written vs without.

One rank, bf16, distributed optimizer (the RL loop's defaults), the `small` preset (4 layers at real width, 16
experts; 4.18 B params, about 58 GB per checkpoint: bf16 weights + FP32 main copies + two Adam moments). Steps:

  1. build the trainer (fused kernels where CUDA and triton exist, the RL loop's GPU setting; `--eager` for the
     eager ops), `--warmup` untimed steps, then `--steps` timed steps (step time without a save);
  2. sync save: `save_checkpoint(dir)` until the checkpoint is complete; the directory is then deleted;
  3. async save: the time `save_checkpoint(dir, async_save=True)` blocks (what a step waits for), then train steps
     while the background writer runs (each step ends with the driver's non-blocking `finalize_checkpoint`, as
     the RL loop does) until it is published; the step times of those steps, the total save time;
  4. load: a fresh trainer loads the async checkpoint: the digest check alone, and the whole `load_checkpoint`
     (which includes that check); the loaded weights must give the saved trainer's logprobs bit for bit.

Only one checkpoint exists at a time (`--dir`, default a temporary directory under $TMPDIR): the free space there
must exceed one checkpoint (checked first; the 64 GiB disk of `nvidia-h200` is too small for `small`'s 58 GB:
use `--dir` on a larger disk, e.g. on `nvidia-h200-x2`, or `--layers 2`: 2.7 B params, 38 GB).

  python benchmarks/checkpoint_h200.py --json $OUT/checkpoint_h200.json   # one H200
  python benchmarks/checkpoint_h200.py --device cpu --tiny --json /tmp/c.json   # CPU smoke run (tiny preset)
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--tiny" in __import__("sys").argv:  # CPU smoke run: Megatron's jit_fuser would compile each tiny op
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from beamrl.models.beam import preset  # noqa: E402

#: Bytes per parameter of a bf16 + distributed-optimizer checkpoint: bf16 weight, FP32 main copy, two FP32 moments.
BYTES_PER_PARAM = 2 + 4 + 4 + 4


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _trainer(config, fused: bool):
    from beamrl.trainer.megatron.config import TrainerConfig
    from beamrl.trainer.megatron.worker import MegatronTrainer, TrainerSetup

    trainer = TrainerConfig(num_gpus=1, global_batch_size=1, lr=1e-6, distributed_optimizer=True,
                            use_fused_kernels=fused)
    return MegatronTrainer(TrainerSetup(model=config, trainer=trainer, dtype="bfloat16", timeout_s=3600.0))


def _batches(config, seq_len: int, seqs: int, micro_batches: int, seed: int = 0):
    from beamrl.trainer.protocol import PackedBatch

    g = torch.Generator().manual_seed(seed)
    return [PackedBatch.from_sequences([torch.randint(1, config.vocab_size, (seq_len,), generator=g)
                                        for _ in range(seqs)]) for _ in range(micro_batches)]


def _step(trainer, batches, poll: bool = False) -> float:
    norm = sum(b.num_loss_tokens for b in batches)

    def loss_fn(logprobs, entropy, batch):
        return -(logprobs * batch.loss_mask).sum() / norm, {}

    _sync()
    t0 = time.perf_counter()
    trainer.train_step(batches, loss_fn)
    if poll:
        trainer.finalize_checkpoint(blocking=False)
    _sync()
    return time.perf_counter() - t0


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def run(config, root: Path, fused: bool, seq_len: int, seqs: int, micro_batches: int, warmup: int,
        steps: int) -> dict:
    from beamrl.trainer.megatron.checkpoint import check

    batches = _batches(config, seq_len, seqs, micro_batches)
    probe = batches[0]
    trainer = _trainer(config, fused)
    for _ in range(warmup):
        _step(trainer, batches)
    baseline = [_step(trainer, batches) for _ in range(steps)]
    out = {"params": config.num_parameters(), "fused_kernels": fused, "tokens_per_step": sum(b.num_tokens for b in batches),
           "step_s": statistics.median(baseline), "step_s_all": baseline}

    sync_dir = root / "sync"
    _sync()
    t0 = time.perf_counter()
    trainer.save_checkpoint(sync_dir)
    out["sync_save_s"] = time.perf_counter() - t0
    out["checkpoint_bytes"] = _size(sync_dir)
    shutil.rmtree(sync_dir)

    async_dir = root / "async"
    saved_logprobs = trainer.compute_logprobs(probe, return_entropy=False).logprobs
    _sync()
    t0 = time.perf_counter()
    trainer.save_checkpoint(async_dir, async_save=True)
    out["async_save_blocking_s"] = time.perf_counter() - t0
    in_flight = []
    while not (async_dir / "beamrl_checkpoint.json").exists() and len(in_flight) < 1000:
        in_flight.append(_step(trainer, batches, poll=True))
    trainer.finalize_checkpoint(blocking=True)  # no-op once published
    out["async_save_total_s"] = time.perf_counter() - t0
    out["steps_during_async_save"] = len(in_flight)
    out["step_s_during_async_save"] = statistics.median(in_flight) if in_flight else float("nan")
    out["step_s_during_async_save_all"] = in_flight
    trainer.shutdown()
    del trainer
    _free()

    t0 = time.perf_counter()
    damaged = check(async_dir, full=True)
    out["verify_s"] = time.perf_counter() - t0
    if damaged:
        raise RuntimeError(f"the benchmark's own checkpoint is damaged: {damaged}")
    loaded = _trainer(config, fused)
    _sync()
    t0 = time.perf_counter()
    loaded.load_checkpoint(async_dir)
    _sync()
    out["load_s"] = time.perf_counter() - t0
    out["load_matches_saved"] = bool(torch.equal(loaded.compute_logprobs(probe, return_entropy=False).logprobs,
                                                 saved_logprobs))
    loaded.shutdown()
    del loaded
    _free()
    shutil.rmtree(async_dir)
    return out


def format_table(r: dict) -> str:
    gb = r["checkpoint_bytes"] / 1e9
    rows = [("checkpoint size", f"{gb:.2f} GB ({r['params'] / 1e9:.2f} B params)"),
            ("step, no save", f"{r['step_s'] * 1e3:.1f} ms (median of {len(r['step_s_all'])})"),
            ("save, sync", f"{r['sync_save_s']:.2f} s ({gb / r['sync_save_s']:.2f} GB/s)"),
            ("save, async: step waits", f"{r['async_save_blocking_s']:.2f} s"),
            ("save, async: until published", f"{r['async_save_total_s']:.2f} s"),
            ("step, async save in flight", f"{r['step_s_during_async_save'] * 1e3:.1f} ms (median of "
                                           f"{r['steps_during_async_save']})"),
            ("verify digests", f"{r['verify_s']:.2f} s"),
            ("load (incl. verify)", f"{r['load_s']:.2f} s ({gb / r['load_s']:.2f} GB/s)"),
            ("loaded == saved logprobs", str(r["load_matches_saved"]))]
    return "\n".join(f"{k:<30} {v}" for k, v in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the tiny preset and short steps (CPU smoke run)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's num_hidden_layers")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--seqs-per-micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps without a save (default 5)")
    p.add_argument("--eager", action="store_true", help="eager ops even where the fused kernels (CUDA + triton) exist")
    p.add_argument("--dir", type=Path, default=None, help="where the checkpoints are written (default: $TMPDIR)")
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "checkpoint_h200.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu --tiny)")
    config = preset("tiny" if args.tiny else "small")
    if args.layers is not None:
        moe = config.mlp_layer_types
        config = config.replace(num_hidden_layers=args.layers, layer_types=config.layer_types[:args.layers],
                                mlp_layer_types=moe[:args.layers] if moe else moe)
    if args.tiny:
        args.seq_len, args.seqs_per_micro_batch, args.micro_batches = 32, 2, 2
        args.warmup, args.steps = 1, 2
    root = Path(tempfile.mkdtemp(prefix="beamrl-ckpt-bench-", dir=args.dir))
    need = config.num_parameters() * BYTES_PER_PARAM
    free = shutil.disk_usage(root).free
    if free < 1.1 * need:
        shutil.rmtree(root)
        p.error(f"{root.parent} has {free / 1e9:.1f} GB free; one checkpoint of this model needs about "
                f"{need / 1e9:.1f} GB (use --dir on a larger disk, or fewer --layers)")
    from beamrl.trainer.megatron.launch import set_one_rank_world_env

    set_one_rank_world_env()
    from beamrl.trainer.megatron.config import ParallelConfig
    from beamrl.trainer.megatron.parallel import initialize_parallel

    initialize_parallel(ParallelConfig())
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
            "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M"), "dir": str(root),
            "preset": "tiny" if args.tiny else "small", "layers": config.num_hidden_layers}
    try:
        fused = args.device == "cuda" and not args.eager and importlib.util.find_spec("triton") is not None
        result = run(config, root, fused, args.seq_len, args.seqs_per_micro_batch, args.micro_batches, args.warmup,
                     args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(format_table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if result["load_matches_saved"] else 1


if __name__ == "__main__":
    sys.exit(main())
