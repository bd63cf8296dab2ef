#!/usr/bin/env bash
# The embedded default: builds .venv if needed, then trains a tiny Beam on CPU with GRPO on single-digit
# addition (recipes/quickstart.yaml; ~3 minutes on 2 idle cores, after the first set-up). Extra `key=value`
# overrides go to the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/beamrl train recipes/quickstart.yaml "$@"
