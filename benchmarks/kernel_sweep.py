"""Sweep the launch tuning of the memory-bound Triton kernels on one GPU and print the best choices.

Each kernel module keeps its launch choices in a `TUNING` dict (and `_triton_utils.TUNING["rounding"]` picks
the BF16 rounding instruction). For every candidate this script sets the dict, times the forward alone and the
backward alone (CUDA events behind a spin kernel, as benchmarks/kernels.py), converts both to GB/s with the
fewest bytes each pass must move, and checks the outputs against the module's defaults: bit-equal where the
choice cannot change a result, and within the normalising kernels' contract where it changes a reduction order.

Two ceilings of the same run are printed: the 2 GiB device-to-device copy (the target's reference) and a copy
of the kernel's own byte count (what a copy of that size reaches; small copies pay the launch ramp).

    PYTHONPATH=. python benchmarks/kernel_sweep.py --json /tmp/sweep.json
    PYTHONPATH=. python benchmarks/kernel_sweep.py --only swiglu --tokens 2048
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch

if "--smoke-cpu" in sys.argv:  # Triton's own interpreter switch, read when the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cuda" if torch.cuda.is_available() and "--smoke-cpu" not in sys.argv else "cpu"

from benchmarks._bench_utils import (add_beam_width_args, copy_bandwidth_gbs, cuda_median_ms, markdown_table,
                                     write_kernel_rows)


def _copy_of_size_gbs(nbytes: int) -> float:
    """Copy bandwidth (read + write) of a copy that moves `nbytes` in total."""
    n = max(1, nbytes // 4)  # bf16 elements per side: nbytes / 2 sides / 2 bytes
    x = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = cuda_median_ms(lambda: y.copy_(x), iters=20)
    return 4 * n / (ms * 1e-3) / 1e9


def _time_pass(run, inputs, n_grad):
    """(forward ms, backward ms, forward outputs, gradients) of run(inputs) -> tuple of tensors. The backward
    runs on contiguous clones of the inputs (q/k are strided views of one projection in the forward timing)."""
    with torch.no_grad():
        outs = run(inputs)
    fwd = cuda_median_ms(lambda: run(inputs), iters=10, warmup=2)
    leaves = [x.detach().clone().requires_grad_() if i < n_grad else x for i, x in enumerate(inputs)]
    probe = [o for o in run(leaves) if o is not None and o.is_floating_point()]
    torch.manual_seed(1)  # the same output gradients for every candidate
    grads = [torch.randn_like(o) for o in probe]
    bwd = cuda_median_ms(lambda: torch.autograd.grad(probe, leaves[:n_grad], grads, retain_graph=True), iters=10,
                         warmup=2)
    g = torch.autograd.grad(probe, leaves[:n_grad], grads, retain_graph=True)
    return fwd, bwd, [o for o in outs if o is not None], list(g)


def _grid(**axes):
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(axes[k] for k in keys))]


def _cases(t, h, hq, hkv, d, inter):
    from beamrl.kernels import ops, output_gate, qk_norm, sandwich_residual, swiglu
    from beamrl.models.beam import numerics

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV) * scale).to(torch.bfloat16)

    scales = (1 / math.sqrt(8), math.sqrt(7) / math.sqrt(8))
    act = t * h * 2
    yield dict(name="post_norm_residual_pre_norm", module=sandwich_residual,
               inputs=lambda: [rnd(t, h, scale=3), rnd(t, h), rnd(h), rnd(h)],
               run=lambda x: ops.post_norm_residual_pre_norm(x[0], x[1], x[2], x[3], scales, 1e-6, backend="triton"),
               n_grad=4, fwd_bytes=4 * act, bwd_bytes=6 * act,
               reorders={"fwd_layout", "fwd_chunk", "fwd_warps", "fwd_row_warps", "fwd_stages", "fwd_per_sm"},
               fwd=(_grid(fwd_layout=["row"], fwd_row_warps=[4, 8, 16])
                    + _grid(fwd_layout=["chunked"], fwd_chunk=[1024, 2048], fwd_row_warps=[4, 8])
                    + _grid(fwd_layout=["staged"], fwd_stages=[3, 4], fwd_warps=[8, 16], fwd_per_sm=[2, 4])),
               bwd=_grid(bwd_stages=[3], bwd_warps=[8], bwd_finish=["torch", "triton"]))
    pos = torch.arange(t, device=DEV)
    cos, sin = numerics.rope_cos_sin(pos, d, 10000.0)
    ssmax = numerics.ssmax_scale(pos)
    qk_bytes = t * (hq + hkv) * d * 2

    def qk_inputs():
        qk = rnd(t, (hq + hkv) * d, scale=2)
        return [qk[:, :hq * d].view(t, hq, d), qk[:, hq * d:].view(t, hkv, d), rnd(d), rnd(d)]

    qk_fwd = _grid(fwd_tokens=[1], fwd_warps=[4])
    qk_bwd = (_grid(bwd_tokens=[8, 32], bwd_stages=[1, 3], bwd_warps=[4], bwd_finish=["torch"])
              + _grid(bwd_tokens=[8, 16, 32, 64], bwd_stages=[1, 3, 4], bwd_warps=[4], bwd_finish=["triton"]))
    yield dict(name="qk_norm_rope", module=qk_norm, inputs=qk_inputs,
               run=lambda x: ops.qk_norm_rope(x[0], x[1], x[2], x[3], cos, sin, 1e-6, backend="triton"), n_grad=4,
               fwd_bytes=2 * qk_bytes + t * d * 4, bwd_bytes=3 * qk_bytes + t * d * 4, reorders=set(),
               fwd=qk_fwd, bwd=qk_bwd)
    yield dict(name="qk_norm_ssmax", module=qk_norm, inputs=qk_inputs,
               run=lambda x: ops.qk_norm_ssmax(x[0], x[1], x[2], x[3], ssmax, 1e-6, backend="triton"), n_grad=4,
               fwd_bytes=2 * qk_bytes + t * 4, bwd_bytes=3 * qk_bytes + t * 4, reorders=set(), fwd=qk_fwd,
               bwd=qk_bwd)
    og = t * hq * d * 2
    yield dict(name="output_gate", module=output_gate, inputs=lambda: [rnd(t, hq, d), rnd(t, hq, d, scale=3), rnd(hq)],
               run=lambda x: (ops.output_gate(x[0], x[1], x[2], backend="triton"),), n_grad=3,
               fwd_bytes=3 * og, bwd_bytes=5 * og, reorders=set(),
               fwd=_grid(fwd_elems=[1024, 2048, 4096], fwd_tokens=[1, 2, 4], fwd_warps=[4, 8]),
               bwd=_grid(bwd_elems=[1024, 2048], bwd_warps=[4, 8], bwd_per_sm=[2, 4, 8]))
    n = t * 8
    from beamrl.kernels.swiglu import fused_swiglu
    yield dict(name="swiglu", module=swiglu, inputs=lambda: [rnd(n, 2 * inter, scale=3)],
               run=lambda x: (fused_swiglu(x[0]),), n_grad=1, fwd_bytes=n * 3 * inter * 2,
               bwd_bytes=n * 5 * inter * 2, reorders=set(),
               fwd=_grid(block=[256, 512, 1024], rows=[1, 2, 4, 8], warps=[4, 8]),
               bwd=_grid(bwd_block=[256, 512, 1024], bwd_rows=[1, 2, 4], bwd_warps=[4, 8]))


def _same(a, b, reorder: bool) -> bool:
    """Bit-equal, or for a reduction-order change: at most 1e-4 of the elements off, by a small amount."""
    if torch.equal(a, b):
        return True
    if not reorder:
        return False
    diff = a != b
    close = (a.float() - b.float()).abs().max() <= b.float().abs().max() * 2 ** -7
    return bool(diff.float().mean() <= 1e-4 and close)


def _grad_close(a, b) -> bool:
    """Gradients: bit-equal, or (weight gradients summed from per-program partials in another order) close."""
    if torch.equal(a, b):
        return True
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= 2e-3 * b.norm())


def sweep(case, copy_bw, rounding_modes) -> list[dict]:
    from beamrl.kernels import _triton_utils

    mod = case["module"]
    default = dict(mod.TUNING)
    torch.manual_seed(0)
    inputs = case["inputs"]()
    size_copy = _copy_of_size_gbs(case["fwd_bytes"])
    rows = []
    ref = None
    candidates = [("default", {}, None)] + [("rounding", {}, m) for m in rounding_modes]
    fwd_grid, bwd_grid = (case["fwd"], case["bwd"]) if DEV == "cuda" else (case["fwd"][-1:], case["bwd"][-1:])
    candidates += [("fwd", c, None) for c in fwd_grid] + [("bwd", c, None) for c in bwd_grid]
    for kind, cfg, rounding in candidates:
        mod.TUNING.clear()
        mod.TUNING.update(default, **cfg)
        _triton_utils.TUNING["rounding"] = rounding
        try:
            fwd, bwd, outs, grads = _time_pass(case["run"], inputs, case["n_grad"])
        except Exception as err:  # noqa: BLE001 - a config that does not compile/fit is reported, not fatal
            rows.append(dict(op=case["name"], kind=kind, config=cfg, rounding=rounding,
                             error=f"{type(err).__name__}: {str(err)[:200]}"))
            print(f"  {kind:8s} {cfg} rounding={rounding}: ERROR {rows[-1]['error']}", flush=True)
            continue
        reorder = bool(set(cfg) & case["reorders"])
        if ref is None:
            ref = (outs, grads)
            ok = True
        else:
            ok = all(_same(a, b, reorder) for a, b in zip(outs, ref[0]))
            ok = ok and all(_grad_close(a, b) for a, b in zip(grads, ref[1]))
        row = dict(op=case["name"], kind=kind, config=cfg, rounding=rounding, fwd_ms=fwd, bwd_ms=bwd,
                   fwd_gbs=case["fwd_bytes"] / fwd / 1e6, bwd_gbs=case["bwd_bytes"] / bwd / 1e6, matches_default=ok,
                   copy_gbs=copy_bw, copy_same_size_gbs=size_copy)
        row["fwd_frac"] = row["fwd_gbs"] / copy_bw
        row["bwd_frac"] = row["bwd_gbs"] / copy_bw
        rows.append(row)
        print(f"  {kind:8s} {json.dumps(cfg):60s} rnd={rounding} fwd {fwd * 1e3:7.1f} us ({row['fwd_frac']:.2f})"
              f"  bwd {bwd * 1e3:7.1f} us ({row['bwd_frac']:.2f})  {'ok' if ok else 'MISMATCH'}", flush=True)
    mod.TUNING.clear()
    mod.TUNING.update(default)
    _triton_utils.TUNING["rounding"] = None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_beam_width_args(ap)
    ap.add_argument("--intermediate", type=int, default=2560)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny sizes on the Triton interpreter (no timings)")
    args = ap.parse_args(argv)
    if DEV != "cuda" and not args.smoke_cpu:
        print("benchmarks/kernel_sweep.py needs a CUDA device (or --smoke-cpu)", file=sys.stderr)
        return 2
    from beamrl.kernels._triton_utils import ROUND_BITS, ROUND_CVT

    copy_bw = copy_bandwidth_gbs(2.0 if DEV == "cuda" else 0.001, device=DEV)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}  torch {torch.__version__}  copy (2 GiB) {copy_bw:,.0f} GB/s", flush=True)
    rows = []
    for case in _cases(args.tokens, args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate):
        if args.only and case["name"] not in args.only:
            continue
        print(f"== {case['name']}", flush=True)
        rows += sweep(case, copy_bw, [ROUND_BITS, ROUND_CVT] if DEV == "cuda" else [ROUND_BITS])
    table = []
    for op in dict.fromkeys(r["op"] for r in rows):
        ok = [r for r in rows if r["op"] == op and "error" not in r and r["matches_default"]]
        d = next((r for r in ok if r["kind"] == "default"), None)
        if d is None:
            table.append([op, "default failed: see the log", "", "", "", "", "", ""])
            continue
        bf = min((r for r in ok if r["kind"] in ("default", "fwd")), key=lambda r: r["fwd_ms"])
        bb = min((r for r in ok if r["kind"] in ("default", "bwd")), key=lambda r: r["bwd_ms"])
        table.append([op, d["fwd_frac"], bf["fwd_frac"], json.dumps(bf["config"]), d["bwd_frac"], bb["bwd_frac"],
                      json.dumps(bb["config"]), d["copy_same_size_gbs"] / copy_bw])
    print(markdown_table(["op", "default fwd / copy", "best fwd / copy", "best fwd config", "default bwd / copy",
                          "best bwd / copy", "best bwd config", "same-size copy / copy"], table))
    write_kernel_rows(args.json, copy_bw, name, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
