"""Compile every beamrl Triton kernel for H200 (sm_90) and B200 (sm_100) without a GPU (catches API breaks between
Triton versions and architectures).

    PYTHONPATH=. python benchmarks/compile_check.py                  # both architectures, per-kernel PTX facts
    PYTHONPATH=. python benchmarks/compile_check.py --arch 100       # B200 only
    PYTHONPATH=. python benchmarks/compile_check.py --registers      # + registers and spills (ptxas -v, sm_XXa)

Uses `triton.compile` with an explicit `GPUTarget("cuda", <capability>, 32)`, which runs Triton's own ptxas, so it
works on a CPU-only machine. It also reports whether the PTX contains FMA contraction (must not, for the forward
kernels) and which rsqrt/exp/div instructions were used. Exit code 1 if any kernel fails on any architecture.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from beamrl.kernels import moe_combine, output_gate, partial_sums, qk_norm, router_topk, sandwich_residual, swiglu

BF = "*bf16"
F32 = "*fp32"

# Argument types of the kernels compiled more than once below.
SANDWICH_FWD = {"branch_ptr": BF, "residual_ptr": BF, "post_w_ptr": BF, "pre_w_ptr": BF, "out_res_ptr": BF,
                "out_pre_ptr": BF, "rstd_post_ptr": F32, "rstd_pre_ptr": F32, "inv_h": "fp32", "eps": "fp32",
                "s_branch": "fp32", "s_res": "fp32"}
SANDWICH_BWD = {"branch_ptr": BF, "h_ptr": BF, "g_res_ptr": BF, "g_pre_ptr": BF, "post_w_ptr": BF, "pre_w_ptr": BF,
                "rstd_post_ptr": F32, "rstd_pre_ptr": F32, "d_branch_ptr": BF, "d_res_ptr": BF, "dw_post_ptr": F32,
                "dw_pre_ptr": F32, "inv_h": "fp32", "s_branch": "fp32", "s_res": "fp32"}
QK_FWD = {"q_ptr": BF, "k_ptr": BF, "wq_ptr": BF, "wk_ptr": BF, "cos_ptr": F32, "sin_ptr": F32, "scale_ptr": F32,
          "qo_ptr": BF, "ko_ptr": BF, "inv_d": "fp32", "eps": "fp32"}
QK_BWD = {"q_ptr": BF, "k_ptr": BF, "wq_ptr": BF, "wk_ptr": BF, "cos_ptr": F32, "sin_ptr": F32, "scale_ptr": F32,
          "gq_ptr": BF, "gk_ptr": BF, "dq_ptr": BF, "dk_ptr": BF, "dw_ptr": F32, "inv_d": "fp32", "eps": "fp32"}


def _sig(fn, types, constexprs):
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types.get(name, "i32")
    return sig


def _cases():
    flags = {"ROUND_BF16": 2, "INTERPRET": False}  # the hardware BF16 cast, as on a GPU
    yield ("sandwich fwd", sandwich_residual._fwd_kernel, SANDWICH_FWD,
           {"HAS_PRE": True, "CHUNK": 1024, "ONE_PASS": False, **flags}, 4, False)
    yield ("sandwich fwd, bit-trick rounding", sandwich_residual._fwd_kernel, SANDWICH_FWD,
           {"HAS_PRE": True, "CHUNK": 8192, "ONE_PASS": True, **flags, "ROUND_BF16": 1}, 8, False)
    yield ("sandwich fwd one pass", sandwich_residual._fwd_kernel, SANDWICH_FWD,
           {"HAS_PRE": True, "CHUNK": 8192, "ONE_PASS": True, **flags}, 16, False)
    yield ("sandwich fwd staged", sandwich_residual._fwd_staged_kernel, SANDWICH_FWD,
           {"HAS_PRE": True, "BA": 4096, "BB": 1024, "STAGES": 3, **flags}, 16, False)
    for stages in (1, 3):
        yield (f"sandwich bwd, {stages} stage(s)", sandwich_residual._bwd_kernel, SANDWICH_BWD,
               {"HAS_PRE_GRAD": True, "HAS_RES_GRAD": True, "BA": 4096, "BB": 1024, "STAGES": stages}, 8, True)
    for mq, mk in ((qk_norm.MODE_ROPE, qk_norm.MODE_ROPE), (qk_norm.MODE_SSMAX, qk_norm.MODE_NORM)):
        heads = {"HQ": 48, "HK": 8, "MODE_Q": mq, "MODE_K": mk, "HALF": 64, "HBQ": 16, "HBK": 8}
        yield (f"qk_norm fwd modes {mq}/{mk}", qk_norm._fwd_kernel, QK_FWD, {**heads, "TB": 2, **flags}, 4, False)
        for tb, stages in ((4, 1), (64, 3)):
            yield (f"qk_norm bwd modes {mq}/{mk}, {stages} stage(s)", qk_norm._bwd_kernel, QK_BWD,
                   {**heads, "TB": tb, "STAGES": stages}, 4, True)
    yield ("output_gate fwd", output_gate._fwd_kernel, {"o_ptr": BF, "g_ptr": BF, "b_ptr": BF, "y_ptr": BF},
           {"D": 128, "HB": 16, "TB": 1, **flags}, 4, True)  # FMAs only inside libdevice expf (as CUDA's expf)
    yield ("output_gate bwd", output_gate._bwd_kernel,
           {"o_ptr": BF, "g_ptr": BF, "b_ptr": BF, "gy_ptr": BF, "do_ptr": BF, "dg_ptr": BF, "db_ptr": F32},
           {"D": 128, "HB": 16, **flags}, 4, True)
    yield ("swiglu fwd", swiglu._fwd_kernel, {"gu_ptr": BF, "act_ptr": BF}, {"RB": 4, "BLOCK": 512, **flags}, 4, True)
    yield ("swiglu bwd", swiglu._bwd_kernel, {"gu_ptr": BF, "da_ptr": BF, "dgu_ptr": BF},
           {"RB": 2, "BLOCK": 512, "INTERPRET": False}, 4, True)
    yield ("moe_combine fwd", moe_combine._fwd_kernel,
           {"y_ptr": BF, "pos_ptr": "*i64", "w_ptr": F32, "out_ptr": BF, "scaling": "fp32"},
           {"K": 8, "BLOCK": 1024, **flags}, 4, False)
    yield ("moe_combine bwd", moe_combine._bwd_kernel,
           {"y_ptr": BF, "pos_ptr": "*i64", "w_ptr": F32, "g_ptr": BF, "dy_ptr": BF, "dw_ptr": F32, "scaling": "fp32"},
           {"K": 8, "BLOCK": 8192}, 16, True)
    yield ("partial sums", partial_sums._sum_kernel, {"src_ptr": F32, "out_ptr": BF}, {"ROWS": 32, "COLS": 32, "STAGES": 3}, 4,
           True)
    yield ("router top-k", router_topk._topk_kernel,
           {"z_ptr": F32, "bias_ptr": F32, "w_ptr": F32, "id_ptr": "*i64", "eps": "fp32"},
           {"E": 256, "G": 8, "K": 8, "KG": 4, "KP": 8, "BT": 16, "ROUND_BF16": False, "INTERPRET": False}, 4, True)


# Integer arguments that are multiples of 16 at real sizes; the JIT specialises them (and 16-byte aligned
# pointers) as divisible by 16, which is what lets loads vectorise. Mirror that here.
_DIVISIBLE_INTS = {"stride_b", "stride_r", "stride_o", "stride_p", "H", "stride_t", "stride_h", "so_t", "so_h",
                   "sg_t", "sg_h", "I", "stride_gu", "sq_t", "sq_h", "sk_t", "sk_h"}


# GPU type -> CUDA compute capability (the recipe's cluster.gpu_type values).
ARCHS = {"h200": 90, "b200": 100}


def ptxas_registers(ptx: str, capability: int) -> str:
    """'regs=N spills=B' from the ptxas that ships with Triton (register pressure without a GPU): the one Triton
    itself picks for the architecture (Triton 3.8 ships a separate, newer ptxas for Blackwell)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(capability).path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run([ptxas, f"-arch=sm_{capability}a", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, timeout=120).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", err)
    spills = re.search(r"(\d+) bytes spill stores", err)
    return f"regs={regs.group(1) if regs else '?'} spills={spills.group(1) if spills else '?'}"


def check(capability: int, registers: bool = False, only: str | None = None) -> bool:
    """Compile every kernel (or those whose name contains `only`) for `capability`; print a line per kernel."""
    target = GPUTarget("cuda", capability, 32)
    ok = True
    for name, fn, types, constexprs, warps, fusion in _cases():
        if only is not None and only not in name:
            continue
        try:
            sig = _sig(fn, types, constexprs)
            attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                     if sig[a].startswith("*") or a in _DIVISIBLE_INTS}
            src = ASTSource(fn, sig, constexprs, attrs)
            # forward kernels are compiled WITH fp fusion here: mul_rn must keep them FMA-free regardless
            kern = triton.compile(src, target=target, options={"num_warps": warps, "enable_fp_fusion": True})
            ptx = kern.asm["ptx"]
            if f".target sm_{capability}" not in ptx:
                raise RuntimeError(f"the PTX does not target sm_{capability}")
            facts = {k: len(re.findall(p, ptx)) for k, p in
                     (("fma", r"\bfma\.rn\.f32"), ("rsqrt.approx", r"rsqrt\.approx"), ("ex2.approx", r"ex2\.approx"),
                      ("div.rn", r"div\.rn\.f32"), ("div.full", r"div\.full"), ("ld.v4", r"ld\.global\.v4"),
                      ("ld.scalar16", r"ld\.global\.b16"), ("cvt.bf16", r"cvt\.rn\.bf16"),
                      ("ld.v2", r"ld\.global\.v2"), ("ld.b32", r"ld\.global\.b32"), ("st.v4", r"st\.global\.v4"),
                      ("local", r"\.local"), ("cp.async", r"cp\.async\.(?:ca|cg)"))}
            if not fusion and facts["fma"]:
                ok = False
                print(f"FAIL sm_{capability} {name}: FMA contraction in a forward kernel")
            regs = f" {ptxas_registers(ptx, capability)}" if registers else ""
            print(f"ok   sm_{capability} {name:26s} warps={warps} shared={kern.metadata.shared}{regs} {facts}")
        except Exception as err:  # report all kernels, fail at the end
            ok = False
            print(f"FAIL sm_{capability} {name}: {type(err).__name__}: {str(err)[:400]}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="90,100", help="compute capabilities, comma-separated (default: 90,100 = "
                   "H200 and B200)")
    p.add_argument("--registers", action="store_true", help="also print registers and spills (ptxas -v)")
    p.add_argument("--only", default=None, help="only the kernels whose name contains this")
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}")
    results = [check(int(cc), args.registers, args.only) for cc in args.arch.split(",")]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
