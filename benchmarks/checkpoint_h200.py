#!/usr/bin/env python
"""Trainer checkpoints on one H200 (docs/checkpoints.md): save and load seconds (sync and async, per phase), and
the step time while an asynchronous save is being written vs without.

One rank, bf16, distributed optimizer (the RL loop's defaults), the `small` preset (4 layers at real width, 16
experts; 4.18 B params, about 58 GB per checkpoint: bf16 weights + FP32 main copies + two Adam moments; `--layers 1`:
1.98 B params, 27.7 GB). Phases, each followed by a progress line and a rewrite of `--json` (a run cut short by a
time limit keeps what it measured):

  1. build the trainer (fused kernels where CUDA and triton exist, the RL loop's GPU setting; `--eager` for the
     eager ops), `--warmup` untimed steps, then `--steps` timed steps (step time without a save);
  2. sync save: `save_checkpoint(dir)` until the checkpoint is complete, with the trainer's per-phase costs (state,
     staging, writing, fsync, publish); the directory is then deleted;
  3. async save: the time `save_checkpoint(dir, async_save=True)` blocks (what a step waits for), then train steps
     while the background writer runs (each step ends with the driver's non-blocking `finalize_checkpoint`, as
     the RL loop does) until it is published; the step times of those steps, the total save time;
  4. load: a fresh trainer loads the async checkpoint (digest check, then the tensors; per-phase costs); the
     loaded weights must give the saved trainer's logprobs bit for bit.

Only one checkpoint exists at a time (`--dir`, default a temporary directory under $TMPDIR): the free space there
must exceed one checkpoint (checked first; the 64 GiB disk of `nvidia-h200` holds `--layers 1` or `--layers 2`,
not the full preset: use `--dir` on a larger disk, e.g. on `nvidia-h200-x2`).

  python benchmarks/checkpoint_h200.py --layers 1 --warmup 1 --steps 3 --json $OUT/checkpoint_h200.json
  python benchmarks/checkpoint_h200.py --device cpu --tiny --json /tmp/c.json   # CPU smoke run (tiny preset)
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--tiny" in __import__("sys").argv:  # CPU smoke run: Megatron's jit_fuser would compile each tiny op
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
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
from benchmarks._bench_utils import free_device_memory, sync_device  # noqa: E402

#: Bytes per parameter of a bf16 + distributed-optimizer checkpoint: bf16 weight, FP32 main copy, two FP32 moments.
BYTES_PER_PARAM = 2 + 4 + 4 + 4




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

    sync_device()
    t0 = time.perf_counter()
    trainer.train_step(batches, loss_fn)
    if poll:
        trainer.finalize_checkpoint(blocking=False)
    sync_device()
    return time.perf_counter() - t0


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


class _Report:
    """The results so far: a progress line per finished phase (flushed) and `path` rewritten after each, so a run
    cut short by a time limit still shows and keeps what it measured."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.out, self.t_start = path, {"meta": meta, "phases_done": []}, time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def phase(self, what: str, shown: dict, **values) -> None:
        self.out.update(values)
        self.out["phases_done"].append(what)
        self.out["elapsed_s"] = time.perf_counter() - self.t_start
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.out, indent=2, default=str) + "\n")
        tmp.replace(self.path)
        line = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        print(f"[checkpoint bench +{self.out['elapsed_s']:6.1f} s] {what} {line}", flush=True)


def _costs_line(c: dict) -> dict:
    keys = ("step_waited_s", "state_s", "stage_s", "write_wall_s", "fsync_thread_s", "publish_s", "total_s",
            "verify_s", "read_s", "restore_s")
    return {k: c[k] for k in keys if k in c}


