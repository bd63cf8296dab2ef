#!/usr/bin/env bash
# Build .venv in the repository root on a fresh CPU-only machine (idempotent).
# Every pin below says why it exists. Re-running skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.beamrl-setup-v4
if [ -f "$STAMP" ] && [ "${BEAMRL_SETUP_FORCE:-0}" != 1 ]; then
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || {
    echo "setup: re-installing beamrl (editable) failed" >&2; exit 1; }
  echo "setup: $VENV is up to date ($STAMP)"; exit 0
fi
echo "setup: creating $VENV with $($PY --version)"
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade "pip>=24" setuptools wheel

echo "setup: [1/6] torch (CPU)"
# torch 2.13.0 CPU: the CI machine's wheel; sglang's CPU engine and megatron-core 0.19.2 both run on it.
# Installed first so that no later package pulls a multi-GB CUDA build.
pip install -q "torch==2.13.0"

echo "setup: [2/6] sglang 0.5.23 without its GPU closure"
# sglang 0.5.23: the first release with a native BeamForCausalLM. --no-deps: its Requires-Dist pins
# torch 2.14.1 + CUDA kernel wheels (>2 GB) that the CPU engine never uses.
pip install -q --no-deps "sglang==0.5.23"
# transformers 5.19.0 / tokenizers 0.23.2: exact pins of sglang 0.5.23 (later installs move tokenizers).
pip install -q "transformers==5.19.0" "tokenizers==0.23.2" safetensors huggingface_hub "numpy<2.5" pillow \
  pydantic fastapi "uvicorn>=0.51" uvloop pyzmq msgspec orjson pybase64 psutil requests setproctitle aiohttp \
  python-multipart prometheus-client partial_json_parser interegular einops tqdm packaging xxhash zstandard \
  sentencepiece tiktoken watchfiles "openai==2.8.0" anthropic distro "blobfile==3.0.0" regex python-dateutil \
  ipython cffi rpds-py jsonschema jsonschema-specifications referencing pybind11
# Import-only dependencies of sglang (no code path of the CPU engine runs them); --no-deps keeps CUDA out.
# triton 3.8.0: imported by sglang and megatron-core at import time; also runs beamrl's Triton kernels in
# interpret mode on CPU.
pip install -q --no-deps "triton==3.8.0" "apache-tvm-ffi==0.1.11" dill compressed-tensors loguru gguf \
  "xgrammar==0.2.7" soundfile

echo "setup: [3/6] megatron-core 0.19.2 (built from the sdist; takes ~1 min)"
# megatron-core 0.19.2: the trainer's pin. It declares Requires-Python>=3.12 but runs on 3.11, so it is
# built from the sdist with --ignore-requires-python; its C++ dataset helper needs pybind11 + numpy first.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('megatron-core')=='0.19.2'" 2>/dev/null; then
  pip install -q --ignore-requires-python --no-build-isolation --no-deps --no-binary megatron-core "megatron-core==0.19.2"
fi

echo "setup: [4/6] ray, data, logging, rewards"
# ray 2.60.0: orchestration pin (placement-group and auth behaviour documented against this release).
# math-verify 0.9.0: the DAPO math reward (parse/verify API with explicit timeouts).
pip install -q "ray[default]==2.60.0" "datasets==5.2.0" "wandb==0.31.0" "tensorboard==2.21.0" \
  "math-verify[antlr4_13_2]==0.9.0" "pyyaml>=6" "matplotlib>=3.8" "pytest==9.2.0" "pytest-timeout==2.4.0" \
  "tokenizers==0.23.2" "transformers==5.19.0"

# peft 0.21.2: loads beamrl's PEFT-format LoRA adapters onto the reference model (tests, evaluation). The newest
# release (declares no transformers upper bound; imports and runs with the transformers 5.19.0 pinned above);
# accelerate 1.15.0 is its one dependency not already here. Pinned with torch/transformers/tokenizers so pip
# cannot move them.
pip install -q "peft==0.21.2" "accelerate==1.15.0" "torch==2.13.0" "transformers==5.19.0" "tokenizers==0.23.2"

# shellcheck: lints the launch/ scripts in the test suite (Debian package; best effort, root only).
if ! command -v shellcheck >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q shellcheck >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
    apt-get install -y -q shellcheck >/dev/null 2>&1; }) || echo "setup: shellcheck not installable here"
fi

echo "setup: [5/6] beamrl (editable)"
pip install -q --no-deps --no-build-isolation -e .

echo "setup: [6/6] import check"
"$VENV/bin/python" - <<'PY'
import importlib, sys
# sglang: a required dependency (the rollout engine); a broken install must fail here, not skip tests.
for mod in ("torch", "megatron.core", "ray", "sglang", "datasets", "math_verify", "safetensors", "yaml", "peft", "beamrl"):
    importlib.import_module(mod)
import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__
print("setup: imports ok; torch", torch.__version__, "python", sys.version.split()[0])
PY
touch "$STAMP"
echo "setup: done ($VENV)"
