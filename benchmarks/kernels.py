"""Benchmark Beam's fused trainer kernels against their eager versions on one GPU.

For each op: forward and forward+backward median time (CUDA events), achieved GB/s (the fewest bytes the op
must move: each input read once, each output written once) as a fraction of the device-to-device copy
bandwidth measured in the same run, the speed-up over eager, and the forward's bit mismatches against eager
at this size. Prints a markdown table; --json writes all numbers.

    PYTHONPATH=. python benchmarks/kernels.py --tokens 8192 --json /tmp/kernels.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

if "--smoke-cpu" in sys.argv:  # Triton's own interpreter switch, read when the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "1"

from benchmarks._bench_utils import (add_beam_width_args, copy_bandwidth_gbs, cuda_median_ms, markdown_table,
                                     write_kernel_rows)
from beamrl.kernels import ops
from beamrl.models.beam import numerics


def _bench_op(name, make_inputs, run, fwd_bytes, bwd_bytes, copy_bw, n_grad_inputs, canon=lambda o: o, iters=20):
    """Time eager and triton forward and forward+backward of `run(inputs, backend) -> tuple of outputs`."""
    timed = dict(iters=iters, warmup=min(3, iters))
    rows, mism = [], {}
    outs = {}
    for backend in ("eager", "triton"):
        torch.manual_seed(1234)  # the same inputs for both backends
        inputs = make_inputs()
        with torch.no_grad():
            outs[backend] = run(inputs, backend)
        fwd = cuda_median_ms(lambda: run(inputs, backend), **timed)
        fwd_host = cuda_median_ms(lambda: run(inputs, backend), prime_cycles=0, **timed)
        leaves = [x.detach().clone().requires_grad_() if i < n_grad_inputs else x for i, x in enumerate(inputs)]
        probe = run(leaves, backend)
        grads = [torch.randn_like(o) for o in probe if o is not None and o.is_floating_point()]

        def step():
            for x in leaves[:n_grad_inputs]:
                x.grad = None
            o = [t for t in run(leaves, backend) if t is not None and t.is_floating_point()]
            torch.autograd.backward(o, grads)

        fwdbwd = cuda_median_ms(step, **timed)
        rows.append(dict(op=name, backend=backend, fwd_ms=fwd, fwd_host_ms=fwd_host, fwd_gbs=fwd_bytes / fwd / 1e6,
                         fwdbwd_ms=fwdbwd, fwdbwd_gbs=(fwd_bytes + bwd_bytes) / fwdbwd / 1e6))
    for i, (a, b) in enumerate(zip(canon(outs["triton"]), canon(outs["eager"]))):
        if a is None or not a.is_floating_point():
            continue
        diff = a != b
        eps = 2.0 ** -8 if b.dtype == torch.bfloat16 else torch.finfo(b.dtype).eps
        ulp = (b.float().abs() * eps).clamp_min(2.0 ** -133)
        mism[f"out{i}"] = dict(mismatches=int(diff.sum()), numel=b.numel(),
                               max_ulp=float(((a.float() - b.float()).abs() / ulp)[diff].max()) if diff.any() else 0.0)
    for r in rows:
        r["fwd_frac_copy"] = r["fwd_gbs"] / copy_bw
        r["fwdbwd_frac_copy"] = r["fwdbwd_gbs"] / copy_bw
        r["mismatch"] = mism
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_beam_width_args(ap)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1 (no timings)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per median (default 20; 1 for a smoke run)")
    args = ap.parse_args(argv)
    if args.iters < 1:
        print("benchmarks/kernels.py: --iters must be >= 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not args.smoke_cpu:
        print("benchmarks/kernels.py needs a CUDA device (or --smoke-cpu)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t, h, hq, hkv, d, e = args.tokens, args.hidden, args.heads, args.kv_heads, args.head_dim, args.experts
    bf = torch.bfloat16
    copy_bw = copy_bandwidth_gbs(gib=2.0 if dev == "cuda" else 0.01, device=dev)
    timed = dict(iters=args.iters, warmup=min(3, args.iters))
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}  copy bandwidth {copy_bw:,.0f} GB/s",
          flush=True)
    scales = (1 / math.sqrt(8), math.sqrt(7) / math.sqrt(8))
    rows = []

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    # (a) post-norm -> DSR -> pre-norm
    act = t * h * 2
    rows += _bench_op("post_norm_residual_pre_norm",
                      lambda: [rnd(t, h, scale=3), rnd(t, h), rnd(h), rnd(h)],
                      lambda x, b: ops.post_norm_residual_pre_norm(x[0], x[1], x[2], x[3], scales, 1e-6, backend=b),
                      4 * act, 6 * act, copy_bw, 4, iters=args.iters)
    print("done: post_norm_residual_pre_norm", flush=True)
    # (b) QK norm + RoPE / SSMax, q and k as views of one fused projection output
    pos = torch.arange(t, device=dev)
    cos, sin = numerics.rope_cos_sin(pos, d, 10000.0)
    scale = numerics.ssmax_scale(pos)
    qk_bytes = t * (hq + hkv) * d * 2

    def qk_inputs():
        qk = rnd(t, (hq + hkv) * d, scale=2)
        return [qk[:, :hq * d].view(t, hq, d), qk[:, hq * d:].view(t, hkv, d), rnd(d), rnd(d)]

    rows += _bench_op("qk_norm_rope", qk_inputs,
                      lambda x, b: ops.qk_norm_rope(x[0], x[1], x[2], x[3], cos, sin, 1e-6, backend=b),
                      2 * qk_bytes + 2 * t * d // 2 * 4, 3 * qk_bytes + 2 * t * d // 2 * 4, copy_bw, 4,
                      iters=args.iters)
    print("done: qk_norm_rope", flush=True)
    rows += _bench_op("qk_norm_ssmax", qk_inputs,
                      lambda x, b: ops.qk_norm_ssmax(x[0], x[1], x[2], x[3], scale, 1e-6, backend=b),
                      2 * qk_bytes + t * 4, 3 * qk_bytes + t * 4, copy_bw, 4, iters=args.iters)
    print("done: qk_norm_ssmax", flush=True)
    # (c) output gate
    og = t * hq * d * 2
    rows += _bench_op("output_gate", lambda: [rnd(t, hq, d), rnd(t, hq, d, scale=3), rnd(hq)],
                      lambda x, b: (ops.output_gate(x[0], x[1], x[2], backend=b),), 3 * og, 5 * og, copy_bw, 3,
                      iters=args.iters)
    print("done: output_gate", flush=True)
    # (d) router: FP32 logits GEMM (same in both) + selection; bytes of the selection only (logits in, w/ids out)
    corr = torch.randn(e, device=dev) * 0.01
    sel_bytes = t * e * 4 + t * 8 * 12
    rows += _bench_op("route (GEMM + grouped top-k)",
                      lambda: [rnd(t, h), torch.randn(e, h, device=dev) * 0.02],
                      lambda x, b: ops.route(x[0], x[1], corr, 8, 8, 4, backend=b),
                      sel_bytes, t * e * 4 * 2, copy_bw, 2,
                      canon=lambda o: (o[0].gather(1, o[1].argsort(1)), o[1].sort(1).values), iters=args.iters)
    from beamrl.kernels.router_topk import fused_grouped_topk
    logits = torch.randn(t, e, device=dev)
    sel = {}
    sel["eager"] = cuda_median_ms(lambda: numerics.grouped_topk(logits, corr, 8, 8, 4), **timed)
    sel["triton"] = cuda_median_ms(lambda: fused_grouped_topk(logits, corr, 8, 8, 4), **timed)
    for b in ("eager", "triton"):
        rows.append(dict(op="grouped top-k only (logits given)", backend=b, fwd_ms=sel[b],
                         fwd_gbs=sel_bytes / sel[b] / 1e6, fwdbwd_ms=float("nan"), fwdbwd_gbs=float("nan"),
                         fwd_frac_copy=sel_bytes / sel[b] / 1e6 / copy_bw, fwdbwd_frac_copy=float("nan"), mismatch={}))
    print("done: route", flush=True)
    # MoE glue: SwiGLU on the packed gate/up output, weight + un-permute + combine of the down output
    from beamrl.kernels.grouped_experts import sort_by_expert
    from beamrl.kernels.moe_combine import fused_combine
    from beamrl.kernels.swiglu import fused_swiglu
    inter, k = 2560, 8
    n = t * k
    rows += _bench_op("swiglu [T*8, 2*2560]", lambda: [rnd(n, 2 * inter, scale=3)],
                      lambda x, b: (fused_swiglu(x[0]) if b == "triton"
                                    else numerics.swiglu(x[0][:, :inter], x[0][:, inter:]),),
                      n * 3 * inter * 2, n * 5 * inter * 2, copy_bw, 1, iters=args.iters)
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    order, _, _, inverse = sort_by_expert(ids, e)

    def combine(x, b):
        if b == "triton":
            return (fused_combine(x[0], inverse, x[1], 2.5),)
        ys = (x[0].float() * x[1].reshape(-1)[order].unsqueeze(-1)).to(x[0].dtype)
        return (numerics.moe_combine(ys[inverse].view(t, k, h), 2.5),)

    rows += _bench_op("moe combine [T*8, H] -> [T, H]", lambda: [rnd(n, h), torch.rand(t, k, device=dev)], combine,
                      n * h * 2 + t * h * 2, 2 * n * h * 2 + t * h * 2, copy_bw, 2, iters=args.iters)
    print("done: moe glue", flush=True)

    table = []
    for r in rows:
        eager = next(x for x in rows if x["op"] == r["op"] and x["backend"] == "eager")
        mm = "; ".join(f"{k}: {v['mismatches']}/{v['numel']} (≤{v['max_ulp']:.0f} ulp)"
                       for k, v in r["mismatch"].items()) if r["backend"] == "triton" else ""
        table.append([r["op"], r["backend"], r["fwd_ms"], r.get("fwd_host_ms", float("nan")), r["fwd_gbs"],
                      r["fwd_frac_copy"],
                      eager["fwd_ms"] / r["fwd_ms"], r["fwdbwd_ms"], r["fwdbwd_frac_copy"],
                      eager["fwdbwd_ms"] / r["fwdbwd_ms"] if r["fwdbwd_ms"] == r["fwdbwd_ms"] else float("nan"), mm])
    print(markdown_table(["op", "backend", "fwd ms", "fwd ms incl. host", "fwd GB/s", "fwd / copy", "fwd speed-up",
                          "fwd+bwd ms",
                          "fwd+bwd / copy", "fwd+bwd speed-up", "fwd bit mismatches vs eager"], table))
    write_kernel_rows(args.json, copy_bw, name, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
