"""Benchmark one real-width Beam decoder layer (SWA attention + MoE), forward+backward, on one GPU.

Variants: eager (numerics ops + compiled FlexAttention + grouped expert GEMMs), torch.compile of that same
eager layer, fused (Triton kernels + FlexAttention + grouped GEMMs), and fused with torch.compile around it.
"gemm-floor" runs only the layer's matrix work at the same shapes, forward and backward: the QKVG and output
projections, FlexAttention, the FP32 router GEMM and the two grouped expert GEMMs on already-sorted rows (no
norms, gates, permutation or combine). No implementation of the layer can be faster than that.
FLOPs = 3 x forward (all projections, windowed attention QK^T and PV, the active experts' three GEMMs, the
router GEMM); MFU against the bf16 matmul rate measured in the same run.

    PYTHONPATH=. python benchmarks/beam_layer.py --tokens 8192 --experts 64 --json /tmp/layer.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

if "--smoke-cpu" in sys.argv:  # the fused variants' kernels on Triton's interpreter (read at their import)
    os.environ["TRITON_INTERPRET"] = "1"

from benchmarks._bench_utils import cuda_median_ms, markdown_table, matmul_tflops
from beamrl.kernels import ops
from beamrl.kernels.flex_attention import packed_block_mask
from beamrl.kernels.grouped_experts import grouped_mm_experts
from beamrl.models.beam import numerics


def make_params(hidden, hq, hkv, d, experts, inter, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    p = dict(
        w_qkvg=w(2 * hq * d + 2 * hkv * d, hidden, scale=hidden ** -0.5),
        w_o=w(hidden, hq * d, scale=(hq * d) ** -0.5),
        in_norm=1 + w(hidden, scale=0.1), post_attn_norm=1 + w(hidden, scale=0.1),
        pre_ffn_norm=1 + w(hidden, scale=0.1), post_ffn_norm=1 + w(hidden, scale=0.1),
        q_norm=1 + w(d, scale=0.1), k_norm=1 + w(d, scale=0.1), gate_bias=w(hq, scale=1.0),
        router=(torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to(device),
        w_gate_up=w(experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w_down=w(experts, hidden, inter, scale=inter ** -0.5),
    )
    corr = (torch.randn(experts, generator=g) * 0.01).to(device)
    for v in p.values():
        v.requires_grad_()
    return p, corr


def layer_forward(h, a, p, corr, cos, sin, cu, mask, dims, elem_backend, layer_id=10):
    """One SWA + MoE layer in the trainer's order; returns (new residual, next layer's input-normed)."""
    t = h.shape[0]
    hq, hkv, d, window = dims
    qkvg = a @ p["w_qkvg"].t()
    q = qkvg[:, :hq * d].view(t, hq, d)
    k = qkvg[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkvg[:, (hq + hkv) * d:(hq + 2 * hkv) * d].view(t, hkv, d)
    g = qkvg[:, (hq + 2 * hkv) * d:].view(t, hq, d)
    q, k = ops.qk_norm_rope(q, k, p["q_norm"], p["k_norm"], cos, sin, 1e-6, backend=elem_backend)
    o = ops.attention(q, k, v, cu, window, backend="flex", block_mask=mask)
    o = ops.output_gate(o, g, p["gate_bias"], backend=elem_backend)
    o = o.reshape(t, hq * d) @ p["w_o"].t()
    d_attn = 2 * (layer_id + 1)
    h1, m_in = ops.post_norm_residual_pre_norm(o, h, p["post_attn_norm"], p["pre_ffn_norm"],
                                               (1 / math.sqrt(d_attn), math.sqrt(d_attn - 1) / math.sqrt(d_attn)),
                                               1e-6, backend=elem_backend)
    weights, ids = ops.route(m_in, p["router"], corr, 8, 8, 4, backend=elem_backend)
    # grouped GEMMs in every variant; the Triton SwiGLU/combine glue only in the fused ones
    m = grouped_mm_experts(m_in, ids, weights, p["w_gate_up"], p["w_down"], 2.5, fused_glue=elem_backend == "triton")
    d_mlp = d_attn + 1
    return ops.post_norm_residual_pre_norm(m, h1, p["post_ffn_norm"], p["in_norm"],
                                           (1 / math.sqrt(d_mlp), math.sqrt(d_mlp - 1) / math.sqrt(d_mlp)),
                                           1e-6, backend=elem_backend)


def forward_flops(t, hidden, hq, hkv, d, window, experts, inter, top_k):
    proj = 2 * t * hidden * (2 * hq * d + 2 * hkv * d) + 2 * t * hq * d * hidden
    pairs = sum(min(i + 1, window) for i in range(t))
    attn = 4 * pairs * hq * d
    moe = top_k * t * (2 * hidden * 2 * inter + 2 * inter * hidden)
    router = 2 * t * hidden * experts
    return proj + attn + moe + router


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call (default 2)")
    ap.add_argument("--variants", type=str,
                    default="eager,compile,compile-exact-casts,fused,fused+compile,gemm-floor")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny-width CPU forward-only check of the variants")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke_cpu:
        print("benchmarks/beam_layer.py needs a CUDA device (or --smoke-cpu)", file=sys.stderr)
        return 2
    hidden, hq, hkv, d, window, inter = 5120, 48, 8, 128, 512, 2560
    t, e = args.tokens, args.experts
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":  # smoke: same code path at toy width
        hidden, hq, hkv, d, window, inter = 64, 4, 2, 16, 8, 32
    peak = matmul_tflops(8192 if dev.type == "cuda" else 256, device=str(dev))
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}  bf16 matmul {peak:.0f} TFLOP/s",
          flush=True)
    p, corr = make_params(hidden, hq, hkv, d, e, inter, dev)
    pos = torch.arange(t, device=dev)
    cos, sin = numerics.rope_cos_sin(pos, d, 10000.0)
    cu = torch.tensor([0, t], device=dev, dtype=torch.int32)
    mask = packed_block_mask(cu, t, window, dev)
    gen = torch.Generator(device="cpu").manual_seed(1)
    h0 = torch.randn(t, hidden, generator=gen).to(dev, torch.bfloat16)
    a0 = numerics.rms_norm(h0, p["in_norm"].detach(), 1e-6)
    grads = [torch.randn(t, hidden, generator=gen).to(dev, torch.bfloat16) for _ in range(2)]
    flops = 3 * forward_flops(t, hidden, hq, hkv, d, window, e, inter, 8)
    dims = (hq, hkv, d, window)

    def make_fn(elem_backend, compiled, exact_casts=False):
        def fwd(h, a):
            return layer_forward(h, a, p, corr, cos, sin, cu, mask, dims, elem_backend)

        if compiled:
            # emulate_precision_casts: inductor keeps every BF16 rounding of the eager graph instead of
            # computing fused elementwise chains in FP32 (which breaks the engine's rounding contract)
            options = {"emulate_precision_casts": True} if exact_casts else None
            f = torch.compile(fwd, options=options)
        else:
            f = fwd

        def step():
            for v in p.values():
                v.grad = None
            if dev.type != "cuda":  # FlexAttention has no CPU backward: the CPU smoke run is forward only
                with torch.no_grad():
                    return f(h0, a0)
            h = h0.detach().requires_grad_()
            a = a0.detach().requires_grad_()
            outs = f(h, a)
            torch.autograd.backward(outs, grads)
            return outs
        return step

    def make_floor():
        # fixed routes: sorted rows and per-expert offsets as the real layer would produce them
        with torch.no_grad():
            _, ids = ops.route(a0, p["router"], corr, 8, 8, 4, backend="eager")
        from beamrl.kernels.grouped_experts import sort_by_expert
        _, tokens, counts, _ = sort_by_expert(ids, e)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs0 = a0[tokens].contiguous()
        act0 = torch.randn(xs0.shape[0], inter, generator=gen).to(dev, torch.bfloat16)
        g_gu = torch.randn(xs0.shape[0], 2 * inter, generator=gen).to(dev, torch.bfloat16)
        g_down = torch.randn(xs0.shape[0], hidden, generator=gen).to(dev, torch.bfloat16)
        g_logits = torch.randn(t, e, generator=gen).to(dev)

        def step():
            for v in p.values():
                v.grad = None
            a = a0.detach().requires_grad_()
            qkvg = a @ p["w_qkvg"].t()
            q = qkvg[:, :hq * d].view(t, hq, d)
            k = qkvg[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
            v = qkvg[:, (hq + hkv) * d:(hq + 2 * hkv) * d].view(t, hkv, d)
            o = ops.attention(q, k, v, cu, window, backend="flex", block_mask=mask)
            out = o.reshape(t, hq * d) @ p["w_o"].t()
            logits = a.float() @ p["router"].t()
            xs = xs0.detach().requires_grad_()
            act = act0.detach().requires_grad_()
            gu = torch._grouped_mm(xs, p["w_gate_up"].transpose(-2, -1), offs=offs)
            down = torch._grouped_mm(act, p["w_down"].transpose(-2, -1), offs=offs)
            torch.autograd.backward([out, logits, gu, down], [grads[0], g_logits, g_gu, g_down])
            return out, down
        return step

    variants = {"eager": ("eager", False, False), "compile": ("eager", True, False),
                "compile-exact-casts": ("eager", True, True), "fused": ("triton", False, False),
                "fused+compile": ("triton", True, False), "gemm-floor": None}
    results, outputs = [], {}
    for name in args.variants.split(","):
        try:
            if variants[name] is None:
                if dev.type != "cuda":
                    continue  # grouped GEMMs and FlexAttention backward need CUDA
                step = make_floor()
            else:
                step = make_fn(*variants[name])
            t0 = time.time()
            outs = step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            first = time.time() - t0
            if variants[name] is not None:
                outputs[name] = [o.detach() for o in outs]
            # whole steps: host time included
            ms = cuda_median_ms(step, iters=args.iters, warmup=args.warmup, prime_cycles=0)
            tflops = flops / (ms * 1e-3) / 1e12
            results.append(dict(variant=name, ms=ms, tokens_per_s=t / (ms * 1e-3), tflops=tflops, mfu=tflops / peak,
                                first_call_s=first,
                                peak_mem_gib=(torch.cuda.max_memory_allocated() / 2 ** 30
                                              if dev.type == "cuda" else 0.0)))
            print(f"done: {name} {ms:.1f} ms, {t / (ms * 1e-3):,.0f} tokens/s, MFU {tflops / peak:.3f} "
                  f"(first call {first:.1f} s)", flush=True)
        except Exception as err:  # report and keep measuring the other variants
            traceback.print_exc()
            results.append(dict(variant=name, error=f"{type(err).__name__}: {err}"[:300]))
        if args.json:  # after every variant, so a run cut short still reports what finished
            with open(args.json, "w") as f:
                json.dump(dict(peak_tflops=peak, flops_per_step=flops, args=vars(args), results=results), f, indent=1)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
    base = {r["variant"]: r.get("ms") for r in results}
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["variant"], "failed: " + r["error"][:120], "", "", "", "", "", ""])
            continue
        ref = outputs.get("eager")
        err = ""
        if ref is not None and r["variant"] in outputs:
            o = outputs[r["variant"]]
            r["h_rel_diff_vs_eager"] = float((o[0].float() - ref[0].float()).norm() / ref[0].float().norm())
            err = f"{r['h_rel_diff_vs_eager']:.2e}"
        rows.append([r["variant"], r["ms"], f"{r['tokens_per_s']:,.0f}", r["tflops"], f"{r['mfu']:.3f}",
                     f"{base['compile'] / r['ms']:.2f}x" if base.get("compile") else "", err,
                     f"{r['first_call_s']:.1f}"])
    print(f"\nBeam layer (SWA + MoE), {t} tokens, hidden {hidden}, {hq}/{hkv} heads x {d}, window {window}, "
          f"{e} experts of {inter}, top-8; {flops / 1e12:.1f} TFLOP per step (3x forward)")
    print(markdown_table(["variant", "fwd+bwd ms", "tokens/s", "TFLOP/s", f"MFU (of {peak:.0f})",
                          "vs torch.compile", "h rel. diff vs eager", "first call s"], rows))
    if base.get("compile") and base.get("gemm-floor"):
        need = base["compile"] / 1.3
        print(f"1.3x over torch.compile needs <= {need:.1f} ms per step; the matrix work alone takes "
              f"{base['gemm-floor']:.1f} ms ({'below' if base['gemm-floor'] < need else 'above'} it), leaving "
              f"{need - base['gemm-floor']:.1f} ms for everything else")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(peak_tflops=peak, flops_per_step=flops, args=vars(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
