#!/usr/bin/env bash
# One device call: CUDA kernel tests, kernel benchmarks and sweep, Beam layer benchmark, fused-vs-eager trainer
# parity. Logs and JSON go to $OUT.
# Usage (repo root, on the GPU machine): OUT=/tmp/out bash benchmarks/run_h200.sh [tests|kernels|sweep|layer|parity ...]
# "parity" needs megatron-core importable (the device image lacks it: carry .whl, see docs/benchmarks.md).
set -u -o pipefail
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}. PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=0
OUT=${OUT:-/tmp/beamrl_bench}
mkdir -p "$OUT"
stages=${*:-tests kernels layer}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
for s in $stages; do
  case $s in
    tests) timeout ${TESTS_TIMEOUT:-130} python3 -m pytest tests/kernels -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/tests.log" ;;
    kernels) timeout ${KERNELS_TIMEOUT:-90} python3 benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" ;;
    sweep) timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/kernel_sweep.py --json "$OUT/sweep.json" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" ;;
    parity) timeout ${PARITY_TIMEOUT:-300} python3 -m beamrl.parity.fused_vs_eager --json "$OUT/fused_vs_eager.json" ${PARITY_ARGS:-} 2>&1 | tee "$OUT/parity.log" ;;
    ptests) timeout ${PTESTS_TIMEOUT:-300} python3 -m pytest tests/parity/test_fused_vs_eager.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/ptests.log" ;;
    layer) timeout ${LAYER_TIMEOUT:-240} python3 benchmarks/beam_layer.py --json "$OUT/layer.json" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer.log" ;;
  esac
done
