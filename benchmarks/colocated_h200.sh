#!/usr/bin/env bash
# Colocated RL on ONE GPU through `beamrl train`: the Megatron trainer and the embedded native engine share the GPU,
# the trainer sleeps while the engine generates. Prints and writes (JSON) the trainer's GPU memory while asleep vs its
# training peak (target < 10 %), sleep and wake seconds and the per-phase step times (docs/colocated.md).
#
# Usage (repo root, on the GPU machine; ray, megatron-core and pydantic importable, e.g. from /tmp/site):
#   OUT=/tmp/out EXTRA_PYTHONPATH=/tmp/site bash benchmarks/colocated_h200.sh [key=value recipe overrides ...]
# Writes $OUT/train.log, $OUT/report.txt, $OUT/colocated_h200.json, $OUT/nvidia_smi.csv (per-process GPU memory every 0.5 s, with the
# process title: the trainer's row shows its device-level memory, CUDA context and NCCL included) and the
# run's metrics.jsonl, summary.json and recipe.yaml under $OUT/run (the run itself in $RUN_DIR, removed afterwards
# unless KEEP_RUN=1). Starts a private one-node Ray head (port $RAY_PORT, default 6390) and stops it.
set -u -o pipefail
REPO=$(pwd)
OUT=${OUT:-/tmp/beamrl_colocated}
# The run (its checkpoints are large) lives outside $OUT; its metrics, summary and recipe are copied into $OUT/run.
RUN_DIR=${RUN_DIR:-/tmp/beamrl_colocated_run}
RECIPE=${RECIPE:-benchmarks/colocated_h200.yaml}
RAY_PORT=${RAY_PORT:-6390}
mkdir -p "$OUT"
# Ray workers do not start in the repo: the repo goes on PYTHONPATH as an absolute path.
export PYTHONPATH="$REPO${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 RAY_USAGE_STATS_ENABLED=0
unset PYTORCH_CUDA_ALLOC_CONF  # expandable segments break CUDA IPC (the colocated sync shares slots by IPC)

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, ray, megatron.core as m; print("torch", torch.__version__, "ray", ray.__version__, "mcore", m.__version__)' \
  | tee -a "$OUT/gpu.txt" || { echo "colocated_h200.sh: torch, ray and megatron-core must be importable" >&2; exit 2; }

python3 -m ray.scripts.scripts start --head --port="$RAY_PORT" --num-gpus=1 --num-cpus="$(nproc)" \
  --disable-usage-stats --include-dashboard=false > "$OUT/ray_start.log" 2>&1 \
  || { cat "$OUT/ray_start.log"; echo "colocated_h200.sh: ray start failed" >&2; exit 2; }
export RAY_ADDRESS="127.0.0.1:$RAY_PORT"
# per GPU process every 0.5 s: time, pid, MiB used (CUDA context and NCCL included), process title (ray::TrainerActor...)
( while true; do
    now=$(date +%s.%N)
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | while IFS=', ' read -r pid mib; do
      title=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-60)
      echo "$now,$pid,$mib,${title//,/ }"
    done
    sleep 0.5
  done ) > "$OUT/nvidia_smi.csv" 2>/dev/null &
SAMPLER=$!
cleanup() { kill "$SAMPLER" 2>/dev/null; python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1; }
trap cleanup EXIT

df -h "$(dirname "$RUN_DIR")" | tee -a "$OUT/gpu.txt"
timeout "${TRAIN_TIMEOUT:-540}" python3 -m beamrl.cli train --overwrite "$RECIPE" "run.output_dir=$RUN_DIR" "$@" \
  2>&1 | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
mkdir -p "$OUT/run"
cp "$RUN_DIR"/metrics.jsonl "$RUN_DIR"/summary.json "$RUN_DIR"/recipe.yaml "$OUT/run/" 2>/dev/null
[[ ${KEEP_RUN:-0} == 1 ]] || rm -rf "$RUN_DIR"
python3 benchmarks/colocated_report.py "$OUT/run" --json "$OUT/colocated_h200.json" --smi "$OUT/nvidia_smi.csv" \
  | tee "$OUT/report.txt"
exit "$rc"
