"""Timing helpers shared by the GPU benchmarks: CUDA-event medians and the two ceilings of the same run."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def cuda_median_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3, prime_cycles: int = 4_000_000) -> float:
    """Median GPU time of fn (ms): one pair of CUDA events per call, each call queued behind a spin kernel.

    The spin kernel (`torch.cuda._sleep`, ~2 ms at H200 clocks) keeps the GPU busy while the host enqueues the
    events and fn's launches, so the events time the GPU work alone, not Python/launch overhead (which a
    single small op per timed region would otherwise measure). Without CUDA (a smoke run of the scripts on
    CPU) it falls back to the host clock."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if prime_cycles:
            torch.cuda._sleep(prime_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(gib: float = 2.0, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth, bytes read + written, on `gib` GiB of bf16 (random data)."""
    n = int(gib * 2 ** 30) // 2
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = cuda_median_ms(lambda: y.copy_(x), iters=20, warmup=3)
    del x, y
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, device: str = "cuda") -> float:
    """bf16 n^3 matmul rate on random data (the MFU ceiling of this run)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = cuda_median_ms(lambda: a @ b, iters=20, warmup=3)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v):
        if not isinstance(v, float):
            return str(v)
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def add_beam_width_args(ap) -> None:
    """--tokens and Beam's attention widths (defaults: 8192 tokens, hidden 5120, 48/8 heads x 128)."""
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)


def write_kernel_rows(path: str | None, copy_gbs: float, device: str, args, rows: list[dict]) -> None:
    """The JSON of a kernel benchmark run (kernels.py, kernel_sweep.py): the copy ceiling, device, torch, the
    command's arguments and every row; nothing when `path` is None."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(dict(copy_gbs=copy_gbs, device=device, torch=torch.__version__, args=vars(args), rows=rows), f,
                      indent=1)


def sync_device() -> None:
    """Wait for queued GPU work (no-op without CUDA), so a host clock around it times the work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_device_memory() -> None:
    """Drop unreachable objects and return cached GPU blocks, so one section's memory does not count in the next."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_micro_batches(vocab_size: int, seq_len: int, seqs_per_micro_batch: int, micro_batches: int, seed: int = 0):
    """Seeded random token sequences as `PackedBatch` micro-batches (the train-step benchmarks' input)."""
    from beamrl.trainer.protocol import PackedBatch

    g = torch.Generator().manual_seed(seed)
    return [PackedBatch.from_sequences([torch.randint(1, vocab_size, (seq_len,), generator=g)
                                        for _ in range(seqs_per_micro_batch)]) for _ in range(micro_batches)]


def time_train_steps(trainer, batches, warmup: int, steps: int) -> dict:
    """`warmup` untimed then `steps` timed train steps of a `MegatronTrainer` on `batches` (an NLL loss over the
    loss tokens): per-step forward+backward and full (with the optimizer) seconds, losses, tokens per step and the
    peak allocated GPU memory (nan on CPU)."""
    tokens = sum(b.num_tokens for b in batches)
    norm = sum(b.num_loss_tokens for b in batches)

    def loss_fn(logprobs, entropy, batch):
        return -(logprobs * batch.loss_mask).sum() / norm, {}

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    fb, full, losses = [], [], []
    for i in range(warmup + steps):
        sync_device()
        t0 = time.perf_counter()
        sums = trainer.forward_backward(batches, loss_fn)
        sync_device()
        t1 = time.perf_counter()
        trainer.optimizer_step()
        sync_device()
        t2 = time.perf_counter()
        losses.append(sums["loss"])
        if i >= warmup:
            fb.append(t1 - t0)
            full.append(t2 - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {"fwd_bwd_s": fb, "step_s": full, "losses": losses, "tokens": tokens, "peak_mem_gib": peak}


def run_sections(sections, results: dict, path) -> int:
    """Run `(name, fn)` sections in order, each in its own try/except so one failure keeps the others' results;
    print each section's result and rewrite the JSON at `path` after every section (a run cut by a time limit keeps
    what it measured). Returns 1 if any section failed, else 0."""
    import json
    import traceback

    path.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in sections:
        print(f"== {name} ...", flush=True)
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - keep the other sections' results
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc()}
            free_device_memory()
        print(f"   {json.dumps({k: v for k, v in results[name].items() if k not in ('error', 'losses')})}", flush=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(isinstance(v, dict) and "error" in v for v in results.values()) else 0