def run(config, root: Path, fused: bool, seq_len: int, seqs: int, micro_batches: int, warmup: int,
        steps: int, report: _Report) -> dict:
    batches = _batches(config, seq_len, seqs, micro_batches)
    probe = batches[0]
    trainer = _trainer(config, fused)
    report.phase("trainer built", {"params": config.num_parameters()}, params=config.num_parameters(),
                 fused_kernels=fused, tokens_per_step=sum(b.num_tokens for b in batches))
    for _ in range(warmup):
        _step(trainer, batches)
    baseline = [_step(trainer, batches) for _ in range(steps)]
    report.phase("steps without a save", {"step_s": statistics.median(baseline)},
                 step_s=statistics.median(baseline), step_s_all=baseline)

    sync_dir = root / "sync"
    sync_device()
    t0 = time.perf_counter()
    trainer.save_checkpoint(sync_dir)
    sync_s = time.perf_counter() - t0
    costs = trainer.checkpoint_costs()["save"]
    size = _size(sync_dir)
    report.phase("sync save", {"seconds": sync_s, "gb": size / 1e9, **_costs_line(costs)}, sync_save_s=sync_s,
                 checkpoint_bytes=size, sync_save_costs=costs)
    shutil.rmtree(sync_dir)

    async_dir = root / "async"
    saved_logprobs = trainer.compute_logprobs(probe, return_entropy=False).logprobs
    sync_device()
    t0 = time.perf_counter()
    trainer.save_checkpoint(async_dir, async_save=True)
    blocking = time.perf_counter() - t0
    in_flight = []
    while not (async_dir / "beamrl_checkpoint.json").exists() and len(in_flight) < 10000:
        in_flight.append(_step(trainer, batches, poll=True))
    trainer.finalize_checkpoint(blocking=True)  # no-op once published
    total = time.perf_counter() - t0
    costs = trainer.checkpoint_costs()["save"]
    median = statistics.median(in_flight) if in_flight else float("nan")
    report.phase("async save", {"blocking_s": blocking, "total_s": total, "steps": len(in_flight), "step_s": median,
                                **_costs_line(costs)},
                 async_save_blocking_s=blocking, async_save_total_s=total, steps_during_async_save=len(in_flight),
                 step_s_during_async_save=median, step_s_during_async_save_all=in_flight, async_save_costs=costs)
    trainer.shutdown()
    del trainer
    free_device_memory()

    loaded = _trainer(config, fused)
    sync_device()
    t0 = time.perf_counter()
    loaded.load_checkpoint(async_dir)
    sync_device()
    load_s = time.perf_counter() - t0
    costs = loaded.checkpoint_costs()["load"]
    matches = bool(torch.equal(loaded.compute_logprobs(probe, return_entropy=False).logprobs, saved_logprobs))
    report.phase("load", {"seconds": load_s, "matches_saved": matches, **_costs_line(costs)}, load_s=load_s,
                 verify_s=costs["verify_s"], load_costs=costs, load_matches_saved=matches)
    loaded.shutdown()
    del loaded
    free_device_memory()
    shutil.rmtree(async_dir)
    return report.out


def format_table(r: dict) -> str:
    gb = r["checkpoint_bytes"] / 1e9
    rows = [("checkpoint size", f"{gb:.2f} GB ({r['params'] / 1e9:.2f} B params)"),
            ("step, no save", f"{r['step_s'] * 1e3:.1f} ms (median of {len(r['step_s_all'])})"),
            ("save, sync", f"{r['sync_save_s']:.2f} s ({gb / r['sync_save_s']:.2f} GB/s)"),
            ("save, async: step waits", f"{r['async_save_blocking_s']:.2f} s"),
            ("save, async: until published", f"{r['async_save_total_s']:.2f} s"),
            ("step, async save in flight", f"{r['step_s_during_async_save'] * 1e3:.1f} ms (median of "
                                           f"{r['steps_during_async_save']})"),
            ("load: verify digests", f"{r['verify_s']:.2f} s"),
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
                     args.steps, _Report(args.json, meta))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(format_table(result))
    print(f"wrote {args.json}")
    return 0 if result["load_matches_saved"] else 1


if __name__ == "__main__":
    sys.exit(main())
