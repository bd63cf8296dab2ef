#!/usr/bin/env bash
# Build the separate venv for the TRL peer of benchmarks/trl_vs_beamrl.py (idempotent).
# Separate because sglang 0.5.23 pins transformers==5.19.0 in .venv, while the TRL peer was verified on
# transformers 5.24.0 (shared notes, ray-and-friends.md §0). torch goes in FIRST, from the CPU wheel, so
# that installing trl cannot pull a CUDA torch.
#   bash benchmarks/trl_env.sh            # -> .venv-trl/ at the repo root (VENV_TRL=... to move it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV_TRL:-$ROOT/.venv-trl}"
PY="${PYTHON:-python3.11}"
TORCH_PIN="torch==2.13.0"
PEER_PINS=(trl==1.16.0 transformers==5.24.0 accelerate==1.15.0 tokenizers==0.23.3)

check() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import torch, trl, transformers
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
assert trl.__version__ == "1.16.0", trl.__version__
assert transformers.__version__ == "5.24.0", transformers.__version__
PY
}

if [[ -x "$VENV/bin/python" ]] && check; then
  echo "trl_env: $VENV already has torch 2.13.0+cpu, trl 1.16.0, transformers 5.24.0"
  exit 0
fi
echo "trl_env: building $VENV with $PY"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# CPU wheel first (pip's find-links dir holds torch-2.13.0+cpu here); later installs then see torch satisfied
# and cannot resolve a CUDA build for trl's torch requirement.
"$VENV/bin/python" -m pip install -q "$TORCH_PIN"
"$VENV/bin/python" -m pip install -q "${PEER_PINS[@]}" "$TORCH_PIN"
check || { echo "trl_env: $VENV failed the version check (want torch 2.13.0+cpu, trl 1.16.0, transformers 5.24.0)" >&2; exit 1; }
echo "trl_env: ready: $VENV"
